"""Checkpoints that reproduce a run: model (safetensors), optimizer, scheduler, RNG states,
data position and step.

A checkpoint is written to ``<dir>.tmp`` and renamed into place, so a run killed while
saving never leaves a half-written checkpoint that ``latest`` would pick up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.json"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step-{step:06d}"


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / STATE_FILE).exists()]
    return sorted(done, key=lambda p: p.name)


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Path:
    """``latest`` -> the newest complete checkpoint in ``output_dir``; else the given directory."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise ValueError(f"resume=latest: no complete checkpoint under {Path(output_dir) / 'checkpoints'}")
        return found[-1]
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise ValueError(f"resume: {str(path)!r} is not a fastrl checkpoint (no {STATE_FILE})")
    return path


def save_checkpoint(
    directory: Path,
    *,
    models: dict[str, Any],
    tokenizer: Any,
    objects: dict[str, Any],
    state: dict[str, Any],
    keep: int,
) -> Path:
    """Write one checkpoint atomically; keep the newest ``keep`` checkpoints beside it.

    ``models``: name -> object with ``save_pretrained`` or ``save`` (critic). ``objects``:
    name -> anything with ``state_dict()`` (optimizers, schedulers), saved with torch.save.
    """
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name, model in models.items():
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp / name, safe_serialization=True)
        else:
            model.save(tmp / name)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp / "policy")
    torch.save({name: obj.state_dict() for name, obj in objects.items()}, tmp / "optim.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    for old in list_checkpoints(directory.parent.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def load_checkpoint_state(directory: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(trainer_state, optimizer/scheduler state dicts, rng state)`` of a checkpoint."""
    state = json.loads((directory / STATE_FILE).read_text())
    objects = torch.load(directory / "optim.pt", map_location="cpu", weights_only=False)
    rng = torch.load(directory / "rng.pt", map_location="cpu", weights_only=False)
    return state, objects, rng
