"""Multi-turn rollout: each trajectory's KV continued across turns vs re-prefilling the whole
history every turn (issue 18, section 2 / issue 20).

Shape: a seeded random Qwen2 (vocabulary 151,936, hidden 256, 4 layers), one 256-token
prompt x G=8 trajectories, 8 turns of 64 sampled tokens followed by 64 observation tokens
(seeded random ids). Both paths use the agents driver's ``TokenSampler`` contract
(``continue_sequences(whole sequences, max_new_tokens=, seeds=)``):

* ``continued``: ``HFTokenSampler`` (one ``HFGroupSampler`` multi-turn state; turn k runs only
  the observation tokens + the previous turn's last sampled token);
* ``reprefill``: ``HFGroupSampler.generate`` on the whole history (``group_size=1``, one seed
  per sequence), what the driver's ``GroupSamplerTokens`` does;
* ``hf_generate``: HF ``generate`` on the G whole histories each turn (a fresh ``DynamicCache``
  per turn: what a multi-turn loop over ``generate`` does). Its own random numbers, so other
  tokens, but the same number of tokens per turn (no eos, fixed observations).

* ``continued_unnarrowed``: ``continued`` with ``hf.COMPACT_FRACTION = 0``: trajectories that
  have ended keep stepping through the model until the turn's longest one ends (what the eager
  decode did before it narrowed its KV store to the rows still sampling).

``continued`` and ``reprefill`` use the same seeds, so both sample the same tokens (checked; as
do ``continued`` and ``continued_unnarrowed``). Interleaved rounds, one intra-op
thread, best of the rounds; prefill tokens, wall and process CPU seconds; JSON under
``benchmarks/results/``.

``--budget-spread F``: uneven turns, trajectory ``j``'s budget at turn ``k`` is
``model_tokens * (1 - F * ((j + k) % G) / (G - 1))`` (``F = 0.6``: 40-100 %, mean 70 % of the
longest, about the sql environment's spread); only the ``continued*`` arms take per-trajectory budgets.

    taskset -c 0 python benchmarks/bench_multiturn_rollout.py --rounds 2
    taskset -c 0 python benchmarks/bench_multiturn_rollout.py --arms continued,continued_unnarrowed --budget-spread 0.6 --G 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl.bench.harness import environment, write_payload  # noqa: E402
from fastrl.bench.rollout_cases import qwen2_bench_model, random_prompt  # noqa: E402
from fastrl.rollout import HFGroupSampler, SamplingConfig  # noqa: E402
from fastrl.rollout import hf  # noqa: E402
from fastrl.rollout.hf import HFTokenSampler, TURN_SEED_STRIDE  # noqa: E402


def observation(turn: int, t: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(7919 * turn + t)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def budgets(turn: int, *, G: int, model_tokens: int, spread: float) -> list[int]:
    """Each trajectory's token budget at a turn (``--budget-spread``)."""
    return [max(1, round(model_tokens * (1 - spread * ((j + turn) % G) / max(G - 1, 1)))) for j in range(G)]


def play(continue_sequences, prompt, *, G, turns, model_tokens, obs_tokens, vocab, spread=0.0):
    seqs = [list(prompt) for _ in range(G)]
    sampled = []
    for turn in range(turns):
        seeds = [(j * TURN_SEED_STRIDE + turn) for j in range(G)]
        outs = continue_sequences(seqs, max_new_tokens=budgets(turn, G=G, model_tokens=model_tokens, spread=spread), seeds=seeds)
        sampled.append([o.token_ids for o in outs])
        seqs = [s + o.token_ids + (observation(turn, j, obs_tokens, vocab) if turn + 1 < turns else []) for j, (s, o) in enumerate(zip(seqs, outs))]
    return sampled


def sampled_tokens(sampled: list[list[list[int]]]) -> int:
    return sum(len(c) for turn in sampled for c in turn)


class Reprefill:
    """The driver's GroupSamplerTokens: generate() on the whole history each turn."""

    def __init__(self, sampler, sampling):
        self.sampler, self.sampling, self.prefill_tokens = sampler, sampling, 0

    def continue_sequences(self, sequences, *, max_new_tokens, seeds):
        batch = self.sampler.generate([list(s) for s in sequences], group_size=1,
                                      sampling=replace(self.sampling, max_new_tokens=max_new_tokens[0]), prompt_seeds=list(seeds))
        self.prefill_tokens += batch.stats.prefill_tokens_computed
        from fastrl.rollout.hf import TurnOutput

        return [TurnOutput(c, lp.tolist(), r == "stop") for c, lp, r in zip(batch.completion_ids, batch.completion_logp, batch.finish_reasons)]


