"""Checkpoints that reproduce a run: model (safetensors), optimizer, scheduler, RNG states,
data position and step.

A checkpoint is written to ``<dir>.tmp`` and renamed into place, so a run killed while
saving never leaves a half-written checkpoint that ``latest`` would pick up. Its last file is
a manifest of sizes and hashes (:mod:`fastrl.train.run.manifest`), verified before a resume; a
checkpoint whose weights are not finite is never written, and a disk that fills while
saving is reported as such (:mod:`fastrl.train.run.faults`), the partial checkpoint removed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastrl.errors import InputError
from fastrl.train.run import manifest
from fastrl.train.run.faults import NonFiniteWeightsError, disk_full_errno, disk_full_error

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase


STATE_FILE = "trainer_state.json"
logger = logging.getLogger(__name__)


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
    # ``step-NNNNNN`` only: a ``.tmp`` directory is a checkpoint still (or never completely) being written
    done = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step-\d+", p.name) and (p / STATE_FILE).exists()]
    return sorted(done, key=lambda p: p.name)


def resolve_resume(resume: str, output_dir: str | os.PathLike) -> Path:
    """``latest`` -> the newest checkpoint in ``output_dir`` that verifies against its manifest
    (each newer one skipped is logged with the reason), a paused warm-up's
    (``fastrl.train.run.warmup_checkpoint``) when RL has none; else the given directory, verified."""
    from fastrl.train.run.warmup_checkpoint import WARMUP_STATE_FILE, list_warmup_checkpoints

    if resume == "latest":
        # a paused warm-up's checkpoints come before any of RL's (the step-0 one supersedes them)
        found = list_warmup_checkpoints(output_dir) + list_checkpoints(output_dir)
        if not found:
            raise InputError(f"resume=latest: no complete checkpoint under {Path(output_dir) / 'checkpoints'}")
        chosen, skipped = manifest.choose_checkpoint(found)
        if chosen is None:  # one line: the reasons are the error's
            raise InputError("resume=latest: no checkpoint verifies: " + "; ".join(skipped))
        for reason in skipped:
            logger.warning("resume=latest: skipped %s", reason)
        if skipped:
            logger.warning("resume=latest: resuming from %s", chosen)
        return chosen
    path = Path(resume)
    if not (path / STATE_FILE).exists() and not (path / WARMUP_STATE_FILE).exists():
        raise InputError(f"resume: {str(path)!r} is not a fastrl checkpoint (no {STATE_FILE} or {WARMUP_STATE_FILE})")
    problem = manifest.verify_checkpoint(path)
    if problem is not None:
        raise InputError(f"resume: {problem}")
    return path


def _refuse_non_finite(models: dict[str, Any], step: int) -> None:
    for name, model in models.items():
        bad = manifest.first_non_finite(model.state_dict().items())
        if bad is not None:
            raise NonFiniteWeightsError(
                f"step {step}: the {name} weights are not finite ({bad} holds NaN or inf); no checkpoint was written, "
                "the checkpoints already on disk are kept"
            )


def _written_or_reported(tmp: Path, directory: Path, error: BaseException) -> BaseException:
    """After a failed write: the partial checkpoint removed, and the error to raise (a full disk named as such)."""
    shutil.rmtree(tmp, ignore_errors=True)
    code = disk_full_errno(error, tmp)
    if code is None:
        return error
    earlier = [path for path in list_checkpoints(directory.parent.parent) if path != directory]
    return disk_full_error(directory, code, error, last_checkpoint=earlier[-1] if earlier else None)


def save_checkpoint(
    directory: Path,
    *,
    models: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    objects: dict[str, Any],
    state: dict[str, Any],
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write one checkpoint atomically; keep the newest ``keep`` checkpoints beside it.

    ``models``: name -> object with ``save_pretrained`` or ``save`` (critic). ``objects``:
    name -> anything with ``state_dict()`` (optimizers, schedulers), saved with torch.save.
    ``extra``: name -> this rank's object, saved as ``<name>-rank0.pt`` (``load_extra``).
    """
    _refuse_non_finite(models, int(state["step"]))
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
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
        for name, obj in (extra or {}).items():
            torch.save(obj, tmp / extra_file(name, 0))
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        manifest.write_manifest(tmp, step=int(state["step"]))
    except Exception as error:
        reported = _written_or_reported(tmp, directory, error)
        if reported is error:
            raise
        raise reported from error
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


