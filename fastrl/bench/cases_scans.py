"""Benchmark cases: GAE and discounted returns vs the Python loop over time.

The baselines are what RL trainers run today: a Python ``for t in reversed(range(T))``
loop, vectorised over the batch only. ``verl-style`` carries ``V_next`` and ``A_next``
through masked-out tokens (the masked variant of verl's ``compute_gae_advantage_return``);
``OpenRLHF-style`` zeroes masked-out rewards/values and reads ``values[:, t+1]`` directly
(as ``get_advantages_and_returns`` does). Both are written here, for timing only.
"""

from __future__ import annotations

import torch

from fastrl.bench.harness import BenchCase
from fastrl.ops.scans import discounted_returns, gae

GAMMA = 1.0
LAM = 0.95


@torch.no_grad()
def gae_loop_masked_carry(rewards, values, mask, gamma: float, lam: float):
    """Reverse Python loop; masked-out tokens pass the state through (verl-style)."""
    m = mask.to(values.dtype)
    next_v = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        cur = delta + gamma * lam * last
        next_v = values[:, t] * m[:, t] + (1 - m[:, t]) * next_v
        last = cur * m[:, t] + (1 - m[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv * m, (adv + values) * m


@torch.no_grad()
def gae_loop_zeroed(rewards, values, mask, gamma: float, lam: float):
    """Reverse Python loop over zeroed padding, reading ``values[:, t+1]`` (OpenRLHF-style)."""
    m = mask.to(values.dtype)
    values = values * m
    rewards = rewards * m
    T = rewards.shape[1]
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(T)):
        next_v = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        last = delta + gamma * lam * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=1)
    return adv, adv + values


@torch.no_grad()
def returns_loop(rewards, mask, gamma: float):
    """Reverse Python loop for the discounted reward-to-go with masked carry."""
    m = mask.to(rewards.dtype)
    g = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        cur = rewards[:, t] + gamma * g
        g = cur * m[:, t] + (1 - m[:, t]) * g
        out.append(cur * m[:, t])
    return torch.stack(out[::-1], dim=1)


def make_inputs(B: int, T: int, device: torch.device, seed: int = 0):
    """Right-padded rows of random length with an observation block in the middle of each."""
    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.randn(B, T, generator=gen) * 0.01).to(device)
    values = torch.randn(B, T, generator=gen).to(device)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    pos = torch.arange(T)
    mask = pos[None, :] < lengths[:, None]
    mask &= ~((pos[None, :] >= T // 4) & (pos[None, :] < T // 4 + T // 16))  # tool output
    return rewards, values, mask.to(device)


def cases(device: torch.device, quick: bool) -> list[BenchCase]:
    shapes = [(64, 1024)] if quick else [(64, 1024), (64, 8192)]
    out: list[BenchCase] = []
    for B, T in shapes:
        r, v, m = make_inputs(B, T, device)
        impls = {"fastrl": lambda r=r, v=v, m=m: gae(r, v, m, gamma=GAMMA, lam=LAM)}
        if device.type == "cuda":
            impls["fastrl torch backend"] = lambda r=r, v=v, m=m: gae(r, v, m, gamma=GAMMA, lam=LAM, backend="torch")
        impls["loop (verl-style carry)"] = lambda r=r, v=v, m=m: gae_loop_masked_carry(r, v, m, GAMMA, LAM)
        impls["loop (OpenRLHF-style)"] = lambda r=r, v=v, m=m: gae_loop_zeroed(r, v, m, GAMMA, LAM)
        out.append(BenchCase("gae", f"B={B} T={T}", impls, repeats=3 if T > 2048 else 5))

        impls = {"fastrl": lambda r=r, m=m: discounted_returns(r, m, gamma=GAMMA)}
        if device.type == "cuda":
            impls["fastrl torch backend"] = lambda r=r, m=m: discounted_returns(r, m, gamma=GAMMA, backend="torch")
        impls["loop"] = lambda r=r, m=m: returns_loop(r, m, GAMMA)
        out.append(BenchCase("discounted_returns", f"B={B} T={T}", impls, repeats=3 if T > 2048 else 5))
    if device.type == "cuda" and not quick:
        # Long-context scan: one launch at T = 128K (the loops would take minutes here).
        B, T = 8, 131072
        r, v, m = make_inputs(B, T, device)
        impls = {
            "fastrl": lambda: gae(r, v, m, gamma=GAMMA, lam=LAM),
            "fastrl torch backend": lambda: gae(r, v, m, gamma=GAMMA, lam=LAM, backend="torch"),
        }
        out.append(BenchCase("gae", f"B={B} T={T}", impls))
    return out
