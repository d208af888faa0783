"""Importing this module registers fastrl's functions with verl (``fastrl.integrations.verl.register()``).

verl imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` (and the ``verl.plugins``
entry points) when ``verl`` itself is imported, in the driver and in every Ray worker, so

    export VERL_USE_EXTERNAL_MODULES=fastrl.integrations.verl_plugin

makes the ``fastrl_*`` estimators and losses available everywhere verl runs. Set
``FASTRL_VERL_REPLACE_BUILTIN=1`` to also route verl's built-in ``gae`` / ``grpo``
estimators to fastrl (``register(replace_builtin=True)``).
"""

import os

from fastrl.integrations.verl import register

register(replace_builtin=os.environ.get("FASTRL_VERL_REPLACE_BUILTIN", "0") == "1")
