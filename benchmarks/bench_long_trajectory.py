"""One GRPO training step (policy forward + backward + loss) vs trajectory length, CPU.

Three implementations, each measured in a fresh Python process
(``fastrl.bench.memory.measure_in_subprocess``: peak RSS above the post-setup baseline,
best-of-n time) on a small Qwen2 with a real vocabulary (random init from a config):

- ``fastrl``: the group packed as ``[prompt | c_1 .. c_G]`` (shared-prefix attention,
  ``fastrl.ops.hf_packed.packed_causal_lm_policy_loss``: fused LM-head log-prob + GRPO
  loss, no ``[tokens, vocab]`` logits) with per-layer activation checkpointing
  (non-reentrant; the shared-prefix attention stays switched on through the backward,
  where the checkpointed layers recompute their forward);
- ``naive``: the usual repeated-prefix ``[G, P + L]`` batch, full logits, ``log_softmax``,
  gather, GRPO loss; no checkpointing;
- ``trl``: TRL's own ``GRPOTrainer.compute_loss`` (``_get_per_token_logps_and_entropies``
  through TRL's fused LM head) on the same ``[G, P + L]`` batch, the trainer built with
  ``GRPOConfig`` defaults (which turn gradient checkpointing on).

"Trajectory tokens" of a group = ``G * (P + L)``: the summed length of its G
trajectories (prompt + completion each), i.e. the tokens a repeated-prefix trainer runs.
The same x value is used for every implementation; fastrl runs ``P + G * L`` of them
(the prompt once). The sweep doubles it from 1K to 32K with ``P = prompt_frac * (P + L)``.

Every child runs under an address-space limit (RLIMIT_AS, ``--mem-cap-gb``): an
allocation past it fails inside the child (reported as out of memory) instead of waking the
machine's OOM killer. An implementation stops at its first failed length. Children run one
at a time. glibc is told to serve every allocation >= 128 KiB by mmap
(``MALLOC_MMAP_THRESHOLD_``) so freed memory leaves the RSS and the RSS peak is the
program's.

    OMP_NUM_THREADS=2 python benchmarks/bench_long_trajectory.py            # 1K .. 32K
    OMP_NUM_THREADS=2 python benchmarks/bench_long_trajectory.py --quick    # tiny, ~1 min
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
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

IMPLS = ("fastrl", "naive", "trl")
CHILD_ENV = {"PYTHONPATH": HERE, "MALLOC_MMAP_THRESHOLD_": "131072"}


# --------------------------------------------------------------------------- model & data


def build_model(*, hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, max_positions: int, seed: int = 0):
    """A randomly initialised Qwen2 causal LM in fp32 (nothing downloaded)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=False, use_sliding_window=False, attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(config).float()
    model.train()
    return model


def make_group(*, prompt_len: int, completion_len: int, group_size: int, vocab: int, seed: int = 0):
    """Random token ids of one group (every completion full length) and per-sample advantages."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=g)
    completions = torch.randint(3, vocab, (group_size, completion_len), generator=g)
    advantages = torch.randn(group_size, generator=g)
    return prompt, completions, advantages


def grpo_loss_from_logp(logp, old_logp, advantages, mask, *, clip: float = 0.2):
    """Plain GRPO (PPO-clip, no KL, seq-mean-token-mean) from per-token log-probs [B, L]."""
    import torch

    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    m = mask.float()
    return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()


def _tiny_tokenizer():
    """A word-level tokenizer with a handful of tokens: TRL's trainer wants a processing class;
    the loss step never tokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


# --------------------------------------------------------------------------- step builders
# Each returns a zero-argument callable running one step (grads cleared first), for
# fastrl.bench.memory.measure_here. Setup (model, inputs, old log-probs) is not measured.


