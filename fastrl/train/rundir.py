"""One run per output directory: an exclusive lock held for the life of the trainer.

:func:`lock_run_directory` creates ``output_dir`` (if needed) and takes an exclusive,
non-blocking ``fcntl.flock`` on ``output_dir/.fastrl.lock``. A second ``fastrl train`` on
the same directory, while the first runs, is refused with an
:class:`~fastrl.errors.InputError` naming the directory and the holder's pid. The kernel
drops the lock when the holder's process ends, however it ends (kill -9 included), so a
lock file left behind by a dead run is no obstacle: there are no stale locks to detect.

Two details make the lock belong to exactly one trainer process:

- processes forked from the trainer (reward and environment workers) close their copy of
  the lock's descriptor right after the fork (``os.register_at_fork``), so a lingering
  child never keeps a directory locked after its trainer has gone (an ``exec``-ed child
  does not inherit it either: the descriptor is close-on-exec);
- a directory that cannot be created or written (read-only, no permission) is an
  ``InputError`` here, before any other work.

Under ``torchrun`` only rank 0 takes the lock (the ranks of one job share the directory).
Within one process the lock is shared (counted): a second ``Trainer`` in the same Python
process, e.g. after the first failed to start, may use the directory; the directory is
unlocked when the last holder releases it, or is garbage collected.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from fastrl.errors import InputError

LOCK_FILE = ".fastrl.lock"

# The locks this process holds: real path of the directory -> [descriptor, holders]. A
# forked child closes them all (it holds none).
_held: dict[str, list[int]] = {}


def _close_in_child() -> None:
    for descriptor, _ in list(_held.values()):
        try:
            os.close(descriptor)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunDirectoryLock:
    """The held lock on one output directory; :meth:`release` (or process exit) frees it."""

    def __init__(self, directory: Path, key: str) -> None:
        self.directory = directory
        self.path = directory / LOCK_FILE
        self._key: str | None = key

    @property
    def held(self) -> bool:
        return self._key is not None

    def release(self) -> None:
        """Give up this hold; the last holder in the process unlocks and closes. Idempotent."""
        if self._key is None:
            return
        key, self._key = self._key, None
        entry = _held.get(key)
        if entry is None:  # a forked child: nothing is held here
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
        try:
            fcntl.flock(entry[0], fcntl.LOCK_UN)
        finally:
            os.close(entry[0])

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> "RunDirectoryLock":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def lock_run_directory(output_dir: str | os.PathLike) -> RunDirectoryLock:
    """Create ``output_dir`` and lock it for this process, or raise ``InputError``."""
    directory = Path(output_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(directory)
        if key in _held:
            _held[key][1] += 1
            return RunDirectoryLock(directory, key)
        descriptor = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise InputError(f"output_dir {str(directory)!r} cannot be written: {error.strerror or error}") from None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        holder = _read_holder(descriptor)
        os.close(descriptor)
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise InputError(
                f"output_dir {str(directory)!r} is in use by another fastrl run{holder}: wait for it to end, or choose "
                "another output_dir"
            ) from None
        raise InputError(f"output_dir {str(directory)!r}: cannot lock {LOCK_FILE}: {error.strerror or error}") from None
    try:  # who holds it, for the message a second run gets (informational only: the lock is the flock)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    except OSError as error:
        os.close(descriptor)
        raise InputError(f"output_dir {str(directory)!r} cannot be written: {error.strerror or error}") from None
    _held[key] = [descriptor, 1]
    return RunDirectoryLock(directory, key)


def _read_holder(descriptor: int) -> str:
    try:
        pid = os.pread(descriptor, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


DEFAULT_RUNS_ROOT = Path("runs")
"""Where runs go when ``output_dir`` is not given: ``runs/<task>``, relative to the working directory."""


DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
"""File suffixes left out of a run's folder name (``train.jsonl`` -> ``runs/train``)."""


def default_run_name(*, env: str | None, dataset: str | None, model: str | None = None) -> str:
    """The folder name of a run's task: its environment (``calculator``; a user's
    ``module:Class`` as ``class``), its dataset's name (``train.jsonl`` -> ``train``), its
    model's (the built-in task on ``./my-model``: ``my-model``), else ``default`` (the
    built-in task and model)."""
    if env is not None:
        name = env.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    elif dataset is not None or model is not None:
        name = Path((dataset or model).rstrip("/\\")).name
        for suffix in DATA_SUFFIXES:
            name = name.removesuffix(suffix)
    else:
        name = "default"
    name = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in name.lower()).strip("-")
    return name or "run"


def _holds_a_run(folder: Path) -> bool:
    """Anything in ``folder`` besides the lock file (which a run leaves behind)."""
    return folder.is_dir() and any(entry.name != LOCK_FILE for entry in folder.iterdir())


def default_output_dir(name: str, *, resume: str | None, overwrite: bool, numbered: bool = True,
                       root: Path = DEFAULT_RUNS_ROOT) -> str:
    """``output_dir`` when none is given: ``root/name`` for a new run, or ``root/name-2``,
    ``-3``, ... when the earlier ones hold runs (so commands run one after another never
    collide); with ``resume="latest"``, the newest of them that holds checkpoints (where
    ``--resume latest`` finds them); with a checkpoint directory ``.../checkpoints/step-N``,
    its run's folder; with ``overwrite``, ``root/name`` itself. ``numbered`` False (torchrun:
    every rank must name the same folder, whenever it starts): ``root/name``."""
    def candidate(k: int) -> Path:
        return root / (name if k == 1 else f"{name}-{k}")

    if resume is not None and resume != "latest" and Path(resume).parent.name == "checkpoints":
        return str(Path(resume).parent.parent)
    if overwrite or not numbered:
        return str(candidate(1))
    k = 1
    while _holds_a_run(candidate(k)):
        k += 1
    if resume == "latest":
        with_checkpoints = [j for j in range(1, k) if (candidate(j) / "checkpoints").is_dir()]
        return str(candidate(with_checkpoints[-1] if with_checkpoints else 1))
    return str(candidate(k))
