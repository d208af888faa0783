"""Ctrl-C (SIGINT) and SIGTERM for ``fastrl train``: stop at a step boundary, checkpointed.

``StopRequests`` is installed by the command line around a run (the Python API keeps Python's
own ``KeyboardInterrupt``). While the warm-up or the RL loop runs (``deferring``), the first
signal only asks it to stop: it finishes the step in progress, writes a checkpoint (the
warm-up's state, ``fastrl.train.run.warmup_checkpoint``, or RL's) and raises ``RunInterrupted``
naming it, so ``--resume latest`` continues exactly where it stopped. A second signal, or one
outside them (loading the model and data, building the models), raises ``RunInterrupted`` at
once. The command prints one line and exits ``128 + signal`` (130 for SIGINT, 143 for
SIGTERM), the shell's convention, so a script chaining commands sees the run did not finish.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

__all__ = ["RunInterrupted", "StopRequests", "STOP_SIGNALS", "exit_status", "interrupted_message"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run like Ctrl-C."""


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by ``signum``: 128 + its number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signum)


class RunInterrupted(BaseException):
    """A run stopped by a signal (a ``BaseException``, like ``KeyboardInterrupt``: no
    ``except Exception`` on the way up may swallow it). ``checkpoint``: the one written on
    the way out, when the loop stopped at a step boundary."""

    def __init__(self, signum: int, *, checkpoint: Path | None = None, step: int | None = None):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)
        self.checkpoint = checkpoint
        self.step = step


class StopRequests:
    """Signal handlers for ``STOP_SIGNALS`` (a context manager; the previous handlers come back
    on exit). ``deferring``: the RL loop is running, and a first signal only sets ``signum``
    (``requested``); otherwise a signal raises ``RunInterrupted`` where the main thread is."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.deferring = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002 - the signal handler's signature
        if self.deferring and self.signum is None:
            self.signum = signum
            return
        raise RunInterrupted(self.signum or signum)

    def __enter__(self) -> "StopRequests":
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


def newest_on_disk(output_dir: str | Path) -> Path | None:
    """The checkpoint ``--resume latest`` would consider first in ``output_dir`` (a signal while
    a resumed run loads still leaves the one it resumed from), else None."""
    from fastrl.train.run.checkpoint import list_checkpoints
    from fastrl.train.run.warmup_checkpoint import list_warmup_checkpoints

    found = list_warmup_checkpoints(output_dir) + list_checkpoints(output_dir)
    return found[-1] if found else None


def interrupted_message(error: RunInterrupted, *, output_dir: str | Path, last_checkpoint: Path | None) -> str:
    """The one line ``fastrl train`` prints when a signal stopped it."""
    name = signal.Signals(error.signum).name
    checkpoint = error.checkpoint or last_checkpoint or newest_on_disk(output_dir)
    if checkpoint is not None:
        return (f"fastrl train: stopped by {name}; checkpoint {checkpoint}: continue with "
                f"fastrl train --output_dir {output_dir} --resume latest (and the run's other options)")
    return (f"fastrl train: stopped by {name} before the first checkpoint (the warm-up writes one when stopped, RL every "
            f"step it is stopped at): nothing for --resume latest to continue; start the run again with --overwrite true")
