"""Benchmark cases for advantages over the turns of agent trajectories (GiGPO, turn-discounted).

Baseline (our own code in the style trainers use today): ``turn_loop``, a Python loop over
trajectories and turns (discounted step returns per trajectory, a dict of step groups,
per-group mean/std, then a token loop per turn span) -- the structure of verl-agent's
``compute_gigpo_outcome_advantage``. The loop runs on CPU tensors, as trainers run it on the
gathered batch.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from fastrl.bench.harness import BenchCase
from fastrl.ops import turn_advantages


def turn_loop_gigpo(spans, rewards, keys, outcome, ids, *, gamma, omega, T, eps=1e-6) -> torch.Tensor:
    """GiGPO advantages [B, T] with Python loops over trajectories, turns and groups.

    ``spans[b]`` is a list of (start, end) token spans, one per turn; ``rewards[b]`` and
    ``keys[b]`` lists of per-turn rewards and state keys; ``outcome``/``ids`` lists."""
    B = len(spans)
    by_group: dict[int, list[float]] = defaultdict(list)
    for b in range(B):
        by_group[ids[b]].append(outcome[b])
    ep = {}
    for g, vals in by_group.items():
        t = torch.tensor(vals)
        ep[g] = (t.mean(), t.std()) if len(vals) > 1 else None
    steps: dict[tuple[int, int], list[tuple[int, int, float]]] = defaultdict(list)
    for b in range(B):
        run = 0.0
        rets = []
        for r in reversed(rewards[b]):
            run = r + gamma * run
            rets.append(run)
        for k, ret in enumerate(reversed(rets)):
            steps[(ids[b], keys[b][k])].append((b, k, ret))
    step_adv: dict[tuple[int, int], float] = {}
    for members in steps.values():
        if len(members) == 1:
            step_adv[members[0][:2]] = 0.0
            continue
        t = torch.tensor([m[2] for m in members])
        mean, std = t.mean(), t.std()
        for (b, k, ret) in members:
            step_adv[(b, k)] = float((ret - mean) / (std + eps))
    out = torch.zeros(B, T)
    for b in range(B):
        stats = ep[ids[b]]
        a_e = 0.0 if stats is None else float((outcome[b] - stats[0]) / (stats[1] + eps))
        for k, (s, e) in enumerate(spans[b]):
            out[b, s:e] = a_e + omega * step_adv[(b, k)]
    return out


def _trajectories(B: int, K: int, turn_len: int, env_len: int, group: int):
    """B trajectories of K turns each (turn_len policy tokens, env_len environment tokens)."""
    g = torch.Generator().manual_seed(0)
    T = K * (turn_len + env_len)
    pos = torch.arange(T)
    turn_index = (pos // (turn_len + env_len)).expand(B, T).contiguous()
    loss_mask = ((pos % (turn_len + env_len)) < turn_len).expand(B, T).contiguous()
    rewards = torch.randint(0, 2, (B, K), generator=g).float()
    keys = torch.randint(0, 4, (B, K), generator=g)  # few states: step groups of several members
    outcome = torch.randint(0, 2, (B,), generator=g).float()
    ids = torch.arange(B // group).repeat_interleave(group)
    spans = [[(k * (turn_len + env_len), k * (turn_len + env_len) + turn_len) for k in range(K)]] * B
    return T, turn_index, loss_mask, rewards, keys, outcome, ids, spans


def _gigpo_case(device: torch.device, B: int, K: int, turn_len: int, env_len: int, with_loop: bool) -> BenchCase:
    T, ti, lm, r, keys, out, ids, spans = _trajectories(B, K, turn_len, env_len, group=8)
    nt = torch.full((B,), K)
    dev = [x.to(device) for x in (ti, lm, r, nt, out, ids, keys)]
    impls = {
        "fastrl": lambda: turn_advantages(*dev[:6], mode="gigpo", state_keys=dev[6], gamma=0.95, step_coef=1.0),
    }
    if with_loop:
        lists = (r.tolist(), keys.tolist(), out.tolist(), ids.tolist())
        impls["turn_loop"] = lambda: turn_loop_gigpo(spans, *lists, gamma=0.95, omega=1.0, T=T)
    return BenchCase("turn_advantages gigpo", f"B={B} K={K} T={T}", impls,
                     note="groups of 8 trajectories, 4 states per turn; turn_loop on CPU tensors",
                     repeats=3 if with_loop else 10)


def cases(device: torch.device, quick: bool) -> list[BenchCase]:
    """Quick: 256 trajectories of 8 turns against the loop; full adds 1024 x 16 and a larger op-only shape."""
    out = [_gigpo_case(device, 256, 8, 64, 32, with_loop=True)]
    if not quick:
        out += [_gigpo_case(device, 1024, 16, 64, 32, with_loop=True),
                _gigpo_case(device, 4096, 16, 128, 64, with_loop=False)]
    return out
