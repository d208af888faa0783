"""Import paths that moved: an old dotted module name keeps importing its module at its new home.

``MOVED_MODULES`` is the one list, old name -> new name. ``import fastrl.train.compare`` (or
``from fastrl.train import compare``) then returns the module object of ``fastrl.commands.compare``
itself, so a user's imports, attribute reads and monkeypatches reach the one real module. A moved
module leaves no file behind at its old place. ``fastrl/__init__.py`` installs the finder, so it is
in place before any ``fastrl`` subpackage is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType

MOVED_MODULES: dict[str, str] = {
    # the commands that are programs of their own left the trainer's folder (issue 40)
    "fastrl.train.compare": "fastrl.commands.compare",
    "fastrl.train.plan": "fastrl.commands.plan",
    "fastrl.train.paired": "fastrl.commands.paired",
    # the step's micro-batching classes are no longer called *Layout (issue 40)
    "fastrl.train.layout": "fastrl.train.batching",
    # the trainer's agent wing (issue 40): fastrl/train/agent_*.py -> fastrl/train/agent/
    "fastrl.train.agent_build": "fastrl.train.agent.build",
    "fastrl.train.agent_collect": "fastrl.train.agent.collect",
    "fastrl.train.agent_tree_collect": "fastrl.train.agent.tree_collect",
    "fastrl.train.agent_evaluate": "fastrl.train.agent.evaluate",
    "fastrl.train.agent_score": "fastrl.train.agent.score",
    "fastrl.train.agent_task": "fastrl.train.env_task",
    # the built-in environments' defaults sit beside task.py's, below the config rule that reads them
    "fastrl.train.agent.defaults": "fastrl.train.env_task",
    # the run's housekeeping (issue 40): fastrl/train/<module>.py -> fastrl/train/run/
    "fastrl.train.interrupt": "fastrl.train.run.interrupt",
    "fastrl.train.threads": "fastrl.train.run.threads",
    "fastrl.train.hub": "fastrl.train.run.hub",
    "fastrl.train.heap": "fastrl.train.run.heap",
    "fastrl.train.faults": "fastrl.train.run.faults",
    "fastrl.train.manifest": "fastrl.train.run.manifest",
    "fastrl.train.checkpoint": "fastrl.train.run.checkpoint",
    "fastrl.train.warmup_checkpoint": "fastrl.train.run.warmup_checkpoint",
    "fastrl.train.progress": "fastrl.train.run.progress",
    "fastrl.train.metrics": "fastrl.train.run.metrics",
}
"""Old dotted module name -> its new one (filled as modules move; read by the finder at import time)."""


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder whose modules are the moved modules' new homes."""

    def __init__(self, moved: dict[str, str]) -> None:
        self.moved = moved
        self._own_specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.moved:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # the new home's module object itself: import machinery keeps its __name__, __loader__ and
        # __path__, but stamps the old name's spec on it, which exec_module takes back
        module = importlib.import_module(self.moved[spec.name])
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module executed under its new name): only its own spec goes back,
        so ``reload``, pickling by module and a spawned worker's main module see its real name."""
        module.__spec__ = self._own_specs.pop(module.__name__, module.__spec__)

    def get_code(self, fullname: str) -> CodeType:
        """``python -m <old name>``: runpy asks for code to run as ``__main__``; it runs the new
        module (or package's ``__main__``) as ``__main__``, with the command line as given."""
        source = f"import runpy\nrunpy.run_module({self.moved[fullname]!r}, run_name='__main__', alter_sys=True)\n"
        return compile(source, f"<moved module {fullname} -> {self.moved[fullname]}>", "exec")


def install(moved: dict[str, str] = MOVED_MODULES) -> MovedModuleFinder:
    """Put the finder for ``moved`` on ``sys.meta_path`` (once; the same finder on a second call)."""
    for finder in sys.meta_path:
        if isinstance(finder, MovedModuleFinder) and finder.moved is moved:
            return finder
    finder = MovedModuleFinder(moved)
    sys.meta_path.insert(0, finder)
    return finder