def build_step(
    *,
    impl: str,
    prompt_len: int,
    completion_len: int,
    group_size: int = 8,
    hidden: int = 256,
    layers: int = 4,
    vocab: int = 151936,
    heads: int = 4,
    kv_heads: int = 2,
    threads: int = 2,
    checkpointing: bool | None = None,
    grads_out: str | None = None,
    info_out: str | None = None,
) -> Callable[[], None]:
    """``impl`` in ``IMPLS`` (see the module docstring). ``checkpointing=None`` takes each
    implementation's default (fastrl and trl on, naive off). ``grads_out``: after the first
    call, the parameter gradients are saved there (``torch.save`` of a name -> tensor dict).
    ``info_out``: a JSON file for what the setup found (checkpointing on, packed tokens)."""
    import gc

    import torch

    torch.set_num_threads(threads)
    P, L, G = prompt_len, completion_len, group_size
    model = build_model(hidden=hidden, layers=layers, vocab=vocab, heads=heads, kv_heads=kv_heads, max_positions=P + L + 8)
    prompt, completions, advantages = make_group(prompt_len=P, completion_len=L, group_size=G, vocab=vocab)
    info: dict[str, Any] = {"impl": impl}

    if impl == "fastrl":
        from fastrl.config import PolicyLossConfig
        from fastrl.ops.hf_packed import packed_causal_lm_logprobs, packed_causal_lm_policy_loss, shared_prefix_attention_enabled
        from fastrl.ops.shared_prefix_attention import PackedGroups

        if checkpointing is None or checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        packed = PackedGroups.from_groups([(prompt.tolist(), completions.tolist())])
        cfg = PolicyLossConfig.preset("grpo", kl_coef=0.0)
        with torch.no_grad():  # the old-policy pass a trainer runs before the update (not measured)
            old = packed.to_completion_layout(packed_causal_lm_logprobs(model, packed))
        info["packed_tokens"] = packed.layout.num_tokens

        def step() -> None:
            model.zero_grad(set_to_none=True)
            # entered around the backward too: checkpointed layers recompute their forward there
            with shared_prefix_attention_enabled(model):
                loss, _ = packed_causal_lm_policy_loss(model, packed, old, advantages, config=cfg)
                loss.backward()

    elif impl == "naive":
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        input_ids = torch.cat([prompt[None].expand(G, P), completions], dim=1)
        mask = torch.ones(G, L, dtype=torch.bool)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            logits = model(input_ids=input_ids, use_cache=False).logits  # [G, P + L, V]
            logp = torch.log_softmax(logits[:, P - 1 : -1].float(), dim=-1).gather(-1, completions[..., None]).squeeze(-1)
            grpo_loss_from_logp(logp, logp.detach(), advantages, mask).backward()

    elif impl == "trl":
        import warnings

        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        kwargs: dict[str, Any] = {}
        if checkpointing is not None:
            kwargs["gradient_checkpointing"] = checkpointing
        args = GRPOConfig(
            output_dir=tempfile.mkdtemp(prefix="fastrl_bench_trl_"), per_device_train_batch_size=G, num_generations=G,
            max_completion_length=L, loss_type="grpo", beta=0.0, report_to="none", use_cpu=True, bf16=False,
            save_strategy="no", disable_tqdm=True, seed=0, **kwargs,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = GRPOTrainer(
                model=model, reward_funcs=_reward, args=args, processing_class=_tiny_tokenizer(),
                train_dataset=Dataset.from_dict({"prompt": ["a"] * G}),
            )
        model = trainer.model
        if args.gradient_checkpointing and not getattr(model, "is_gradient_checkpointing", False):
            # transformers.Trainer turns it on when training starts; do what it does
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = {
            "prompt_ids": prompt[None].expand(G, P).contiguous(),
            "prompt_mask": torch.ones(G, P, dtype=torch.long),
            "completion_ids": completions,
            "completion_mask": torch.ones(G, L, dtype=torch.long),
            "advantages": advantages,
            "old_per_token_logps": None,  # TRL then uses the detached current log-probs (ratio 1)
            "num_items_in_batch": torch.tensor(float(G * L)),
        }
        info["trl_gradient_checkpointing"] = bool(getattr(model, "is_gradient_checkpointing", False))
        info["trl_gradient_checkpointing_kwargs"] = args.gradient_checkpointing_kwargs

        def step() -> None:
            model.zero_grad(set_to_none=True)
            trainer.compute_loss(model, inputs).backward()

    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")

    info["checkpointing"] = bool(getattr(model, "is_gradient_checkpointing", False))
    calls = [0]

    def run() -> None:
        step()
        calls[0] += 1
        if grads_out is not None and calls[0] == 1:
            torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, grads_out)

    gc.collect()
    run.device = torch.device("cpu")
    run.info = info
    if info_out is not None:
        with open(info_out, "w") as f:
            json.dump(info, f)
    return run


# --------------------------------------------------------------------------- driver


