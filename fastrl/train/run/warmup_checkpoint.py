"""The checkpoint of a paused warm-up: what a Ctrl-C or SIGTERM during the supervised warm-up
leaves, so ``--resume latest`` continues the warm-up where it stopped, then RL as usual.

``checkpoints/warmup-NNNNNN`` (NNNNNN: the warm-up steps done) holds ``warmup.pt`` (the
``fastrl.train.sft.WarmupState``: weights, AdamW's state, the epoch shuffler's position and
state, the losses and probes so far, the process's RNG states), ``warmup_state.json`` (the
steps done and settings, for a reader) and the manifest of sizes and hashes
(``fastrl.train.run.manifest``), its last file. It is written to ``<dir>.tmp`` and renamed into
place like the RL checkpoints, so a run killed while writing it leaves nothing ``latest``
picks up; a damaged one does not verify and is refused. The checkpoint after the warm-up
(``step-000000``) supersedes it: the run removes its warm-up checkpoints once that is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from fastrl.errors import InputError
from fastrl.train.run import manifest
from fastrl.train.sft import WarmupState

__all__ = ["WARMUP_STATE_FILE", "is_warmup_checkpoint", "list_warmup_checkpoints", "load_warmup_checkpoint",
           "remove_warmup_checkpoints", "save_warmup_checkpoint", "warmup_checkpoint_dir"]

WARMUP_STATE_FILE = "warmup_state.json"
"""The file that makes a folder a warm-up checkpoint (the RL checkpoints have ``trainer_state.json``)."""
WARMUP_FILE = "warmup.pt"
_NAME = re.compile(r"warmup-\d+")


def warmup_checkpoint_dir(output_dir: str | os.PathLike, steps_done: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"warmup-{steps_done:06d}"


def is_warmup_checkpoint(directory: Path) -> bool:
    return (Path(directory) / WARMUP_STATE_FILE).exists()


def list_warmup_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete warm-up checkpoints under ``output_dir/checkpoints``, oldest first (a
    ``.tmp`` folder is one never completely written)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and _NAME.fullmatch(p.name) and is_warmup_checkpoint(p)]
    return sorted(done, key=lambda p: p.name)


def save_warmup_checkpoint(output_dir: str | os.PathLike, state: WarmupState) -> Path:
    """Write ``state`` atomically as ``checkpoints/warmup-<steps done>``; the older warm-up
    checkpoints of the run are removed once it is in place (it continues past them)."""
    directory = warmup_checkpoint_dir(output_dir, state.steps_done)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        torch.save(dataclasses.asdict(state), tmp / WARMUP_FILE)
        summary = {"steps_done": state.steps_done, "settings": state.settings, "probes": state.probes}
        (tmp / WARMUP_STATE_FILE).write_text(json.dumps(summary, indent=1))
        manifest.write_manifest(tmp, step=state.steps_done)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    for old in list_warmup_checkpoints(output_dir):
        if old != directory:
            shutil.rmtree(old, ignore_errors=True)
    return directory


def load_warmup_checkpoint(directory: Path) -> WarmupState:
    """The ``WarmupState`` of a warm-up checkpoint, verified against its manifest first (a
    missing, truncated or altered file is an ``InputError`` naming it)."""
    problem = manifest.verify_checkpoint(directory)
    if problem is not None:
        raise InputError(f"resume: {problem}")
    saved: dict[str, Any] = torch.load(Path(directory) / WARMUP_FILE, map_location="cpu", weights_only=False)
    return WarmupState(**saved)


def remove_warmup_checkpoints(output_dir: str | os.PathLike) -> None:
    """Remove the run's warm-up checkpoints and any partial one (the step-0 checkpoint supersedes them)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.is_dir() and _NAME.fullmatch(path.name.removesuffix(".tmp")):
            shutil.rmtree(path, ignore_errors=True)
