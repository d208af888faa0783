"""Step-wise samples of an 8-turn trajectory at a real shape (GPU): padded vs prefix-tree packed.

The case of ``benchmarks/bench_tree_stepwise.py`` (its trajectories, renderings and modes:
``single`` = the trajectory once, ``tree`` = the trie of the 8 step-wise samples,
``grouped`` = one document per group, ``padded`` = the samples as padded rows) on a
randomly initialised Qwen2.5-1.5B-shaped model in bf16 with per-layer activation
checkpointing, through the trainer's layouts (attention ``auto``: the Triton tree and
shared-prefix kernels for ``tree``/``grouped``, the model's SDPA for padded rows). One
GRPO loss forward + backward per step. Per mode, in one process, one after another (the
model rebuilt each time): tokens the forward runs, best-of-n step seconds (CUDA
synchronised), ``torch.cuda.max_memory_allocated`` above the allocation after setup, and
the largest relative gradient difference of ``tree``/``grouped`` against ``padded``.
FLOPs are counted by the CPU benchmark (FlopCounterMode does not see Triton kernels).

    python benchmarks/gpu/bench_stepwise_tree_gpu.py --out "$OUT/tree_stepwise_gpu.json"
    python benchmarks/gpu/bench_stepwise_tree_gpu.py --dry-run     # CPU, tiny model and shapes
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for _p in (ROOT, os.path.join(ROOT, "benchmarks"), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_long_grpo import QWEN25_1P5B, TINY, environment  # noqa: E402
from bench_tree_stepwise import MODES, TEMPLATES, build_experience  # noqa: E402

REAL = dict(prompt_len=1024, turns=8, think_len=768, answer_len=256, env_len=512)
DRY = dict(prompt_len=16, turns=8, think_len=8, answer_len=4, env_len=6)


def measure(mode: str, *, template: str, shape: dict, config: dict, device: str, dtype: str, checkpointing: bool,
            repeats: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One mode: its figures and its parameter gradients (fp32, on the CPU)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastrl.config import PolicyLossConfig
    from fastrl.ops.policy_loss import policy_loss

    dev = torch.device(device)
    exp, layout_cls = build_experience(mode, template=template, vocab=config["vocab_size"], device=device, **shape)
    cfg = Qwen2Config(**config, max_position_embeddings=exp.batch.input_ids.shape[1] + 8, use_sliding_window=False,
                      attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with dev:
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layout = layout_cls(token_budget=10**9, device=dev, temperature=1.0)
    (mb,) = layout.micro_batches(exp)
    loss_cfg = PolicyLossConfig.preset("grpo", kl_coef=0.0)
    take = lambda x: layout.gather(mb, x)
    with torch.no_grad(), layout.attention(mb, [model]):
        old = layout.logprobs(model, mb, entropy=False)[0]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with layout.attention(mb, [model]):  # around the backward too: checkpointed layers recompute there
            logp, _ = layout.logprobs(model, mb, entropy=False)
            loss, _ = policy_loss(logp, old, take(exp.advantages), take(exp.loss_mask), config=loss_cfg,
                                  global_counts=exp.counts(mb.rows), cu_seqlens=layout.cu_seqlens(mb))
            loss.backward()

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    step()  # warm-up (Triton compiles)
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    sync()
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    row: dict[str, Any] = {"tokens": layout.cost(exp, [0]), "times_s": times, "min_time_s": min(times)}
    if dev.type == "cuda":
        row["peak_extra_mib"] = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
    del model, layout, mb, old, exp
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row, grads


def rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for name in b:
        scale = float(b[name].abs().max())
        worst = max(worst, float((a[name] - b[name]).abs().max()) / (scale if scale > 0 else 1.0))
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model and trajectory (checks the script runs)")
    p.add_argument("--templates", default=",".join(TEMPLATES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    device, dtype = ("cpu", "float32") if args.dry_run else ("cuda", "bfloat16")
    config, shape = (TINY, DRY) if args.dry_run else (QWEN25_1P5B, REAL)
    default_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), "results")
    out = args.out or os.path.join(default_dir, f"tree_stepwise_{'dryrun_cpu' if args.dry_run else 'gpu'}.json")
    results = []

    def write() -> dict[str, Any]:
        record = {
            "benchmark": "8-turn trajectory as step-wise samples, GRPO loss forward + backward through fastrl.train.layout: "
                         "single sequence / prefix tree / group-packed / padded",
            "command": "python benchmarks/gpu/bench_stepwise_tree_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
            **environment(device),
            "dry_run": args.dry_run,
            "shapes": {"config": "tiny" if args.dry_run else "qwen2.5-1.5b", **config, "dtype": dtype, **shape,
                       "activation_checkpointing": not args.no_checkpointing},
            "time": f"best of {args.repeats} steps after a warm-up",
            "memory": "torch.cuda.max_memory_allocated above the allocation after the warm-up step" if device == "cuda"
                      else "not measured on the CPU dry run",
            "results": results,
        }
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
        return record

    for template in [t for t in args.templates.split(",") if t]:
        if template not in TEMPLATES:
            raise SystemExit(f"--templates: {template!r} is not one of {TEMPLATES}")
        row: dict[str, Any] = {"template": template}
        grads = {}
        for mode in MODES:
            try:
                row[mode], grads[mode] = measure(mode, template=template, shape=shape, config=config, device=device, dtype=dtype,
                                                 checkpointing=not args.no_checkpointing, repeats=args.repeats)
            except Exception as e:  # an OOM of the padded form is a result, not a crash
                row[mode] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  [{template}] {mode:8s} {row[mode]}", flush=True)
        for mode in ("tree", "grouped"):
            if mode in grads and "padded" in grads:
                row[mode]["grad_max_rel_diff_vs_padded"] = rel_diff(grads[mode], grads["padded"])
        if "min_time_s" in row["single"]:
            row["time_vs_single"] = {m: row[m]["min_time_s"] / row["single"]["min_time_s"] for m in MODES if "min_time_s" in row[m]}
        results.append(row)
        write()
    record = write()
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
