"""`python -m fastrl` runs the fastrl command line."""

import sys

from fastrl.cli import main

sys.exit(main())
