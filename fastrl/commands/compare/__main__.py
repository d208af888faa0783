"""A run of a comparison (``python -m fastrl.commands.compare train ...``, ``runs.RUN_MODULE``):
``fastrl train``, ended with its parent.

The kernel is asked to SIGTERM this process when the comparison's thread that started it ends
(Linux); a run whose parent is already another process (the comparison ended while it started)
exits at once.
"""

from __future__ import annotations

import os
import signal
import sys

from fastrl import cli_style
from fastrl.commands.compare.runs import PARENT_PID_ENV, RUN_MODULE
from fastrl.train.cli import run_train
from fastrl.workers import set_parent_death_signal

set_parent_death_signal(signal.SIGTERM)
if os.environ.get(PARENT_PID_ENV) not in (None, str(os.getppid())):
    sys.exit(128 + signal.SIGTERM)  # the comparison ended before the signal was asked for
run_argv, run_debug = cli_style.pop_debug(sys.argv[1:])
if run_argv[:1] != ["train"]:
    sys.exit(f"usage: python -m {RUN_MODULE} train [train options]")
sys.exit(cli_style.run_reporting_input_errors("train", lambda: run_train(run_argv[1:]), debug=run_debug))
