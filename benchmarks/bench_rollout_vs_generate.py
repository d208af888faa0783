"""Tokens/s of HFGroupSampler vs HF ``generate`` vs the previous sampler (issue 20, section 1).

Shapes: ``real`` -- a seeded random Qwen2 (vocabulary 151,936, hidden 256, 4 layers, 4 heads,
2 kv heads), 2 prompts x G=8, prompt 256 + completion 128 tokens; ``default`` -- the
embedded default task's model (character vocabulary, hidden 64, 4 layers, 4 heads; 16
prompts x G=8, 20-token prompts + 6 tokens). Every implementation samples exactly L tokens
per completion at temperature 1 without top-k (top-p with ``--top-p``): the samplers with per-prompt seeds
(the trainer's path: inverse CDF), ``generate`` on G copies of each prompt (a standard
``DynamicCache``). Interleaved rounds (the order rotates each round), one intra-op thread,
best of the rounds, wall and process CPU seconds (the CPU-time ratios hold up on a shared
machine); the JSON goes to ``benchmarks/results/``.

    taskset -c 1 python benchmarks/bench_rollout_vs_generate.py --rounds 3 --previous 6b76727
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl.bench.harness import environment, write_payload  # noqa: E402
from fastrl.bench.rollout_cases import load_sampler_from_git, qwen2_bench_model, random_prompt  # noqa: E402
from fastrl.rollout import HFGroupSampler, SamplingConfig  # noqa: E402


def default_task_model():
    from fastrl.train.task import char_tokenizer, tiny_model

    tok = char_tokenizer()
    model = tiny_model(tok, hidden_size=64, layers=4, heads=4, max_position_embeddings=32).eval()
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    return model


SHAPES = {
    "real": dict(build=lambda: qwen2_bench_model(), prompts=2, G=8, P=256, L=128),
    "default": dict(build=default_task_model, prompts=16, G=8, P=20, L=6),
}


def impls(model, prompts, G, L, previous, top_p=1.0):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=L, top_p=top_p)
    seeds = list(range(len(prompts)))
    out = {"fastrl": (lambda s=HFGroupSampler(model): s.generate(prompts, group_size=G, sampling=cfg, prompt_seeds=seeds))}
    if previous is not None:
        old = previous(model)
        out["previous"] = lambda: old.generate(prompts, group_size=G, sampling=cfg, prompt_seeds=seeds)
    ids = torch.tensor(prompts).repeat_interleave(G, dim=0)

    def gen():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=L,
                              min_new_tokens=L, temperature=1.0, top_k=0, top_p=top_p, pad_token_id=0)

    out["hf_generate"] = gen
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="real,default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small-rounds-factor", type=int, default=30, help="the default shape (milliseconds a call) runs this many times more rounds")
    ap.add_argument("--previous", default=None, help="git revision of the previous sampler to compare (e.g. 8697f94)")
    ap.add_argument("--L", type=int, default=None, help="override the completion length")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling in every implementation (default off)")
    ap.add_argument("--init-std", type=float, default=None,
                    help="re-initialise the matrices with N(0, std) (e.g. 0.3: peaked distributions; default: the config's init, near-flat)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    previous = load_sampler_from_git(args.previous, tag="previous") if args.previous else None
    results = []
    for name in args.shapes.split(","):
        shape = dict(SHAPES[name])
        if args.L:
            shape["L"] = args.L
        model = shape["build"]()
        if args.init_std is not None:
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.copy_(torch.randn(p.shape, generator=g) * args.init_std)
        V = model.config.vocab_size
        prompts = [random_prompt(shape["P"], V, seed=i) for i in range(shape["prompts"])]
        fns = impls(model, prompts, shape["G"], shape["L"], previous, args.top_p)
        with torch.no_grad():
            for fn in fns.values():  # warm-up
                fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        cpu: dict[str, list[float]] = {k: [] for k in fns}
        keys = list(fns)
        rounds = args.rounds if name == "real" else args.rounds * args.small_rounds_factor
        for r in range(rounds):
            for k in keys[r % len(keys):] + keys[: r % len(keys)]:
                t0, c0 = time.perf_counter(), time.process_time()
                with torch.no_grad():
                    fns[k]()
                times[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
        tokens = shape["prompts"] * shape["G"] * shape["L"]
        best = {k: min(v) for k, v in times.items()}
        best_cpu = {k: min(v) for k, v in cpu.items()}
        row = {
            "shape": name, "top_p": args.top_p, "init_std": args.init_std, "prompts": shape["prompts"], "G": shape["G"], "P": shape["P"], "L": shape["L"],
            "model": {"arch": type(model).__name__, "vocab": V, "hidden": model.config.hidden_size,
                      "layers": model.config.num_hidden_layers, "heads": model.config.num_attention_heads,
                      "kv_heads": model.config.num_key_value_heads, "intermediate": model.config.intermediate_size},
            "rounds": rounds, "seconds": times, "best_seconds": best, "cpu_seconds": cpu, "best_cpu_seconds": best_cpu,
            "tokens_per_s": {k: tokens / v for k, v in best.items()},
            "speed_vs_hf_generate": {k: best["hf_generate"] / v for k, v in best.items()},
            "cpu_tokens_per_s": {k: tokens / v for k, v in best_cpu.items()},
            "cpu_speed_vs_hf_generate": {k: best_cpu["hf_generate"] / v for k, v in best_cpu.items()},
        }
        if "previous" in best:
            row["speed_vs_previous"] = best["previous"] / best["fastrl"]
            row["cpu_speed_vs_previous"] = best_cpu["previous"] / best_cpu["fastrl"]
        results.append(row)
        print(json.dumps({k: row.get(k) for k in ("shape", "speed_vs_hf_generate", "cpu_speed_vs_hf_generate", "speed_vs_previous", "cpu_speed_vs_previous")}), flush=True)
    payload = {
        "benchmark": "rollout_hf_sampler_vs_generate",
        "command": "python benchmarks/bench_rollout_vs_generate.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(torch.device("cpu")),
        "threads": 1,
        "note": "interleaved rounds, best of rounds, one intra-op thread, pinned with taskset to one core; wall seconds and process CPU "
                "seconds. The 2-core machine may be shared with other jobs (load averages at start and end recorded): wall times include waiting for a core, "
                "so the CPU-time ratios are the reliable ones (memory-bandwidth contention still inflates both)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_start_end": [load_start, os.getloadavg()],
        "rows": results,
    }
    write_payload(payload, args.out, stem="rollout-vs-generate-cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
