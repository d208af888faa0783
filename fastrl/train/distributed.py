"""Data parallel training under ``torchrun``: process group, FSDP2 sharding, collectives.

``torchrun --nproc-per-node N -m fastrl.cli train ...`` runs N copies of the trainer. Each
rank takes a contiguous slice of every step's prompts (whole prompts, so every group's
statistics are local), samples them with its own sampler, and the update equals the
single-process one because

- batch-level statistics (batch-std advantages, REINFORCE++ / GAE whitening, metrics) are
  computed on the gathered batch or from all-reduced moments;
- the loss is normalised by the *global* token/sequence count of the mini-batch, and the
  gradients are *summed* over ranks (FSDP2 averages by default: the divide factor is set
  to 1 with sum-only collectives, so the sum of the local losses' gradients is the
  single-process gradient);
- every rank runs the same number of forward/backward passes (FSDP2 all-gathers per
  forward and reduce-scatters per backward): ranks with fewer micro-batches run a
  zero-weight copy of one of theirs.

Sharding layout (``shard_causal_lm``): every decoder layer is one FSDP2 unit and the decoder
body (embeddings, final norm) is the root unit. The LM head stays replicated on every rank
(its gradient is all-reduced by ``sync_replicated_grads``): fastrl's log-prob ops read the
head's weight directly, outside any module forward, where FSDP2 would not have gathered it.
A head tied to the input embedding is replicated together with it for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import copy
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from fastrl.errors import InputError


__all__ = [
    "DistContext",
    "detect",
    "shard_causal_lm",
    "sync_replicated_grads",
    "clip_grad_norm",
    "full_named_tensors",
    "shard_models",
]


@dataclass(frozen=True)
class DistContext:
    """This process's place in a ``torchrun`` job (world size > 1)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    owns_process_group: bool = True
    """This context initialised the process group (and destroys it when the trainer closes)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        dist.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place and returned: ``op`` is sum | max | min."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=ops[op])
        return tensor

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0 (sizes may differ), in rank order."""
        n = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n)
        sizes_i = [int(s) for s in sizes]
        longest = max(sizes_i)
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat([p[:s] for p, s in zip(parts, sizes_i)])

    def offset(self, count: int) -> int:
        """Sum of ``count`` over the ranks before this one."""
        counts = self.all_gather_cat(torch.tensor([count], dtype=torch.long, device=self.device))
        return int(counts[: self.rank].sum())

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")

    def check_same(self, what: str, value: str) -> None:
        """InputError on every rank unless ``value`` is the same on all ranks."""
        digest = int(hashlib.sha256(value.encode()).hexdigest()[:15], 16)
        mine = torch.tensor([digest], dtype=torch.long, device=self.device)
        every = self.all_gather_cat(mine).tolist()
        if len(set(every)) > 1:
            differing = [r for r, d in enumerate(every) if d != every[0]]
            raise InputError(
                f"torchrun: the {what} differs across ranks (rank 0 vs ranks {differing}); every rank must be "
                "started with the same options"
            )


def detect() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from the environment ``torchrun`` sets, or None
    when this is a plain process (or a torchrun job of one process)."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world <= 1:
        return None
    return int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))


def init(device_name: str) -> DistContext | None:
    """Join the torchrun job (gloo on CPU, nccl on CUDA); None outside torchrun."""
    found = detect()
    if found is None:
        return None
    rank, world, local_rank = found
    use_cuda = device_name.startswith("cuda") or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise InputError(f"device={device_name!r} under torchrun but CUDA is not available")
        if device_name not in ("auto", "cuda"):
            raise InputError(f"under torchrun each rank uses cuda:LOCAL_RANK; pass device=cuda or auto, not {device_name!r}")
        torch.cuda.set_device(local_rank)
    backend = "nccl" if use_cuda else "gloo"
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend, device_id=torch.device("cuda", local_rank) if use_cuda else None)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend, owns_process_group=owns)


def config_fingerprint(config: Any) -> str:
    import dataclasses

    return json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)


# ---------------------------------------------------------------------------- sharding