class HFGenerate:
    """HF ``generate`` on the whole histories each turn (all of equal length in this benchmark)."""

    def __init__(self, model):
        self.model, self.prefill_tokens = model, 0

    def continue_sequences(self, sequences, *, max_new_tokens, seeds):
        from fastrl.rollout.hf import TurnOutput

        if len({len(s) for s in sequences}) != 1:
            raise ValueError("hf_generate: the histories must have equal lengths (no padding in this benchmark)")
        ids = torch.tensor([list(s) for s in sequences])
        n = max_new_tokens[0]
        torch.manual_seed(seeds[0])
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=n,
                                  min_new_tokens=n, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        self.prefill_tokens += ids.numel()
        return [TurnOutput(row[ids.shape[1]:].tolist(), [], False) for row in out]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--model-tokens", type=int, default=64)
    ap.add_argument("--obs-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--arms", default="continued,reprefill,hf_generate", help="also: continued_unnarrowed")
    ap.add_argument("--budget-spread", type=float, default=0.0, help="uneven per-trajectory budgets (continued* arms only)")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if args.budget_spread and any(not a.startswith("continued") for a in arms):
        ap.error("--budget-spread: only the continued* arms take per-trajectory budgets")
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    model = qwen2_bench_model(vocab=args.vocab, hidden=args.hidden, layers=args.layers)
    V = model.config.vocab_size
    prompt = random_prompt(args.prompt, V)
    sampler = HFGroupSampler(model)
    cfg = SamplingConfig(temperature=1.0)
    kw = dict(G=args.G, turns=args.turns, model_tokens=args.model_tokens, obs_tokens=args.obs_tokens, vocab=V, spread=args.budget_spread)
    fraction = hf.COMPACT_FRACTION
    times = {k: [] for k in arms}
    cpu = {k: [] for k in arms}
    prefill = {}
    tokens = {}
    for r in range(args.rounds):
        for name in arms[r % len(arms):] + arms[: r % len(arms)]:
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.no_grad():
                if name.startswith("continued"):
                    hf.COMPACT_FRACTION = 0.0 if name == "continued_unnarrowed" else fraction
                    ts = HFTokenSampler(sampler, cfg)
                    tokens[name] = play(ts.continue_sequences, prompt, **kw)
                    prefill[name] = sum(ts.state.prefill_tokens)
                    ts.close()
                    hf.COMPACT_FRACTION = fraction
                else:
                    rp = Reprefill(sampler, cfg) if name == "reprefill" else HFGenerate(model)
                    tokens[name] = play(rp.continue_sequences, prompt, **kw)
                    prefill[name] = rp.prefill_tokens
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            print(name, round(times[name][-1], 2), "s,", round(cpu[name][-1], 2), "s CPU, prefill tokens", prefill[name], flush=True)
    best = {k: min(v) for k, v in times.items()}
    best_cpu = {k: min(v) for k, v in cpu.items()}
    payload = {
        "benchmark": "multiturn_rollout_kv_continued_vs_reprefill",
        "command": "python benchmarks/bench_multiturn_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(torch.device("cpu")),
        "threads": 1,
        "note": "interleaved rounds, best of rounds, one intra-op thread, pinned with taskset to one core; wall and process CPU "
                "seconds. The 2-core machine may be shared with other jobs (load averages at start and end recorded): the CPU-time ratios are the reliable ones",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_start_end": [load_start, os.getloadavg()],
        "shape": {"prompt": args.prompt, "G": args.G, "turns": args.turns, "model_tokens_per_turn": args.model_tokens,
                  "budget_spread": args.budget_spread, "compact_fraction": fraction,
                  "observation_tokens_per_turn": args.obs_tokens,
                  "model": {"arch": "Qwen2ForCausalLM", "vocab": V, "hidden": model.config.hidden_size, "layers": model.config.num_hidden_layers}},
        "seconds": times, "best_seconds": best, "cpu_seconds": cpu, "best_cpu_seconds": best_cpu, "prefill_tokens": prefill,
        "sampled_tokens_per_s": {k: sampled_tokens(tokens[k]) / v for k, v in best.items()},
    }
    if "continued" in best and "continued_unnarrowed" in best:
        payload["same_tokens_narrowed"] = tokens["continued"] == tokens["continued_unnarrowed"]
        payload["speedup_narrowed"] = best["continued_unnarrowed"] / best["continued"]
        payload["cpu_speedup_narrowed"] = best_cpu["continued_unnarrowed"] / best_cpu["continued"]
    if "continued" in best and "reprefill" in best:
        payload["same_tokens"] = tokens["continued"] == tokens["reprefill"]
        payload["speedup_continued_vs_reprefill"] = best["reprefill"] / best["continued"]
        payload["prefill_ratio_reprefill_over_continued"] = prefill["reprefill"] / max(prefill["continued"], 1)
    if "continued" in best and "reprefill" in best:
        payload["cpu_speedup_continued_vs_reprefill"] = best_cpu["reprefill"] / best_cpu["continued"]
    if "hf_generate" in best:
        payload["speed_vs_hf_generate"] = {k: best["hf_generate"] / v for k, v in best.items()}
        payload["cpu_speed_vs_hf_generate"] = {k: best_cpu["hf_generate"] / v for k, v in best_cpu.items()}
    payload["cpu_sampled_tokens_per_s"] = {k: sampled_tokens(tokens[k]) / v for k, v in best_cpu.items()}
    print(json.dumps({k: payload.get(k) for k in ("best_seconds", "best_cpu_seconds", "prefill_tokens", "same_tokens", "speedup_continued_vs_reprefill",
                                                  "cpu_speedup_continued_vs_reprefill", "speed_vs_hf_generate", "cpu_speed_vs_hf_generate",
                                                  "same_tokens_narrowed", "speedup_narrowed", "cpu_speedup_narrowed")}))
    write_payload(payload, args.out, stem="multiturn-rollout-cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
