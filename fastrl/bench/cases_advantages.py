"""Benchmark cases for the advantages family: group advantages, value loss, masked whitening.

Baselines are the way trainers commonly write these today (our own code in their style):

- ``dict_loop``: GRPO advantages with a Python loop over samples and a dict of groups
  (the structure of verl's ``compute_grpo_outcome_advantage``).
- ``unique_scatter``: a vectorised eager version built on ``torch.unique`` (syncs on CUDA).
- ``eager``: the value loss / whitening as a chain of PyTorch ops with autograd.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from fastrl.bench.harness import BenchCase
from fastrl.ops import group_advantages, masked_whiten, value_loss


def dict_loop_grpo(scores: torch.Tensor, index: list[int], eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages, one sample at a time through a dict of groups."""
    scores = scores.clone()
    members: dict[int, list[torch.Tensor]] = defaultdict(list)
    for i in range(len(index)):
        members[index[i]].append(scores[i])
    mean: dict[int, torch.Tensor] = {}
    std: dict[int, torch.Tensor] = {}
    for key, vals in members.items():
        if len(vals) == 1:
            mean[key], std[key] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(vals)
            mean[key], std[key] = stacked.mean(), stacked.std()
    for i in range(len(index)):
        scores[i] = (scores[i] - mean[index[i]]) / (std[index[i]] + eps)
    return scores


def unique_scatter_grpo(scores: torch.Tensor, index: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Vectorised eager GRPO advantages via torch.unique (a host sync on CUDA)."""
    _, inv, counts = torch.unique(index, return_inverse=True, return_counts=True)
    G = counts.numel()
    sums = torch.zeros(G, device=scores.device).index_add_(0, inv, scores)
    mean = sums / counts
    dev = scores - mean[inv]
    var = torch.zeros(G, device=scores.device).index_add_(0, inv, dev * dev) / (counts - 1).clamp(min=1)
    return torch.where(counts[inv] > 1, dev / (var.sqrt()[inv] + eps), 0.0)


def eager_value_loss(values, old_values, returns, mask, clip):
    """Clipped value loss as separate PyTorch ops (token-mean), autograd through all of them."""
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    loss_t = 0.5 * torch.max((values - returns) ** 2, (v_clip - returns) ** 2)
    m = mask.to(values.dtype)
    loss = (loss_t * m).sum() / m.sum().clamp(min=1)
    with torch.no_grad():
        clip_frac = (((v_clip - returns) ** 2 > (values - returns) ** 2).to(values.dtype) * m).sum() / m.sum()
        var_r = torch.var(returns[mask.bool()])  # boolean indexing: syncs on CUDA
        ev = 1 - torch.var((returns - values)[mask.bool()]) / var_r
    return loss, clip_frac, ev


def eager_whiten(x, mask, eps=1e-8):
    m = mask.to(x.dtype)
    mean = (x * m).sum() / m.sum()
    var = (((x - mean) * m) ** 2).sum() / (m.sum() - 1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def _group_case(device: torch.device, n: int, group: int, with_loop: bool) -> BenchCase:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    ids = torch.arange(n // group).repeat_interleave(group)[torch.randperm(n, generator=g)]
    rewards_d, ids_d = rewards.to(device), ids.to(device)
    index_list = ids.tolist()
    impls = {
        "fastrl": lambda: group_advantages(rewards_d, ids_d, mode="grpo"),
        "unique_scatter": lambda: unique_scatter_grpo(rewards_d, ids_d),
    }
    if with_loop:
        # the loop runs on CPU tensors, as trainers run it on the gathered scores
        impls["dict_loop"] = lambda: dict_loop_grpo(rewards, index_list)
    return BenchCase(
        "group_advantages", f"N={n} G={group}", impls, note="grpo mode; dict_loop on CPU tensors", repeats=3 if with_loop else 10
    )


def _value_loss_case(device: torch.device, B: int, T: int) -> BenchCase:
    g = torch.Generator().manual_seed(1)
    v = torch.randn(B, T, generator=g).to(device).requires_grad_()
    v_old = (v.detach() + 0.3 * torch.randn(B, T, generator=g).to(device))
    R = torch.randn(B, T, generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.2).to(device)

    def fast():
        loss, metrics = value_loss(v, v_old, R, mask, clip=0.2)
        loss.backward()
        return metrics

    def eager():
        loss, *_ = eager_value_loss(v, v_old, R, mask, 0.2)
        loss.backward()

    return BenchCase("value_loss fwd+bwd", f"B={B} T={T} clip=0.2", {"fastrl": fast, "eager": eager}, note="token-mean, with metrics")


def _whiten_case(device: torch.device, B: int, T: int) -> BenchCase:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, T, generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.2).to(device)
    return BenchCase(
        "masked_whiten", f"B={B} T={T}", {"fastrl": lambda: masked_whiten(x, mask), "eager": lambda: eager_whiten(x, mask)}
    )


def cases(device: torch.device, quick: bool) -> list[BenchCase]:
    """Quick: the 64K-sample loop comparison plus small token shapes; full adds larger ones."""
    out = [_group_case(device, 65536, 16, with_loop=True)]
    if quick:
        out += [_value_loss_case(device, 32, 1024), _whiten_case(device, 32, 1024)]
    else:
        out += [
            _group_case(device, 1 << 20, 16, with_loop=False),
            _value_loss_case(device, 64, 4096),
            _value_loss_case(device, 256, 8192) if device.type == "cuda" else _value_loss_case(device, 128, 4096),
            _whiten_case(device, 256, 4096),
        ]
    return out
