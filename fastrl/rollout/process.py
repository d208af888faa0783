"""The HF group sampler in a process of its own, on its own copy of the policy.

``ProcessSampler(model, pad_token_id=, timeout_s=, decode=)`` forks one worker
(``fastrl.workers.WorkerPool``: killable, dies with its parent, torch at one thread) that
holds the model as it was at the fork and runs ``HFGroupSampler(decode=)`` on it. Each
``generate`` call carries the weights to sample with (``weights_bytes(module)``, taken
when the call is made), so the worker's copy is exactly the trainer's policy of that moment
even while the trainer goes on updating its own; results come back serialised with
``torch.save``. It is the sampler of asynchronous training (``fastrl.train.async_collect``):
generation runs on another core while the trainer updates.

A sample is the same as the in-process ``HFGroupSampler``'s on the same weights (same
code, same per-sample seeds: ``prompt_seeds[i] * G + j``). Fork only: the worker inherits
the model, so it runs on the CPU.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from fastrl._checks import check_choice
from fastrl.rollout.base import RolloutBatch, SamplingConfig
from fastrl.rollout.hf import DECODE_MODES, HFGroupSampler
from fastrl.workers import OK, WorkerPool

__all__ = ["ProcessSampler", "SamplerProcessError", "weights_bytes"]


class SamplerProcessError(RuntimeError):
    """The sampler process failed, timed out or died: the run stops (exit code 4)."""


def weights_bytes(module: torch.nn.Module) -> bytes:
    """``module``'s state dict, serialised (a snapshot: later updates do not change it)."""
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, buffer)
    return buffer.getvalue()


@dataclass
class _Task:
    prompts: list[list[int]]
    group_size: int
    sampling: SamplingConfig
    prompt_seeds: list[int] | None
    weights: bytes


class _Worker:
    """The worker's state: the inherited model and (once built) its sampler."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, decode: str):
        self.model, self.pad_token_id, self.decode = model, pad_token_id, decode
        self.sampler: Any = None

    def __call__(self, task: _Task) -> bytes:
        if self.sampler is None:
            self.sampler = HFGroupSampler(self.model, pad_token_id=self.pad_token_id, decode=self.decode)
        state = torch.load(io.BytesIO(task.weights), map_location="cpu", weights_only=True)
        self.sampler.update_weights(state.items())
        extra = {"prompt_seeds": task.prompt_seeds} if task.prompt_seeds is not None else {}
        batch = self.sampler.generate(task.prompts, group_size=task.group_size, sampling=task.sampling, **extra)
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue()


def _serve(worker: _Worker, task: _Task) -> bytes:
    return worker(task)


class ProcessSampler:
    """``generate(prompts, group_size=, sampling=, prompt_seeds=, weights=)`` in the worker.

    ``model``: the policy (a CPU module; the worker holds its copy from the fork).
    ``timeout_s``: longest one rollout may take (then the worker is killed and
    ``SamplerProcessError`` raised). ``decode``: the worker's ``HFGroupSampler(decode=)``
    (``DECODE_MODES``; the worker runs on the CPU, so ``eager`` or ``static``)."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, timeout_s: float, decode: str = "eager",
                 name: str = "fastrl-sampler"):
        check_choice("decode", decode, DECODE_MODES)
        self.pad_token_id, self.decode = int(pad_token_id), decode
        self.pool = WorkerPool(_serve, _Worker(model, self.pad_token_id, decode), num_workers=1, timeout_s=timeout_s,
                               start_method="fork", name=name)

    @property
    def pid(self) -> int | None:
        """The worker's process id (to pin it to a core), None when it is not running."""
        pids = self.pool.worker_pids
        return pids[0] if pids else None

    def generate(self, prompts: list[list[int]], *, group_size: int, sampling: SamplingConfig,
                 prompt_seeds: list[int] | None = None, weights: bytes) -> RolloutBatch:
        (result,) = self.pool.run([_Task(prompts, group_size, sampling, prompt_seeds, weights)])
        if result.status != OK:
            raise SamplerProcessError(f"the sampler process {result.status}: {result.message}")
        return torch.load(io.BytesIO(result.value), map_location="cpu", weights_only=False)

    def close(self) -> None:
        self.pool.close()
