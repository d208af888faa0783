"""Full-parameter GRPO step of a Qwen2.5-1.5B-shaped model at 8K..64K tokens per group (GPU).

One group of G = 8 completions of one prompt; "tokens per group" = ``G * (P + L)`` (the
summed length of the G trajectories, what a repeated-prefix trainer runs), with
``P = prompt_frac * (P + L)``. Each configuration runs in a fresh process
(``fastrl.bench.memory``: ``torch.cuda.max_memory_allocated`` above the allocation after
setup, best-of-n step time) and does: zero grads, fused log-prob + GRPO loss forward,
backward, AdamW step -- on a randomly initialised bf16 model built from the
Qwen2.5-1.5B config (nothing downloaded), per-layer activation checkpointing
(non-reentrant) on.

Configurations per length:

- ``repeated``: shared prefix off: the ``[G, P + L]`` batch through the model's own SDPA
  attention (``fastrl.ops.hf.causal_lm_policy_loss``);
- ``shared:<backend>``: the group packed as ``[prompt | c_1 .. c_G]``
  (``fastrl.ops.hf_packed.packed_causal_lm_policy_loss``) with the shared-prefix attention
  backend ``triton`` (fastrl's kernel), ``flex`` (FlexAttention, compiled), ``sdpa`` (one
  SDPA call with a dense ``[N, N]`` mask) or ``segments`` (per-segment SDPA).

    python benchmarks/gpu/bench_long_grpo.py --out "$OUT/long_grpo_gpu.json"
    python benchmarks/gpu/bench_long_grpo.py --dry-run      # CPU, tiny model and shapes

Targets (issue 9): a 32K-token group trains full-parameter on one H200; the Triton kernel
is at least as fast as FlexAttention on the shared-prefix mask.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Qwen2.5-1.5B (config.json of the released model); the dry run shrinks it
QWEN25_1P5B = dict(
    vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
SHARED_BACKENDS = ("triton", "flex", "sdpa", "segments")


def build_step(
    *,
    config: str,
    mode: str,
    prompt_len: int,
    completion_len: int,
    group_size: int = 8,
    device: str = "cuda",
    dtype: str = "bfloat16",
    checkpointing: bool = True,
    lr: float = 1e-6,
    info_out: str | None = None,
) -> Callable[[], None]:
    """One full-parameter GRPO step (``mode``: ``repeated`` or ``shared:<backend>``)."""
    import gc

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastrl.config import PolicyLossConfig

    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    P, L, G = prompt_len, completion_len, group_size
    shape = QWEN25_1P5B if config == "qwen2.5-1.5b" else TINY
    cfg = Qwen2Config(**shape, max_position_embeddings=max(32768, P + L + 8), use_sliding_window=False, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with dev:
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default_dtype)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (P,), generator=g)
    completions = torch.randint(3, cfg.vocab_size, (G, L), generator=g)
    advantages = torch.randn(G, generator=g).to(dev)
    loss_cfg = PolicyLossConfig.preset("grpo", kl_coef=0.0)
    info: dict[str, Any] = {"mode": mode, "params": sum(p.numel() for p in model.parameters())}

    if mode == "repeated":
        from fastrl.ops.hf import causal_lm_logprobs, causal_lm_policy_loss

        input_ids = torch.cat([prompt[None].expand(G, P), completions], dim=1).to(dev)
        mask = torch.ones(G, L, dtype=torch.bool, device=dev)
        with torch.no_grad():  # old-policy pass (not measured)
            old = causal_lm_logprobs(model, input_ids, None, logits_to_keep=L)
        info["tokens_run"] = G * (P + L)

        def loss_fn() -> torch.Tensor:
            return causal_lm_policy_loss(model, input_ids, None, mask, old, advantages, config=loss_cfg)[0]

        attention = None
    elif mode.startswith("shared:"):
        from fastrl.ops.hf_packed import packed_causal_lm_logprobs, packed_causal_lm_policy_loss, shared_prefix_attention_enabled
        from fastrl.ops.shared_prefix_attention import PackedGroups

        backend = mode.split(":", 1)[1]
        if backend not in SHARED_BACKENDS:
            raise ValueError(f"shared-prefix backend must be one of {SHARED_BACKENDS}, got {backend!r}")
        packed = PackedGroups.from_groups([(prompt.tolist(), completions.tolist())], device=dev)
        with torch.no_grad():
            old = packed.to_completion_layout(packed_causal_lm_logprobs(model, packed, attention_backend=backend))
        info["tokens_run"] = packed.layout.num_tokens

        def loss_fn() -> torch.Tensor:
            return packed_causal_lm_policy_loss(model, packed, old, advantages, config=loss_cfg, attention_backend=backend)[0]

        attention = shared_prefix_attention_enabled
    else:
        raise ValueError(f"mode must be 'repeated' or 'shared:<backend>', got {mode!r}")

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        if attention is None:
            loss_fn().backward()
        else:
            # entered around the backward too: checkpointed layers recompute their forward there
            with attention(model):
                loss_fn().backward()
        optimizer.step()

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        info["setup_allocated_mib"] = torch.cuda.memory_allocated(dev) / 2**20
    if info_out is not None:
        with open(info_out, "w") as f:
            json.dump(info, f)
    run.device = dev
    return run


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {
        "device": device,
        "platform": platform.platform(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
    }
    try:
        import triton

        env["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
        env["versions"]["cuda"] = torch.version.cuda
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fastrl.bench.memory import measure_in_subprocess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model and lengths (checks the script runs)")
    p.add_argument("--tokens", default=None, help="tokens per group, comma-separated (default 8192,16384,32768,65536)")
    p.add_argument("--modes", default=None,
                   help="comma-separated: repeated, shared:triton, shared:flex, shared:sdpa, shared:segments "
                        "(default: repeated and the triton, flex, sdpa backends; dry run: repeated, shared:sdpa, shared:segments)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-frac", type=float, default=0.5, help="P / (P + L)")
    p.add_argument("--repeats", type=int, default=3, help="steps per process (best-of; the first compiles/autotunes)")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per configuration")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/long_grpo_gpu.json, else benchmarks/results/)")
    args = p.parse_args(argv)

    device = "cpu" if args.dry_run else "cuda"
    config = "tiny" if args.dry_run else "qwen2.5-1.5b"
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = [256, 512] if args.dry_run else [8192, 16384, 32768, 65536]
    if args.modes:
        modes = args.modes.split(",")
    else:
        modes = ["repeated", "shared:sdpa", "shared:segments"] if args.dry_run else ["repeated", "shared:triton", "shared:flex", "shared:sdpa"]
    repeats = 1 if args.dry_run and args.repeats == 3 else args.repeats
    G = args.group_size
    default_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), "results")
    out = args.out or os.path.join(default_dir, f"long_grpo_{'dryrun_cpu' if args.dry_run else 'gpu'}.json")
    tmp = tempfile.mkdtemp(prefix="fastrl_long_grpo_")
    env = {"PYTHONPATH": HERE}
    rows: list[dict[str, Any]] = []

    def write() -> dict[str, Any]:
        record = {
            "benchmark": "full-parameter GRPO step (loss forward + backward + AdamW), Qwen2.5-1.5B-shaped, random init",
            "definition": "tokens per group = G * (P + L); the shared-prefix modes run P + G * L of them",
            **environment(device),
            "dry_run": args.dry_run,
            "shapes": {"config": config, **(TINY if args.dry_run else QWEN25_1P5B), "dtype": "bfloat16", "group_size": G,
                       "prompt_frac": args.prompt_frac, "tokens_per_group": tokens,
                       "activation_checkpointing": not args.no_checkpointing},
            "memory": "torch.cuda.max_memory_allocated above the allocation after setup (weights + old log-probs), "
                      "fresh process per configuration; setup_allocated_mib is that allocation"
                      if device == "cuda" else "CPU dry run: peak RSS above the post-setup baseline",
            "time": f"best of {repeats} steps",
            "results": rows,
        }
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
        return record

    for T in tokens:
        if T % G:
            raise SystemExit(f"tokens per group {T} is not a multiple of G={G}")
        per = T // G
        P = max(1, round(per * args.prompt_frac))
        L = per - P
        for mode in modes:
            info_path = os.path.join(tmp, f"{mode.replace(':', '_')}_{T}.json")
            kwargs = dict(config=config, mode=mode, prompt_len=P, completion_len=L, group_size=G, device=device,
                          checkpointing=not args.no_checkpointing, info_out=info_path)
            t0 = time.perf_counter()
            r = measure_in_subprocess("bench_long_grpo:build_step", kwargs, repeats=repeats, timeout_s=args.timeout_s, env=env)
            row: dict[str, Any] = {"mode": mode, "tokens_per_group": T, "prompt_len": P, "completion_len": L,
                                   "group_size": G, "wall_s": time.perf_counter() - t0}
            if os.path.exists(info_path):
                with open(info_path) as f:
                    row["setup"] = json.load(f)
            if "error" in r:
                row.update(ok=False, error=r["error"], oom=bool(r.get("oom")))
            else:
                row.update(ok=True, peak_extra_mib=r["peak_extra_mb"], step_s=r["min_time_s"], times_s=r["times_s"],
                           tokens_per_s=T / r["min_time_s"], memory_method=r["method"])
                if "setup_allocated_mib" in row.get("setup", {}):
                    row["peak_total_mib"] = row["setup"]["setup_allocated_mib"] + r["peak_extra_mb"]
            rows.append(row)
            write()
            msg = (f"peak +{row['peak_extra_mib']:9.1f} MiB {row['step_s']:8.3f} s {row['tokens_per_s']:9.0f} tok/s"
                   if row["ok"] else f"{'OOM' if row['oom'] else 'FAILED'}: {row['error'][:100]}")
            print(f"  T={T:6d} {mode:16s} {msg}", flush=True)

    record = write()
    print(f"\n{'tokens':>7s} {'mode':16s} {'peak+ MiB':>10s} {'total MiB':>10s} {'step s':>8s} {'tok/s':>9s}")
    for r in rows:
        if r["ok"]:
            total = r.get("peak_total_mib")
            print(f"{r['tokens_per_group']:7d} {r['mode']:16s} {r['peak_extra_mib']:10.1f} "
                  f"{total if total is not None else float('nan'):10.1f} {r['step_s']:8.3f} {r['tokens_per_s']:9.0f}")
        else:
            print(f"{r['tokens_per_group']:7d} {r['mode']:16s} {'OOM' if r['oom'] else 'FAILED':>10s}")
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