# ---------------------------------------------------------------------------- torchrun (sharded)
DCP_DIR = "dcp"
"""Model and optimizer shards (``torch.distributed.checkpoint``) of a torchrun checkpoint."""


def is_distributed_checkpoint(directory: Path) -> bool:
    return (Path(directory) / DCP_DIR).is_dir()


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def extra_file(name: str, rank: int | str) -> str:
    """The file of a rank's ``extra`` object in a checkpoint (e.g. the in-flight rollouts)."""
    return f"{name}-rank{rank}.pt"


def load_extra(directory: Path, name: str, *, rank: int) -> Any:
    """A rank's ``extra`` object of a checkpoint, or None when the checkpoint has none."""
    path = directory / extra_file(name, rank)
    return torch.load(path, map_location="cpu", weights_only=False) if path.exists() else None


def save_distributed_checkpoint(
    directory: Path,
    *,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    schedulers: dict[str, Any],
    state: dict[str, Any],
    hf_policy: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    barrier,
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write one checkpoint from every rank of a torchrun job (a collective), atomically.
    ``extra``: name -> this rank's object, saved as ``<name>-rank{r}.pt`` (``load_extra``).

    ``dcp/``: every model's and optimizer's state, each rank writing its own shards
    (``torch.distributed.checkpoint``; keys are parameter names, so it loads into any
    world size). ``rng-rank{r}.pt``: each rank's RNG states. Rank 0 also writes
    ``policy/`` (``hf_policy``, a full copy of the policy, as a Hugging Face directory with
    the tokenizer: usable with ``from_pretrained`` and the model a resume starts from),
    ``schedulers.pt`` and the trainer state, last.

    As ``save_checkpoint``: weights with NaN or inf on any rank are refused on every rank
    before anything is written, and a write that fails on any rank (a full disk named as
    such) removes the partial checkpoint and raises on every rank, the earlier ones kept.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    step = int(state["step"])
    _refuse_non_finite_on_every_rank(models, step)
    tmp = directory.with_name(directory.name + ".tmp")

    def write(fn) -> None:
        """Run this rank's part of the write; every rank learns whether any failed (then: the
        partial checkpoint removed, a full disk named as such, raised on every rank)."""
        error: BaseException | None = None
        try:
            fn()
        except (Exception, CheckpointException) as caught:  # DCP's is a BaseException holding each rank's error
            error = caught
        if not _any_rank(error is not None):
            return
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        if error is None:
            raise RuntimeError(f"checkpoint {directory} not written: another rank failed writing it")
        cause = _dcp_failure(error, rank)
        reported = _written_or_reported(tmp, directory, cause)
        if reported is cause:
            raise error
        raise reported from error

    def start() -> None:
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)

    def shards_and_rank0_files() -> None:
        shards: dict[str, Any] = {name: get_model_state_dict(model) for name, model in models.items()}
        shards.update({name: get_optimizer_state_dict(model, opt) for name, (model, opt) in optimizers.items()})
        dcp.save(shards, checkpoint_id=str(tmp / DCP_DIR))
        torch.save(rng_state(), tmp / _rng_file(rank))
        for name, obj in (extra or {}).items():
            torch.save(obj, tmp / extra_file(name, rank))
        if rank == 0:
            hf_policy.save_pretrained(tmp / "policy", safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "policy")
            torch.save({name: s.state_dict() for name, s in schedulers.items()}, tmp / "schedulers.pt")

    def finish() -> None:
        if rank == 0:
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
            manifest.write_manifest(tmp, step=step)  # every rank's shards included

    write(start)
    barrier()
    write(shards_and_rank0_files)
    barrier()  # every rank's files are in place before the state file makes the checkpoint complete
    write(finish)
    if rank == 0:
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
        for old in list_checkpoints(directory.parent.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return directory


def _dcp_failure(error: BaseException, rank: int) -> BaseException:
    """The exception behind DCP's ``CheckpointException`` (this rank's, else the first rank's); ``error`` otherwise."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return error
    wrapped = failures.get(rank, next(iter(failures.values())))
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the default process group (this rank's alone without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _refuse_non_finite_on_every_rank(models: dict[str, torch.nn.Module], step: int) -> None:
    """``_refuse_non_finite`` as a collective: every rank checks its own (possibly sharded)
    weights and all ranks refuse if any rank found NaN or inf, before anything is written."""
    try:
        _refuse_non_finite(models, step)
        local: NonFiniteWeightsError | None = None
    except NonFiniteWeightsError as error:
        local = error
    if _any_rank(local is not None):
        raise local or NonFiniteWeightsError(
            f"step {step}: the weights on another rank are not finite; no checkpoint was written, "
            "the checkpoints already on disk are kept"
        )


def load_distributed_checkpoint(
    directory: Path,
    *,
    models: dict[str, torch.nn.Module],
    optimizers: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    schedulers: dict[str, Any],
    rank: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a torchrun checkpoint into these (sharded or plain) models and optimizers, in
    any world size; returns ``(trainer_state, rng state)``. The RNG is this rank's, or rank
    0's when the checkpoint had fewer ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = json.loads((directory / STATE_FILE).read_text())
    shards: dict[str, Any] = {name: get_model_state_dict(model) for name, model in models.items()}
    shards.update({name: get_optimizer_state_dict(model, opt) for name, (model, opt) in optimizers.items()})
    dcp.load(shards, checkpoint_id=str(directory / DCP_DIR))
    for name, model in models.items():
        set_model_state_dict(model, shards[name])
    for name, (model, opt) in optimizers.items():
        set_optimizer_state_dict(model, opt, shards[name])
    saved = torch.load(directory / "schedulers.pt", map_location="cpu", weights_only=False)
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(saved[name])
    rng_path = directory / _rng_file(rank)
    if not rng_path.exists():
        rng_path = directory / _rng_file(0)
    rng = torch.load(rng_path, map_location="cpu", weights_only=False)
    return state, rng


# ---------------------------------------------------------------------------- a run's checkpoint
class RunCheckpoint:
    """What a training run checkpoints, named once: the policy with its optimizer and
    scheduler, and the critic with its own when there is one. ``save``/``load`` pick the
    single-process or the sharded (torchrun) format."""

    def __init__(self, *, policy: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler,
                 critic: torch.nn.Module | None = None, critic_optimizer: torch.optim.Optimizer | None = None,
                 critic_scheduler: LRScheduler | None = None):
        self.policy, self.optimizer, self.scheduler = policy, optimizer, scheduler
        self.critic, self.critic_optimizer, self.critic_scheduler = critic, critic_optimizer, critic_scheduler

    def models(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        if self.critic is not None:
            out["critic"] = self.critic
        return out

    def optimizers(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        out = {"optimizer": (self.policy, self.optimizer)}
        if self.critic is not None:
            out["critic_optimizer"] = (self.critic, self.critic_optimizer)
        return out

    def schedulers(self) -> dict[str, Any]:
        out = {"scheduler": self.scheduler}
        if self.critic is not None:
            out["critic_scheduler"] = self.critic_scheduler
        return out

    def objects(self) -> dict[str, Any]:
        """Optimizers and schedulers by name (the single-process ``optim.pt``)."""
        out: dict[str, Any] = {"optimizer": self.optimizer, "scheduler": self.scheduler}
        if self.critic is not None:
            out.update(critic_optimizer=self.critic_optimizer, critic_scheduler=self.critic_scheduler)
        return out

    def save(self, directory: Path, *, tokenizer: PreTrainedTokenizerBase, state: dict[str, Any], keep: int,
             sharded: bool = False,
             full_policy: torch.nn.Module | None = None, rank: int = 0, world_size: int = 1, barrier=None,
             extra: dict[str, Any] | None = None) -> Path:
        """One checkpoint; ``sharded`` (torchrun, a collective): ``torch.distributed.checkpoint``
        shards plus rank 0's Hugging Face copy of ``full_policy``. ``extra``: this rank's
        objects by name (``load_extra``)."""
        if not sharded:
            return save_checkpoint(directory, models=self.models(), tokenizer=tokenizer, objects=self.objects(), state=state, keep=keep,
                                   extra=extra)
        return save_distributed_checkpoint(
            directory, models=self.models(), optimizers=self.optimizers(), schedulers=self.schedulers(),
            state={**state, "world_size": world_size}, hf_policy=full_policy, tokenizer=tokenizer, rank=rank, barrier=barrier,
            keep=keep, extra=extra,
        )

    def load(self, directory: Path, *, algorithm: str, sharded: bool = False, rank: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore the optimizers and schedulers (and under torchrun, the model shards) from
        ``directory``; returns ``(trainer state, rng state)``. A sharded checkpoint loads in
        any world size; a single-process one only without torchrun."""
        if is_distributed_checkpoint(directory):
            return load_distributed_checkpoint(directory, models=self.models(), optimizers=self.optimizers(),
                                               schedulers=self.schedulers(), rank=rank)
        if sharded:
            raise InputError(
                f"resume: {directory} is a single-process checkpoint; resume it without torchrun (a torchrun run "
                "writes sharded checkpoints that resume in any number of processes)"
            )
        state, objects, rng = load_checkpoint_state(directory)
        check_algorithm(state, algorithm)
        for name, obj in self.objects().items():
            obj.load_state_dict(objects[name])
        return state, rng


def check_algorithm(state: dict[str, Any], algorithm: str) -> None:
    """A checkpoint resumes only the algorithm that wrote it."""
    if state.get("algorithm") != algorithm:
        raise InputError(f"resume: the checkpoint was written by algorithm {state.get('algorithm')!r}, this run is {algorithm!r}")


def claim_output_dir(out: Path, *, names: tuple[str, ...], overwrite: bool) -> None:
    """A new run never mixes its logs or checkpoints with an earlier run's: refuse an
    ``output_dir`` that holds any of ``names`` (or with ``overwrite``, remove them)."""
    previous = [out / n for n in names if (out / n).exists()]
    if not previous:
        return
    if not overwrite:
        raise InputError(
            f"output_dir {str(out)!r} already holds a run ({', '.join(p.name for p in previous)}): rerun with "
            "--resume latest to continue it, --overwrite true to replace it, or another --output_dir "
            "(from Python: resume='latest', overwrite=True, output_dir=...)"
        )
    for p in previous:
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def save_final(directory: Path, *, policy: torch.nn.Module, critic: torch.nn.Module | None, critic_dir: Path,
               tokenizer: PreTrainedTokenizerBase, sharded: bool = False,
               full_policy: torch.nn.Module | None = None, is_main: bool = True) -> None:
    """The trained policy as a Hugging Face directory (with the tokenizer) and the critic beside
    it. ``sharded`` (torchrun, a collective): the policy from the trainer's full copy, the
    critic gathered from its shards; rank 0 writes."""
    if not sharded:
        policy.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        if critic is not None:
            critic.save(critic_dir)
        return
    import copy

    from fastrl.train import distributed as dist_mod
    critic_state = dict(dist_mod.full_named_tensors(critic)) if critic is not None else None
    if is_main:
        full_policy.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        if critic_state is not None:
            gathered = ValueModel(copy.deepcopy(full_policy))
            gathered.load_state_dict(critic_state, strict=False)
            gathered.save(critic_dir)
