"""What a run says when it stops on a fault: divergence, and a disk that fills while saving.

Step numbers are the metrics' (``metrics.jsonl``): step ``n`` is the ``n``-th RL step, the
one whose record carries ``"step": n``; the step that diverges is the one being taken.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from fastrl.errors import InputError

# errno values meaning "the file system cannot take more bytes": full, over quota, or over
# the process's file-size limit (RLIMIT_FSIZE).
DISK_FULL_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT", errno.EFBIG: "EFBIG"}
_DISK_FULL_WORDS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EFBIG: "a file exceeds the size limit",
}
# What libraries say when they swallow the errno (torch's zip writer, safetensors' Rust IO).
_DISK_FULL_TEXTS = ("no space left on device", "storagefull", "disk quota exceeded", "file too large", "unexpected pos")
LOW_FREE_BYTES = 1 << 20
"""A write failure with less than this free on the file system is taken as the disk being full."""


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient norm: the optimizer step was not taken (exit status 3)."""


class NonFiniteWeightsError(TrainingDivergedError):
    """The weights about to be checkpointed are not finite: no checkpoint was written."""


class CheckpointDiskFullError(InputError):
    """A checkpoint could not be written because the file system is full (or a size limit).

    An :class:`InputError` (one line, exit status 2): the fix is the user's (free space or
    choose another ``output_dir``); the previous complete checkpoint is kept."""

    def __init__(self, message: str, *, errno_value: int) -> None:
        super().__init__(message)
        self.errno = errno_value


def divergence_message(
    *, step: int, what: str, loss: float, grad_norm: float, batch_path: Path, last_checkpoint: Path | None, save_every: int
) -> str:
    """The message of a run stopped by a non-finite loss or gradient at metrics step ``step``."""
    if last_checkpoint is not None:
        resume = f"last good checkpoint: {last_checkpoint} (resume with --resume latest)"
    elif save_every:
        resume = f"last good checkpoint: none yet (save_every={save_every}: the first is written at step {save_every})"
    else:
        resume = ("last good checkpoint: none (save_every=0: checkpoints after a warm-up, every save_every_minutes "
                  "of training and at the end of the run)")
    return (
        f"step {step}: non-finite {what} (loss {loss}, grad norm {grad_norm}); the optimizer step was not taken. "
        f"Batch saved to {batch_path}; {resume}"
    )


def disk_full_errno(error: BaseException, directory: Path) -> int | None:
    """The errno that makes ``error`` (raised while writing into ``directory``) a full disk, or ``None``.

    Looks for an ``OSError`` with ENOSPC/EDQUOT/EFBIG in the exception's chain, then for the
    words libraries use when they drop the errno, then at the free space left."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current.errno
        current = current.__cause__ or current.__context__
    text = str(error).lower()
    if any(words in text for words in _DISK_FULL_TEXTS):
        return errno.EFBIG if "too large" in text else errno.ENOSPC
    try:
        free = shutil.disk_usage(_existing_parent(directory)).free
    except OSError:
        return None
    return errno.ENOSPC if free < LOW_FREE_BYTES else None


def disk_full_error(directory: Path, code: int, error: BaseException, *, last_checkpoint: Path | None) -> CheckpointDiskFullError:
    kept = f"the last complete checkpoint {last_checkpoint} is kept" if last_checkpoint else "no earlier checkpoint exists"
    return CheckpointDiskFullError(
        f"cannot write checkpoint {directory}: {_DISK_FULL_WORDS[code]} ({DISK_FULL_ERRNOS[code]}: "
        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); the partial checkpoint was removed, "
        f"{kept}. Free space (or choose another output_dir) and continue with --resume latest",
        errno_value=code,
    )


def _existing_parent(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path if path.exists() else Path(os.sep)
