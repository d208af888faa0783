"""The ranks of a run: every cross-process step of the training loop in one object.

``Ranks(None, device)`` is a single process and every method is the identity there (a sum of
one, a gather of one, no padding pass), so the loop reads the same with and without
``torchrun``: the trainer never asks whether it is distributed. Under ``torchrun`` the
methods are the collectives of ``fastrl.train.distributed.DistContext``, and batch-level
statistics are computed on the gathered batch or from summed moments with the formulas of
``fastrl.ops`` (``masked_mean_std``, ``pooled_mean_std``, ``explained_variance``,
``masked_whiten``, ``group_advantages``) -- this file only moves tensors between ranks.

Every rank must call the same methods in the same order (they are collectives).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

from fastrl.ops import group_advantages, masked_whiten
from fastrl.ops.aggregation import GlobalCounts
from fastrl.ops.stats import explained_variance, masked_mean_std, pooled_mean_std
from fastrl.train import distributed as dist_mod

__all__ = ["Ranks"]

T = TypeVar("T")

Number = TypeVar("Number", int, float, torch.Tensor)


def _neutral(name: str) -> float:
    """What a rank that saw no value of metric ``name`` contributes."""
    return float("inf") if name.endswith("_min") else float("-inf") if name.endswith("_max") else 0.0


class Ranks:
    """The processes of one run; ``ctx`` None is a single process."""

    def __init__(self, ctx: "dist_mod.DistContext | None", device: torch.device):
        self.ctx = ctx
        self.device = device

    @classmethod
    def join(cls, device_name: str, *, local_device: Callable[[str], torch.device]) -> "Ranks":
        """Join the torchrun job when there is one (``distributed.init``: each rank its own
        device); else one process on ``local_device(device_name)``."""
        ctx = dist_mod.init(device_name)
        if ctx is not None:
            return cls(ctx, ctx.device)
        return cls(None, local_device(device_name))

    # ------------------------------------------------------------------ who is who
    @property
    def world_size(self) -> int:
        return 1 if self.ctx is None else self.ctx.world_size

    @property
    def rank(self) -> int:
        return 0 if self.ctx is None else self.ctx.rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Models are FSDP-sharded and each rank holds a slice of the batch (torchrun)."""
        return self.ctx is not None

    def barrier(self) -> None:
        if self.ctx is not None:
            self.ctx.barrier()

    def close(self) -> None:
        """Leave the process group if this run created it."""
        if self.ctx is not None and self.ctx.owns_process_group:
            import torch.distributed

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    # ------------------------------------------------------------------ reductions
    def sum(self, value: Number) -> Number:
        """``value`` (a number or tensor) summed over ranks."""
        return self._reduce(value, "sum")

    def max(self, value: Number) -> Number:
        return self._reduce(value, "max")

    def min(self, value: Number) -> Number:
        return self._reduce(value, "min")

    def _reduce(self, value, op: str):
        if self.ctx is None:
            return value
        t = torch.as_tensor(value).to(self.device).clone()
        dtype = t.dtype
        if not t.is_floating_point():
            t = t.to(torch.float64)
        self.ctx.all_reduce(t, op)
        t = t.to(dtype)
        if isinstance(value, torch.Tensor):
            return t
        return type(value)(t.item())

    def global_counts(self, local: GlobalCounts) -> GlobalCounts:
        """Every rank's counts summed: the denominators of the whole (all-rank) batch."""
        return GlobalCounts(tokens=self.sum(local.tokens), sequences=self.sum(local.sequences))

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (= batch order)."""
        if self.ctx is None:
            return tensor
        return self.ctx.all_gather_cat(tensor.to(self.device)).to(tensor.device)

    def offset(self, count: int) -> int:
        """Sum of ``count`` over the ranks before this one (0 in one process)."""
        return 0 if self.ctx is None else self.ctx.offset(count)

    def union(self, names: Iterable[str]) -> list[str]:
        """The sorted union of ``names`` over ranks (every rank then reduces the same list)."""
        if self.ctx is None:
            return sorted(names)
        import torch.distributed

        every: list[Any] = [None] * self.ctx.world_size
        torch.distributed.all_gather_object(every, sorted(names))
        return sorted(set().union(*every))

    # ------------------------------------------------------------------ the batch
    def shard(self, batch: T) -> tuple[T, int]:
        """This rank's contiguous share of a prompt batch (``rows``, ``prompt_ids``,
        ``indices``; whole prompts) and the index of its first prompt in the whole batch."""
        if self.ctx is None:
            return batch, 0
        part = dist_mod.shard_slice(len(batch.rows), self.rank, self.world_size)
        local = dataclasses.replace(batch, rows=batch.rows[part], prompt_ids=batch.prompt_ids[part], indices=batch.indices[part])
        return local, part.start

    def share(self, count: int) -> slice:
        """This rank's contiguous share of ``count`` items that need not divide evenly (evaluation)."""
        return slice(count * self.rank // self.world_size, count * (self.rank + 1) // self.world_size)

    def split(self, order: torch.Tensor, parts: int) -> Sequence[torch.Tensor]:
        """Mini-batches of ``order``: under torchrun exactly ``parts`` (some may be empty, so
        every rank takes as many optimizer steps); in one process ``chunk``'s split."""
        return order.chunk(parts) if self.ctx is None else order.tensor_split(parts)

    def pad_passes(self, count: int) -> int:
        """Forward passes this rank must add to match the rank with the most (FSDP collectives
        are per forward/backward; every rank must run as many). 0 in one process."""
        if self.ctx is None:
            return 0
        return int(self.max(count)) - count

    def padded_passes(self, micro: list[T], *, spare: Callable[[], T]) -> list[tuple[T, bool]]:
        """``(micro-batch, live)`` for each of ``micro``, then as many ``(copy, False)``
        zero-weight passes as this rank needs to match the others (``pad_passes``): a copy of
        the last micro-batch, or ``spare()`` when this rank has none."""
        padding = self.pad_passes(len(micro))
        passes = [(mb, True) for mb in micro]
        if padding:
            passes += [(micro[-1] if micro else spare(), False)] * padding
        return passes

    def padding_metrics(self, passes: int) -> dict[str, float]:
        """Under torchrun, ``dist/padding_micro_batches``: the zero-weight passes of every rank."""
        if self.ctx is None:
            return {}
        return {"dist/padding_micro_batches": float(self.sum(passes))}

    # ------------------------------------------------------------------ batch statistics
    def gather_groups(self, rewards: torch.Tensor, group_ids: torch.Tensor, *, mode: str):
        """``group_advantages`` over the whole batch: every rank's rewards (a scalar per
        sample) are gathered, so batch-level modes (batch_std, group_mean_batch_std_floor,
        reinforce_pp) see the single-process batch exactly; returns this rank's share."""
        if self.ctx is None:
            return group_advantages(rewards, group_ids, mode=mode)
        n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
        group_offset = self.offset(n_groups)
        start = self.offset(rewards.numel())
        all_rewards = self.gather(rewards.float())
        all_ids = self.gather(group_ids + group_offset)
        advantages, stats = group_advantages(all_rewards, all_ids, mode=mode)
        return advantages[start : start + rewards.numel()], stats

    @property
    def whole_batch(self) -> bool:
        """This rank holds the whole batch: batch statistics may be taken locally."""
        return self.ctx is None

    def whiten(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Advantages whitened with the statistics of every rank's masked-in tokens (what
        ``gae(whiten=True)`` does on the whole batch)."""
        from fastrl.reference.scans import WHITEN_EPS

        keep = mask > 0
        local = advantages[keep]
        start = self.offset(local.numel())
        everything = self.gather(local)
        whitened = masked_whiten(everything, torch.ones_like(everything), eps=WHITEN_EPS)
        out = torch.zeros_like(advantages)
        out[keep] = whitened[start : start + local.numel()].to(out.dtype)
        return out

    def masked_mean_std(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
        """Mean and std of ``x`` over every rank's masked-in entries."""
        mean, std = masked_mean_std(x, mask, all_reduce=self.sum)
        return float(mean), float(std)

    def explained_variance(self, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
        if self.ctx is None:
            return float(explained_variance(values, returns, mask))
        keep = mask > 0
        return float(explained_variance(self.gather(values[keep].float()), self.gather(returns[keep].float()),
                                        self.gather(torch.ones(int(keep.sum()), device=values.device))))

    def pool_reward_metrics(self, local: dict[str, float]) -> dict[str, float]:
        """The reward pool's per-function metrics of the whole batch: counts (failures,
        timeouts, ...) summed, seconds the slowest rank's, means averaged and standard
        deviations pooled from the ranks' moments (shards are equal-sized; exact when every
        sample was scored)."""
        if self.ctx is None:
            return local
        names = self.union(local)  # a rank whose functions logged nothing of a kind adds 0
        local = {k: local.get(k, 0.0) for k in names}
        world = self.world_size

        def mean_of(std_name: str) -> str:
            return std_name[: -len("std")] + "mean"

        values = torch.tensor([float(local[k]) for k in names], dtype=torch.float64)
        second = torch.tensor([float(local[k]) ** 2 + float(local.get(mean_of(k), 0.0)) ** 2 if k.endswith("/std") else 0.0
                               for k in names], dtype=torch.float64)
        sums = self.sum(torch.cat([values, second]))
        slowest = self.max(values.clone())
        out: dict[str, float] = {}
        for i, k in enumerate(names):
            if k.endswith("/std"):
                mean_sum = float(sums[names.index(mean_of(k))]) if mean_of(k) in local else 0.0
                out[k] = pooled_mean_std(mean_sum, float(sums[len(names) + i]), shards=world)[1]
            elif k.endswith("/mean") or "/user/" in k:
                out[k] = float(sums[i]) / world
            elif k.endswith("seconds"):
                out[k] = float(slowest[i])
            else:
                out[k] = float(sums[i])
        return out

    def pool_update_metrics(self, agg: dict[str, list[tuple[float, float]]], *, updates: int,
                            loss_shares: frozenset[str]) -> dict[str, float]:
        """Metrics of an update from each micro-batch's ``(value, token weight)``, averaged over
        its ``updates`` optimizer steps: the ``loss_shares`` (each micro-batch's share of its
        mini-batch's loss, normalised by the global count) summed, minima and maxima, other
        means weighted by tokens; over every rank's micro-batches (``loss`` is already global)."""
        out: dict[str, float] = {}
        for name in self.union(agg):
            vals = agg.get(name) or [(_neutral(name), 0.0)]  # a name another rank saw
            if name in loss_shares:
                out[name] = float(self.sum(torch.tensor(sum(v for v, _ in vals), dtype=torch.float64))) / max(updates, 1)
            elif name.endswith("_min"):
                out[name] = float(self.min(torch.tensor(min(v for v, _ in vals), dtype=torch.float64)))
            elif name.endswith("_max"):
                out[name] = float(self.max(torch.tensor(max(v for v, _ in vals), dtype=torch.float64)))
            elif name == "loss":
                out[name] = sum(v for v, _ in vals) / len(vals)
            else:
                sums = self.sum(torch.tensor([sum(v * w for v, w in vals), sum(w for _, w in vals)], dtype=torch.float64))
                out[name] = float(sums[0] / (sums[1] if sums[1] else 1.0))
        return out

    # ------------------------------------------------------------------ gradients
    def clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Sum the replicated gradients over ranks (FSDP sums the sharded ones), then clip to
        ``max_norm`` (0 or less: only measure); returns the norm before clipping."""
        params = list(parameters)
        if self.ctx is not None:
            dist_mod.sync_replicated_grads(params)
        return dist_mod.clip_grad_norm(params, max_norm if max_norm > 0 else float("inf"), distributed=self.ctx is not None)
