"""Checkpoint manifests: what a complete checkpoint holds, so damage is caught on load.

When every file of a checkpoint is in place (single-process or torchrun, ``dcp/`` shards
included), :func:`write_manifest` records each file's size and SHA-256 in
``manifest.json``, the checkpoint's last file before it is renamed into place.
:func:`verify_checkpoint` re-reads them: a missing, truncated or altered file (a garbled
header, finite garbage or NaN written into the weights) gives a one-line reason that names
the file and the step; ``None`` means the checkpoint is what was written.

Non-finite weights never make a good checkpoint: :func:`first_non_finite` finds them before
anything is written (the checkpoint is refused), and since a verified checkpoint is
byte-for-byte what was written, a verified one is finite. A checkpoint without a manifest
(interrupted before it, or written by a fastrl without manifests) does not verify.

:func:`choose_checkpoint` is ``--resume latest``: the newest checkpoint that verifies, with
the reasons the newer ones were skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
HASH = "sha256"
_CHUNK_BYTES = 1 << 22


def _file_hash(path: Path) -> str:
    digest = hashlib.new(HASH)
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(
        path for path in directory.rglob("*") if path.is_file() and path.relative_to(directory).as_posix() != MANIFEST_FILE
    )


def write_manifest(directory: Path, *, step: int) -> Path:
    """Record every file under ``directory`` (size and hash); written last, flushed to disk."""
    files = {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, HASH: _file_hash(path)}
        for path in _files(directory)
    }
    manifest = {"version": MANIFEST_VERSION, "step": int(step), "files": files}
    target = directory / MANIFEST_FILE
    partial = directory / (MANIFEST_FILE + ".partial")
    with open(partial, "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, target)
    return target


def verify_checkpoint(directory: Path) -> str | None:
    """``None`` when every file is as the manifest says, else why not (naming the file and step)."""
    directory = Path(directory)
    label = f"checkpoint {directory}"
    path = directory / MANIFEST_FILE
    if not path.is_file():
        return f"{label}: no {MANIFEST_FILE} (the checkpoint is incomplete, or was written by a fastrl without manifests)"
    try:
        manifest = json.loads(path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        step = manifest["step"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{label}: {MANIFEST_FILE} is damaged ({type(error).__name__}: {error})"
    label = f"checkpoint {directory} (step {step})"
    for name, expected in files.items():
        file = directory / name
        if not file.is_file():
            return f"{label}: {name} is missing"
        size = file.stat().st_size
        if size != expected.get("bytes"):
            return f"{label}: {name} has {size} bytes, {expected.get('bytes')} were written (truncated or altered)"
        if _file_hash(file) != expected.get(HASH):
            return f"{label}: {name} is damaged (its {HASH} differs from the one recorded when it was written)"
    return None


def choose_checkpoint(candidates: Iterable[Path]) -> tuple[Path | None, list[str]]:
    """The newest of ``candidates`` (oldest first) that verifies, and why each newer one was skipped."""
    skipped: list[str] = []
    for directory in reversed(list(candidates)):
        problem = verify_checkpoint(directory)
        if problem is None:
            return directory, skipped
        skipped.append(problem)
    return None, skipped


def first_non_finite(named_tensors: Iterable[tuple[str, Any]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or inf, else ``None``."""
    import torch

    for name, tensor in named_tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
            if not bool(torch.isfinite(tensor.detach()).all()):
                return name
    return None
