"""The agent training step: each group's prompt shared (``GroupPackedBatching``) vs repeated per
trajectory (``PaddedBatching``), with the environment tokens attended to and masked out of the
loss (issue 18, benchmarks).

What is timed is the trainer's update path on one step's ``Experience`` (``fastrl.train.trainer``
``_update`` / ``_micro_batch_loss`` without the optimizer): the layout's micro-batches by
token budget, the layout's policy forward with entropies, ``fastrl.ops.policy_loss`` (GRPO
preset, on-policy ratio, the mini-batch's global counts, the layout's ``cu_seqlens``) and the
backward -- the same calls, in the same order, as the trainer makes.

The trajectories are multi-turn, built as the agents driver builds them
(``fastrl.agents.trajectory.TrajectorySample.append`` of ``prompt``, ``policy`` and ``env``
segments; seeded random token ids), laid out by ``fastrl.agents.batch.AgentBatch`` and turned
into the trainer's ``Experience`` (``Experience.from_agent_batch``: loss mask = policy tokens).
Shape per trajectory: a ``P``-token prompt shared by the group's G=8 trajectories, then
``turns`` x (policy turn + observation), the last turn without an observation. ``fixed``: every
turn exactly ``model_tokens`` + ``obs_tokens`` (the issue's 8 x 64 + 64); ``variable``: turns
per trajectory uniform in ``[turns/2, turns]`` and each turn's lengths uniform in
``[len/2, 3 len/2]`` (trajectories end at different turns, as real ones do).

Model: a random-init Qwen2 (fp32, hidden 256, 4 layers, vocab 32768, SDPA), as in
``bench_shared_prefix.py``. For each shape:

- time: both layouts in ONE fresh process, alternating ``--rounds`` times after a warm-up
  step each, best of the rounds (threads pinned with ``--threads``);
- peak memory: each layout in its own fresh process (``fastrl.bench.memory``: peak RSS above
  the post-setup baseline);
- tokens the forward runs (the layout's ``cost``) and tokens trained on (the loss mask);
- gradients: the largest relative parameter-gradient difference between the layouts, and
  the largest |d loss / d logp| at environment-token positions in the packed layout (must
  be exactly 0).

    OMP_NUM_THREADS=1 nice python benchmarks/bench_agent_train_step.py --threads 1 --rounds 3
    python benchmarks/bench_agent_train_step.py --quick      # tiny smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

LAYOUTS = ("packed", "padded")
"""``packed``: GroupPackedBatching (prompt once per group); ``padded``: PaddedBatching (prompt per row)."""
MODEL = dict(hidden=256, layers=4, vocab=32768, heads=4, kv_heads=2)
QUICK_MODEL = dict(hidden=32, layers=2, vocab=512, heads=4, kv_heads=2)
SHAPES = {
    # name: (prompt tokens, turns, model tokens per turn, observation tokens per turn, variable)
    "P256_fixed": (256, 8, 64, 64, False),
    "P256_variable": (256, 8, 64, 64, True),
    "P1024_variable": (1024, 8, 64, 64, True),
}
QUICK_SHAPES = {"quick_variable": (32, 3, 8, 8, True)}
TOKEN_BUDGET = 8192
"""``TrainConfig.micro_batch_tokens``' default (a group larger than it is one micro-batch)."""


