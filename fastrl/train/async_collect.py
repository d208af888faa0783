"""Asynchronous collection (``TrainConfig.async_steps = n >= 1``): the rollouts of the next
``n`` steps are sampled by a process of its own while the trainer updates.

``AsyncCollector`` is a ``contracts.Collector`` (``collect(sampler=, step=, timer=)``
returns one step's ``GroupRollout`` and its metrics). At step ``s`` it copies the
trainer's current weights ``w_s`` (the policy after ``s`` updates) into a free weight slot
of the sampler process (``async_steps + 1`` slots; a slot is held until every rollout
sampled from it has been received, so it is never overwritten while a rollout that reads it
is in flight), submits the rollouts of
the steps up to ``s + n`` that are not yet in flight (prompts drawn from the batcher in step
order, each sampled with ``w_s``), then waits for the rollout of step ``s`` (submitted at
step ``s - n`` with ``w_{s-n}``, or at the run's first step with its weights) and scores
it. One worker thread talks to the sampler process, in submission order, so rollout ``s +
n`` is sampled while step ``s`` trains, and a rollout is never more than ``n`` updates
old: ``async/staleness`` (updates between the rollout's weights and the trainer's) is
logged every step and checked.

Dynamic sampling (DAPO, ``dynamic_sampling``): step ``s``'s rollout is refilled as the
synchronous collector does (``GroupCollector.refill``: its all-equal groups dropped, further
rounds of the step's next prompts drawn), each round sampled by the sampler process with
the trainer's weights of now (0 updates old) and waited for; the rollouts of the next steps
are submitted after the refill (with ``async_steps`` 1 nothing is ahead of a round in the
sampler's queue), so the prompts are drawn in the synchronous loop's order and the run's
first step is the synchronous run's.

Exact resume: the rollouts in flight are part of the checkpoint (``checkpoint_extra``,
``<checkpoint>/in_flight-rank<r>.pt``: each waited for, with its prompts, sampling
settings and weights version). Regenerating them would need the older weights they were
sampled with, which the checkpoint does not hold; a resumed run continues with exactly
the rollouts the uninterrupted one trains on.

Scoring runs in the trainer's process when a rollout is taken (the reward pool is started
and used from the main thread), so the ``reward`` time is not hidden behind the update.

What a step spends on the asynchrony itself (logged per step; ``docs/train.md`` has the
breakdown of a run): ``time/weights``, copying the trainer's weights into a shared-memory
slot of the sampler process (``ProcessSampler.put_weights``: no ``state_dict`` snapshot,
no serialisation, nothing through the pipe); ``time/generate``, the wait for the rollout
that the update did not hide; ``time/receive``, decoding it (``decode_batch``: raw tensor
bytes); and from the sampler process ``async/sampler_seconds`` (sampling),
``async/sampler_cpu_seconds``, ``async/sampler_load_seconds`` (its weight copy),
``async/sampler_encode_seconds`` and ``async/sampler_waited_seconds`` (idle, waiting for the
trainer's next request). The worker thread only moves the request and the reply's bytes
(about 0.5 ms of CPU per rollout on the embedded default, measured with ``thread_time``).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fastrl.errors import InputError
from fastrl.rollout.base import GroupRollout, RolloutBatch
from fastrl.rollout.process import ProcessSampler, SamplerReply, SamplerTimes, decode_batch, encode_batch
from fastrl.train.run.checkpoint import extra_file, load_extra
from fastrl.train.collect import GroupCollector, RolloutRequest
from fastrl.train.config import TrainConfig
from fastrl.train.ranks import Ranks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.rollout.base import GroupSampler
    from fastrl.train.experience import Experience
    from fastrl.train.run.metrics import StageTimer


__all__ = ["AsyncCollector", "IN_FLIGHT", "drop_in_flight", "start_async"]

logger = logging.getLogger(__name__)

IN_FLIGHT = "in_flight"
"""The name of the in-flight rollouts in a checkpoint (``checkpoint.extra_file``)."""


@dataclass
class InFlight:
    """A rollout submitted to the sampler process and not yet trained on."""

    step: int
    """The step that trains on it."""
    version: int
    """The updates the weights it is sampled with had seen (the trainer's step at submission)."""
    request: RolloutRequest
    future: concurrent.futures.Future
    """Its ``SamplerReply``."""
    slot: int | None
    """The sampler's weight slot it holds until received (None: restored from a checkpoint)."""

    def saved(self) -> dict[str, Any]:
        batch = decode_batch(self.future.result().data)
        return {"step": self.step, "version": self.version, "request": self.request, "batch": batch}

    @classmethod
    def restored(cls, saved: dict[str, Any]) -> "InFlight":
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(SamplerReply(encode_batch(saved["batch"]), SamplerTimes()))
        return cls(step=int(saved["step"]), version=int(saved["version"]), request=saved["request"], future=future,
                   slot=None)


class AsyncCollector:
    """A ``contracts.Collector`` over a ``ProcessSampler`` (see the module docstring).

    ``inner``: the synchronous collector whose ``draw`` and ``score`` it uses; ``weights``:
    the module whose state is the trainer's current policy (its full copy under torchrun);
    ``in_flight``: the saved rollouts of a checkpoint being resumed (``load_extra``)."""

    def __init__(self, *, inner: GroupCollector, sampler: ProcessSampler, weights: torch.nn.Module, async_steps: int,
                 steps: int, in_flight: list[dict[str, Any]] | None = None):
        self.inner, self.sampler, self.weights = inner, sampler, weights
        self.async_steps, self.steps = async_steps, steps
        self.group_size = inner.cfg.group_size
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastrl-async-sampler")
        self.pending: deque[InFlight] = deque(InFlight.restored(s) for s in (in_flight or []))
        self.next_step: int | None = self.pending[-1].step + 1 if self.pending else None

    # ------------------------------------------------------------------ the interface
    def collect(self, *, sampler: GroupSampler, step: int, timer: StageTimer) -> tuple[GroupRollout, dict[str, float]]:
        """Step ``step``'s rollout (``sampler``, the trainer's in-process one, is not used)."""
        refills = self.inner.cfg.dynamic_sampling
        if not refills:
            self._submit_up_to(step, timer=timer)  # the next rollouts are sampled while this one is waited for and trained on
        elif not self.pending:
            self._submit_up_to(step, timer=timer, ahead=0)  # the run's first step: its own rollout (the next ones after its refill)
        item = self.pending.popleft()
        if item.step != step:
            raise RuntimeError(f"async collection out of step: the rollout in flight is step {item.step}'s, the trainer is at {step}")
        staleness = step - item.version
        if not 0 <= staleness <= self.async_steps:
            raise RuntimeError(f"step {step}: a rollout {staleness} updates old, async_steps={self.async_steps}")
        batch, times = self._receive(item, timer=timer)
        with timer("reward"):
            rollout = self.inner.score(item.request, batch)
        info = {"dynamic/rounds": 0.0, "dynamic/dropped_groups": 0.0, "async/staleness": float(staleness),
                **sampler_metrics(times)}
        if refills:
            rollout, dynamic = self.inner.refill(rollout, more=lambda salt: self._refill_round(step=step, salt=salt, timer=timer),
                                                 pad_token_id=self.sampler.pad_token_id)
            info.update(dynamic)
            self._submit_up_to(step, timer=timer)
        return rollout, info

    def experience(self, rollout: GroupRollout, *, device: torch.device) -> Any:
        return self.inner.experience(rollout, device=device)

    def step_metrics(self, rollout: GroupRollout, exp: Experience) -> tuple[dict[str, float], dict[str, list[float]]]:
        return self.inner.step_metrics(rollout, exp)

    def samples(self, rollout: GroupRollout, tokenizer: PreTrainedTokenizerBase) -> Any:
        return self.inner.samples(rollout, tokenizer)

    def checkpoint_extra(self) -> dict[str, Any]:
        """The rollouts in flight (each waited for), for ``<checkpoint>/in_flight-rank<r>.pt``."""
        return {IN_FLIGHT: [item.saved() for item in self.pending]}

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.sampler.close()

    # ------------------------------------------------------------------ internals
    def _submit_up_to(self, step: int, *, timer: StageTimer, ahead: int | None = None) -> None:
        """Submit the rollouts of steps ``next_step .. min(step + ahead, steps - 1)`` (``ahead``:
        ``async_steps`` unless given), sampled with the weights of now."""
        if self.next_step is None:
            self.next_step = step
        last = min(step + (self.async_steps if ahead is None else ahead), self.steps - 1)
        if self.next_step > last:
            return
        with timer("weights"):  # w_step, before this step's update changes them
            slot = self.sampler.put_weights(self.weights, holders=last - self.next_step + 1)
        while self.next_step <= last:
            request = self.inner.draw(step=self.next_step, salt=0)
            future = self.executor.submit(self._sample, request, slot)
            self.pending.append(InFlight(step=self.next_step, version=step, request=request, future=future, slot=slot))
            self.next_step += 1

    def _refill_round(self, *, step: int, salt: int, timer: StageTimer) -> GroupRollout:
        """A dynamic-sampling round of step ``step``: its next prompts, sampled by the sampler
        process with the trainer's weights of now (0 updates old) and scored."""
        request = self.inner.draw(step=step, salt=salt)
        with timer("weights"):
            slot = self.sampler.put_weights(self.weights)
        item = InFlight(step=step, version=step, request=request, future=self.executor.submit(self._sample, request, slot),
                        slot=slot)
        batch, _ = self._receive(item, timer=timer)
        with timer("reward"):
            return self.inner.score(request, batch)

    def _receive(self, item: InFlight, *, timer: StageTimer) -> tuple[RolloutBatch, SamplerTimes]:
        """``item``'s rollout, waited for and decoded; its weight slot released."""
        with timer("generate"):  # only the wait that the update did not hide
            reply = item.future.result()
        if item.slot is not None:
            self.sampler.release(item.slot)
        with timer("receive"):
            batch = decode_batch(reply.data)
        return batch, reply.times

    def _sample(self, request: RolloutRequest, slot: int) -> SamplerReply:
        return self.sampler.sample(request.prompt_batch.prompt_ids, group_size=self.group_size, sampling=request.sampling,
                                   prompt_seeds=request.prompt_seeds, slot=slot)


def sampler_metrics(times: SamplerTimes) -> dict[str, float]:
    """The sampler process's timings of a rollout as ``async/sampler_...`` metrics (seconds)."""
    return {"async/sampler_seconds": times.generate, "async/sampler_cpu_seconds": times.generate_cpu,
            "async/sampler_load_seconds": times.load, "async/sampler_encode_seconds": times.encode,
            "async/sampler_waited_seconds": times.waited}


def start_async(inner: GroupCollector, *, cfg: TrainConfig, ranks: Ranks, weights: torch.nn.Module, pad_token_id: int,
                device: torch.device, resume_dir: Path | None) -> AsyncCollector:
    """``inner`` behind an ``AsyncCollector`` (``async_steps``): its sampler process forked now,
    from ``weights``; a resumed run's rollouts in flight restored from ``resume_dir``."""
    if device.type != "cpu":
        raise InputError(f"async_steps={cfg.async_steps}: the sampler process runs on the CPU (forked from the trainer); "
                         f"this run's device is {device} (use --device cpu)")
    in_flight = None
    if resume_dir is not None:
        files = sorted(resume_dir.glob(extra_file(IN_FLIGHT, "*")))  # one per rank that wrote the checkpoint
        written = len(files)
        if written != ranks.world_size and any(torch.load(f, weights_only=False) for f in files):
            raise InputError(f"resume: {resume_dir} holds the in-flight rollouts of {written} processes (async_steps); "
                             f"resume it with {written} processes, this run has {ranks.world_size}")
        in_flight = load_extra(resume_dir, IN_FLIGHT, rank=ranks.rank)
    # a slot per weight version a rollout in flight can hold, and one for the version being put
    sampler = ProcessSampler(weights, pad_token_id=pad_token_id, timeout_s=cfg.sampler_timeout, decode=cfg.sampler_decode,
                             weight_slots=cfg.async_steps + 1)
    return AsyncCollector(inner=inner, sampler=sampler, weights=weights, async_steps=cfg.async_steps, steps=cfg.steps,
                          in_flight=in_flight)


def drop_in_flight(resume_dir: Path | None, *, ranks: Ranks) -> None:
    """A run without ``async_steps`` resumed from a checkpoint that holds rollouts in flight
    says that it drops them (their prompts are skipped)."""
    if resume_dir is not None and load_extra(resume_dir, IN_FLIGHT, rank=ranks.rank):
        logger.warning("resume without async_steps: the %s checkpoint's rollouts in flight are dropped (their prompts "
                       "are skipped)", resume_dir)