def _layers(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(decoder, "layers", None) or getattr(decoder, "h", None)
    if layers is None or not isinstance(layers, torch.nn.ModuleList):
        raise InputError(f"cannot find the decoder layers of {type(decoder).__name__} (expected .layers or .h)")
    return list(layers)


def shard_causal_lm(model: torch.nn.Module, *, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 (``fully_shard``) on a Hugging Face causal LM in place: one unit per decoder
    layer, the decoder body as the root unit; the LM head (and an embedding tied to it)
    stays replicated. Gradients are summed over ranks, not averaged.

    ``param_dtype``: mixed precision (parameters all-gathered and computed in this dtype,
    gradients reduced in fp32); None keeps fp32.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from fastrl.ops.hf import causal_lm_decoder

    decoder = causal_lm_decoder(model)
    kwargs: dict[str, Any] = {}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder_params = {id(p) for p in decoder.parameters()}
    tied = {p for p in (head.parameters() if head is not None else ()) if id(p) in decoder_params}
    for layer in _layers(decoder):
        fully_shard(layer, reshard_after_forward=True, **kwargs)
    # reshard_after_forward=True on the root too: forwards outside a training step (no-grad
    # passes) never leave stale gathered weights behind an optimizer step
    fully_shard(decoder, reshard_after_forward=True, ignored_params=tied or None, **kwargs)
    for module in decoder.modules():
        if isinstance(module, FSDPModule):
            # local losses are normalised by global counts: sum the gradients over ranks
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def _is_dtensor(t: torch.Tensor | None) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def sync_replicated_grads(parameters: Iterable[torch.nn.Parameter]) -> None:
    """All-reduce (sum) the gradients of the parameters FSDP does not manage (replicated)."""
    grads = [p.grad for p in parameters if p.grad is not None and not _is_dtensor(p.grad)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    start = 0
    for g in grads:
        g.copy_(flat[start : start + g.numel()].view_as(g))
        start += g.numel()


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, *, distributed: bool) -> torch.Tensor:
    """Clip to a total 2-norm of ``max_norm`` (``inf``: only measure); returns the norm before
    clipping (0-dim fp32). With ``distributed``: sharded (DTensor) gradients contribute their
    local shards, summed over ranks; replicated gradients count once."""
    params = [p for p in parameters if p.grad is not None]
    if not distributed:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not params:
        return torch.zeros(())
    sharded = [p.grad.to_local() for p in params if _is_dtensor(p.grad)]
    replicated = [p.grad for p in params if not _is_dtensor(p.grad)]
    device = (sharded or replicated)[0].device
    sq_sharded = torch.zeros((), dtype=torch.float32, device=device)
    for g in sharded:
        sq_sharded = sq_sharded + g.float().pow(2).sum()
    dist.all_reduce(sq_sharded)
    sq = sq_sharded
    for g in replicated:
        sq = sq + g.float().pow(2).sum()
    total = sq.sqrt()
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in sharded + replicated:
            g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def full_named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` of every parameter, gathering FSDP shards one at a time
    (a collective: every rank must iterate)."""
    for name, p in module.named_parameters():
        yield name, (p.full_tensor() if _is_dtensor(p) else p.detach())


@torch.no_grad()
def broadcast_module(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (before sharding)."""
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)


def shard_slice(total: int, rank: int, world: int) -> slice:
    """The contiguous share of ``total`` items of ``rank`` (``total`` divisible by ``world``)."""
    per = total // world
    return slice(rank * per, (rank + 1) * per)


def shard_models(policy: torch.nn.Module, critic_body: torch.nn.Module | None, *,
                 param_dtype: torch.dtype | None) -> torch.nn.Module:
    """FSDP2 on the policy (and the critic's body, ``ValueModel.body``); returns a full, unsharded copy of the policy for the
    sampler. Generation runs a rank-dependent number of forwards (completions stop at
    different steps), which FSDP's per-forward all-gathers cannot follow, and a copy synced
    after each update costs one all-gather per step instead of one per token."""
    full_copy = copy.deepcopy(policy).eval().requires_grad_(False)
    shard_causal_lm(policy, param_dtype=param_dtype)
    if critic_body is not None:
        shard_causal_lm(critic_body, param_dtype=param_dtype)
    return full_copy