def measure(kwargs: dict[str, Any], *, repeats: int, mem_cap_gb: float, timeout_s: float | None, threads: int) -> dict[str, Any]:
    from fastrl.bench.memory import measure_in_subprocess

    env = dict(CHILD_ENV, OMP_NUM_THREADS=str(threads))
    return measure_in_subprocess(
        "bench_long_trajectory:build_step", kwargs, repeats=repeats, timeout_s=timeout_s, mem_limit_gb=mem_cap_gb, env=env
    )


def fit_slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of peak bytes vs trajectory tokens (bytes per token)."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def environment(threads: int) -> dict[str, Any]:
    import torch
    import transformers
    import trl

    return {
        "device": "cpu",
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "trl": trl.__version__},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke test)")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--tokens", default=None, help="comma-separated trajectory-token counts (default 1024..32768 doubling)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-frac", type=float, default=0.5, help="P / (P + L)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--repeats", type=int, default=2, help="steps per child (best-of); 1 above --repeat-until tokens")
    p.add_argument("--repeat-until", type=int, default=8192)
    p.add_argument("--mem-cap-gb", type=float, default=20.0, help="address-space limit of each child")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    p.add_argument("--merge-from", default=None, help="also take the results of this earlier JSON (same shapes)")
    p.add_argument("--append", action="store_true",
                   help="merge into --out's earlier results (same shapes): a point measured again replaces the old one")
    args = p.parse_args(argv)
    out = args.out or os.path.join(HERE, "results", f"long_trajectory_cpu{'_quick' if args.quick else ''}.json")

    hidden = args.hidden or (32 if args.quick else 256)
    vocab = args.vocab or (1024 if args.quick else 151936)
    tokens = [int(t) for t in args.tokens.split(",") if t] if args.tokens is not None else ([256, 512] if args.quick else [1024 * 2**i for i in range(6)])
    impls = [i for i in args.impls.split(",") if i]
    G = args.group_size
    model_shape = dict(hidden=hidden, layers=args.layers, vocab=vocab, heads=4, kv_heads=2)
    rows: list[dict[str, Any]] = []
    for path in ([out] if args.append and os.path.exists(out) else []) + ([args.merge_from] if args.merge_from else []):
        with open(path) as f:
            previous = json.load(f)
        if (previous["shapes"]["hidden"], previous["shapes"]["vocab"], previous["shapes"]["group_size"],
                previous["shapes"]["prompt_frac"]) != (hidden, vocab, G, args.prompt_frac):
            raise SystemExit(f"{path} has other shapes")
        keys = {(r["impl"], r["trajectory_tokens"]) for r in previous["results"]}
        rows = [r for r in rows if (r["impl"], r["trajectory_tokens"]) not in keys] + previous["results"]
    def write() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
        """Summarise and write the JSON (after every point: a long sweep keeps what it measured)."""
        nonlocal rows
        stopped: dict[str, str] = {}
        rows.sort(key=lambda r: (r["trajectory_tokens"], IMPLS.index(r["impl"])))
        all_tokens = sorted({r["trajectory_tokens"] for r in rows})
        for r in rows:  # an implementation's first failure ends its sweep
            if not r["ok"]:
                stopped.setdefault(r["impl"], f"{'out of memory' if r.get('oom') else 'failed'} at {r['trajectory_tokens']} tokens: {r['error']}")
        summary = {}
        for impl in sorted({r["impl"] for r in rows}, key=IMPLS.index):
            ok = [r for r in rows if r["impl"] == impl and r["ok"]]
            slope = fit_slope([(r["trajectory_tokens"], r["peak_extra_mib"] * 2**20) for r in ok])
            summary[impl] = {
                "max_trajectory_tokens": max((r["trajectory_tokens"] for r in ok), default=0),
                "memory_slope_bytes_per_token": slope,
                "stopped": stopped.get(impl),
                "points_in_fit": len(ok),
            }
        ratios = {}
        if "fastrl" in summary and "naive" in summary and summary["naive"]["memory_slope_bytes_per_token"]:
            fs, ns = summary["fastrl"]["memory_slope_bytes_per_token"], summary["naive"]["memory_slope_bytes_per_token"]
            if fs is not None:
                ratios["slope_naive_over_fastrl"] = ns / fs
        if "fastrl" in summary and "trl" in summary and summary["trl"]["memory_slope_bytes_per_token"]:
            fs, ts = summary["fastrl"]["memory_slope_bytes_per_token"], summary["trl"]["memory_slope_bytes_per_token"]
            if fs is not None:
                ratios["slope_trl_over_fastrl"] = ts / fs

        record = {
            "benchmark": "GRPO training step (policy forward + backward + loss) vs trajectory tokens",
            "definition": "trajectory tokens = G * (P + L): the summed length of the group's G trajectories; "
                          "fastrl packs P + G * L of them (prompt once)",
            **environment(args.threads),
            "quick": args.quick,
            "shapes": {"model": "Qwen2 (random init, fp32)", **model_shape, "intermediate": 4 * hidden,
                       "group_size": G, "prompt_frac": args.prompt_frac, "trajectory_tokens": all_tokens},
            "memory": "peak RSS above the post-setup baseline, fresh process per point (fastrl.bench.memory), "
                      f"RLIMIT_AS cap {args.mem_cap_gb} GiB, MALLOC_MMAP_THRESHOLD_=131072",
            "time": f"best of the child's repeats (up to {args.repeats}; 1 above {args.repeat_until} tokens)",
            "results": rows,
            "summary": summary,
            "ratios": ratios,
        }
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(record, f, indent=2)
        return record, summary, ratios, rows

    stopped: dict[str, str] = {}
    tmp = tempfile.mkdtemp(prefix="fastrl_long_traj_")
    for T in tokens:
        if T % G:
            raise SystemExit(f"trajectory tokens {T} is not a multiple of G={G}")
        per = T // G
        P = max(1, round(per * args.prompt_frac))
        L = per - P
        for impl in impls:
            if impl in stopped:
                continue
            kwargs = dict(impl=impl, prompt_len=P, completion_len=L, group_size=G, threads=args.threads, **model_shape)
            repeats = args.repeats if T <= args.repeat_until else 1
            info_path = os.path.join(tmp, f"{impl}_{T}.json")
            kwargs["info_out"] = info_path
            t0 = time.perf_counter()
            r = measure(kwargs, repeats=repeats, mem_cap_gb=args.mem_cap_gb, timeout_s=args.timeout_s, threads=args.threads)
            row = {"impl": impl, "trajectory_tokens": T, "prompt_len": P, "completion_len": L, "group_size": G,
                   "repeats": repeats, "wall_s": time.perf_counter() - t0}
            if os.path.exists(info_path):
                with open(info_path) as f:
                    row["setup"] = json.load(f)
            if "error" in r:
                row.update(ok=False, error=r["error"], oom=bool(r.get("oom")))
                stopped[impl] = f"{'out of memory' if r.get('oom') else 'failed'} at {T} tokens: {r['error']}"
            else:
                row.update(ok=True, peak_extra_mib=r["peak_extra_mb"], step_s=r["min_time_s"], times_s=r["times_s"],
                           tokens_per_s=T / r["min_time_s"], memory_method=r["method"])
            rows = [x for x in rows if (x["impl"], x["trajectory_tokens"]) != (impl, T)] + [row]
            write()
            status = (f"{row['peak_extra_mib']:9.1f} MiB {row['step_s']:8.2f} s" if row["ok"] else f"FAILED ({row['error'][:80]})")
            print(f"  {impl:7s} T={T:6d} (P={P}, L={L}): {status}", flush=True)

    record, summary, ratios, rows = write()

    print(f"\n{'impl':7s} {'tokens':>7s} {'peak MiB':>10s} {'step s':>8s} {'tok/s':>8s}")
    for r in rows:
        if r["ok"]:
            print(f"{r['impl']:7s} {r['trajectory_tokens']:7d} {r['peak_extra_mib']:10.1f} {r['step_s']:8.2f} {r['tokens_per_s']:8.0f}")
        else:
            print(f"{r['impl']:7s} {r['trajectory_tokens']:7d} {'OOM' if r['oom'] else 'FAIL':>10s}")
    for impl, s in summary.items():
        slope = s["memory_slope_bytes_per_token"]
        print(f"{impl:7s} slope {slope / 1024 if slope is not None else float('nan'):9.1f} KiB/token, "
              f"max {s['max_trajectory_tokens']} tokens" + (f"; stopped: {s['stopped'][:100]}" if s["stopped"] else ""))
    print(json.dumps(ratios))
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