def make_trajectories(*, prompt_len: int, turns: int, model_tokens: int, obs_tokens: int, variable: bool,
                      group_size: int, groups: int, vocab: int, seed: int = 0):
    """``groups * group_size`` trajectories (group-major), seeded random ids, outcome rewards 0/1."""
    import torch

    from fastrl.agents.trajectory import Trajectory

    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    def length(n: int) -> int:
        return int(torch.randint(max(1, n // 2), n + n // 2 + 1, (1,), generator=g)) if variable else n

    out = []
    for group in range(groups):
        prompt = ids(prompt_len)
        for index in range(group_size):
            t = Trajectory(group=group, index=index, row={}, env_seed=group)
            sample = t.current
            sample.append("prompt", -1, prompt)
            n_turns = int(torch.randint(max(1, turns // 2), turns + 1, (1,), generator=g)) if variable else turns
            for k in range(n_turns):
                policy = ids(length(model_tokens))
                sample.append("policy", k, policy, (-torch.rand(len(policy), generator=g)).tolist())
                if k + 1 < n_turns:
                    sample.append("env", k, ids(length(obs_tokens)))
                t.turn_rewards.append(0.0)
            t.turns = n_turns
            t.outcome_reward = float(torch.rand((), generator=g) < 0.5)
            sample.check()
            out.append(t)
    return out


def build_experience(shape: str, *, group_size: int, groups: int, vocab: int):
    import torch

    from fastrl.agents.batch import AgentBatch
    from fastrl.train.experience import Experience

    P, turns, m, o, variable = {**SHAPES, **QUICK_SHAPES}[shape]
    trajectories = make_trajectories(prompt_len=P, turns=turns, model_tokens=m, obs_tokens=o, variable=variable,
                                     group_size=group_size, groups=groups, vocab=vocab)
    agent = AgentBatch.from_trajectories(trajectories, group_size=group_size, pad_token_id=0)
    exp = Experience.from_agent_batch(agent, device=torch.device("cpu"))  # what the trainer's AgentCollector builds
    # GRPO's group advantage (the per-sequence [B] form the trainer's group estimators give)
    r = exp.rewards.view(-1, group_size)
    exp.advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)
    return exp


def env_tokens(exp) -> int:
    """Environment (observation) tokens of the step: tokens after each row's prompt that are not trained on."""
    return sum(len(c) for c in exp.batch.completion_ids) - int(exp.loss_mask.sum())


def build_step(*, layout: str, shape: str, group_size: int = 8, groups: int = 1, threads: int = 1,
               model: dict[str, int] | None = None, grads_out: str | None = None,
               env_grad_out: str | None = None) -> Callable[[], None]:
    """One update (forward + backward of every micro-batch, grads cleared first) in ``layout``
    (``LAYOUTS``). ``grads_out``: the first call's parameter gradients are saved there;
    ``env_grad_out``: the largest |d loss / d logp| at masked (environment) positions, as JSON."""
    import torch

    from bench_long_trajectory import build_model
    from fastrl.config import PolicyLossConfig
    from fastrl.ops import policy_loss
    from fastrl.train.batching import make_batching

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    torch.set_num_threads(threads)
    shape_model = model or MODEL
    exp = build_experience(shape, group_size=group_size, groups=groups, vocab=shape_model["vocab"])
    policy = build_model(**shape_model, max_positions=int(exp.batch.input_ids.shape[1]) + 8)
    lay = make_batching(shared_prefix=layout == "packed", token_budget=TOKEN_BUDGET, device=torch.device("cpu"), temperature=1.0)
    config = PolicyLossConfig.preset("grpo", kl_coef=0.0)
    counts = exp.counts(exp.rows())
    micro = lay.micro_batches(exp)
    calls = [0]

    def step() -> None:
        policy.zero_grad(set_to_none=True)
        env_grad = 0.0
        for mb in micro:
            with lay.attention(mb, [policy]):
                logp, entropy = lay.logprobs(policy, mb, entropy=True)
                if env_grad_out is not None and calls[0] == 0:
                    logp.retain_grad()
                mask = lay.gather(mb, exp.loss_mask)
                loss, _ = policy_loss(logp, logp.detach(), lay.gather(mb, exp.advantages), mask, entropy=entropy,
                                      config=config, global_counts=counts, cu_seqlens=lay.cu_seqlens(mb))
                loss.backward()
            if env_grad_out is not None and calls[0] == 0:
                env_grad = max(env_grad, float(logp.grad[mask == 0].abs().max()) if bool((mask == 0).any()) else 0.0)
        if calls[0] == 0:
            if grads_out is not None:
                torch.save({n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}, grads_out)
            if env_grad_out is not None:
                Path(env_grad_out).write_text(json.dumps({"max_abs_grad_at_env_tokens": env_grad}))
        calls[0] += 1

    step.tokens_forward = sum(lay.cost(exp, [g]) for g in range(exp.num_groups))  # type: ignore[attr-defined]
    step.tokens_trained = int(exp.loss_mask.sum())  # type: ignore[attr-defined]
    step.micro_batches = len(micro)  # type: ignore[attr-defined]
    step.env_tokens = env_tokens(exp)  # type: ignore[attr-defined]
    gc.collect()
    step.device = torch.device("cpu")  # type: ignore[attr-defined]
    return step


def interleaved_times(kwargs: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Both layouts in one process, alternating ``rounds`` times after a warm-up step each:
    back-to-back steps see the same machine load."""
    steps = {name: build_step(layout=name, **kwargs) for name in LAYOUTS}
    for name in LAYOUTS:
        steps[name]()
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(rounds):
        for name in LAYOUTS:
            gc.collect()
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return {"times_s": times,
            "tokens_forward": {n: s.tokens_forward for n, s in steps.items()},
            "tokens_trained": {n: s.tokens_trained for n, s in steps.items()},
            "micro_batches": {n: s.micro_batches for n, s in steps.items()},
            "env_tokens": steps["packed"].env_tokens}


def _interleaved_in_child(kwargs: dict[str, Any], rounds: int, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    code = ("import json, sys; sys.path[:0] = [%r, %r]; from bench_agent_train_step import interleaved_times; "
            "print(json.dumps(interleaved_times(json.loads(sys.argv[1]), int(sys.argv[2]))))") % (str(ROOT), str(HERE))
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs), str(rounds)], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def grad_rel_diff(path_a: str, path_b: str) -> float:
    """max over parameters of max|a - b| / max|b|."""
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    if set(a) != set(b):
        raise RuntimeError(f"gradients of different parameters: {sorted(set(a) ^ set(b))[:5]}")
    worst = 0.0
    for name in a:
        ga, gb = a[name].double(), b[name].double()
        scale = gb.abs().max().item()
        worst = max(worst, (ga - gb).abs().max().item() / (scale if scale > 0 else 1.0))
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import tempfile

    import torch

    from fastrl.bench.harness import environment, write_payload
    from fastrl.bench.memory import measure_in_subprocess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and shape (smoke run)")
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--groups", type=int, default=1, help="prompts (groups of G trajectories) per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (best-of)")
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process peak-memory runs")
    p.add_argument("--cpu-method", choices=("rss", "allocator"), default="rss",
                   help="peak memory: the process's RSS (default) or torch's allocator accounting (fastrl.bench.memory)")
    p.add_argument("--mem-cap-gb", type=float, default=16.0)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    model = QUICK_MODEL if args.quick else MODEL
    names = list(QUICK_SHAPES) if args.quick else (args.shapes.split(",") if args.shapes else list(SHAPES))
    for n in names:
        if n not in SHAPES and n not in QUICK_SHAPES:
            raise SystemExit(f"--shapes: unknown shape {n!r}; accepted: {sorted(SHAPES)}")
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads), "MALLOC_MMAP_THRESHOLD_": "131072"}
    tmp = tempfile.mkdtemp(prefix="fastrl_agent_step_")
    rows = []
    for name in names:
        P, turns, m, o, variable = {**SHAPES, **QUICK_SHAPES}[name]
        base = dict(shape=name, group_size=args.group_size, groups=args.groups, threads=args.threads, model=model)
        row: dict[str, Any] = {"shape": name, "prompt_len": P, "turns": turns, "model_tokens_per_turn": m,
                               "obs_tokens_per_turn": o, "variable": variable}
        # gradients (and the env-token gradient) from one step of each layout, in fresh processes with memory
        grads = {n: os.path.join(tmp, f"{name}_{n}.pt") for n in LAYOUTS}
        env_grad = os.path.join(tmp, f"{name}_envgrad.json")
        for n in LAYOUTS:
            kwargs = dict(base, layout=n, grads_out=grads[n], env_grad_out=env_grad if n == "packed" else None)
            if args.no_memory:
                build_step(**kwargs)()
                continue
            r = measure_in_subprocess("bench_agent_train_step:build_step", kwargs, repeats=1, timeout_s=args.timeout_s,
                                      mem_limit_gb=args.mem_cap_gb, env={**env, "PYTHONPATH": str(HERE)},
                                      cpu_method=args.cpu_method)
            row.setdefault("memory", {})[n] = r
            print(f"  {name} {n}: " + (f"peak +{r['peak_extra_mb']:.0f} MiB" if "error" not in r else f"FAILED {r['error'][:200]}"),
                  flush=True)
        if all(os.path.exists(g) for g in grads.values()):
            row["grad_max_rel_diff"] = grad_rel_diff(grads["packed"], grads["padded"])
        if os.path.exists(env_grad):
            row.update(json.loads(Path(env_grad).read_text()))
        t = _interleaved_in_child(base, args.rounds, env, args.timeout_s)
        row.update(t)
        best = {n: min(v) for n, v in t["times_s"].items()}
        row["best_s"] = best
        row["speedup_packed_over_padded"] = best["padded"] / best["packed"]
        row["tokens_ratio_padded_over_packed"] = t["tokens_forward"]["padded"] / t["tokens_forward"]["packed"]
        if "memory" in row and all("error" not in row["memory"][n] for n in LAYOUTS):
            row["memory_ratio_padded_over_packed"] = (row["memory"]["padded"]["peak_extra_mb"]
                                                      / max(row["memory"]["packed"]["peak_extra_mb"], 1e-9))
        print(f"  {name}: packed {best['packed']:.2f} s, padded {best['padded']:.2f} s "
              f"({row['speedup_packed_over_padded']:.2f}x), tokens {t['tokens_forward']['packed']} vs "
              f"{t['tokens_forward']['padded']}, grad rel diff {row.get('grad_max_rel_diff')}, "
              f"env-token grad {row.get('max_abs_grad_at_env_tokens')}", flush=True)
        rows.append(row)
    payload = {
        "benchmark": "agent training step: prompt shared per group (GroupPackedBatching) vs repeated (PaddedBatching), "
                     "environment tokens masked",
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(torch.device("cpu")),
        "load_average_at_end": os.getloadavg(),
        "model": {"arch": "Qwen2 (random init, fp32, sdpa)", **model, "intermediate": 4 * model["hidden"]},
        "group_size": args.group_size, "groups": args.groups, "threads": args.threads, "rounds": args.rounds,
        "token_budget": TOKEN_BUDGET, "memory_method": "none" if args.no_memory else args.cpu_method, "loss": "grpo preset, kl_coef 0, on-policy ratio, entropy computed",
        "results": rows,
    }
    write_payload(payload, args.out, stem="agent-train-step-cpu" + ("-quick" if args.quick else ""))
    return payload


if __name__ == "__main__":
    main()
