"""HFGroupSampler's decode modes vs HF ``generate`` (and vLLM where installed) on the device
(issue 20, section 1: the static-shape decode step captured in a CUDA graph).

Shape: issue 20's real shape (a seeded random Qwen2, vocabulary 151,936, hidden 256, 4 layers,
2 prompts x G=8, prompt 256 + 128 new tokens), timed in bf16 on CUDA. Each implementation is
timed only after its check passed: greedy completions of every decode mode equal
``decode='eager'`` token for token and equal HF ``generate`` on G copies of each prompt. The
check runs the same weights in fp32: in bf16 a random model's near-flat logits make every
implementation's greedy path diverge somewhere (the first H200 run, checking in bf16: no
completion of eager, static or CUDA-graph decode equalled ``generate``'s, so only eager and
``generate`` were timed); the share of equal completions is recorded. Then sampled rollouts
(temperature 1, per-prompt seeds) are timed in bf16: best of ``--repeats`` after a warm-up,
CUDA synchronised around each call.
The JSON is rewritten after every case, so a timeout keeps what finished.

Why the first run's static and CUDA-graph modes failed (``benchmarks/results/gpu_h200_20261204``):
on CUDA the eager step ran attention through the Triton cascade kernels and the static step
(the one a graph captures) through the PyTorch attention over the whole suffix capacity; in
bf16 their roundings differ, and on a random model's near-flat logits greedy paths split.
The static step now runs the eager step's kernels (lengths from the device), so the modes
compute the same numbers. If a mode's completions still differ, the check records where
(``divergence``): the first differing (row, step), the largest log-prob difference before it,
and the top-2 logit gap of the eager path at that step from a teacher-forced fp32 forward --
a gap within rounding (``NEAR_TIE``) says rounding at a near-tie, a wide gap or log-probs
that drifted before it say the step computes something else.

    python benchmarks/gpu/bench_sampler.py --out $OUT/sampler_gpu.json            # on the device
    python benchmarks/gpu/bench_sampler.py --dry-run --out /tmp/sampler_cpu.json  # CPU: tiny shape, checks only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fastrl.bench.rollout_cases import qwen2_bench_model, random_prompt  # noqa: E402
from fastrl.rollout import HFGroupSampler, SamplingConfig  # noqa: E402

REAL = dict(vocab=151_936, hidden=256, layers=4, prompts=2, G=8, P=256, L=128)
DRY = dict(vocab=512, hidden=64, layers=2, prompts=2, G=4, P=16, L=8)
CHECK_DTYPE = torch.float32
"""The greedy checks' dtype (the timings' is bf16 on CUDA)."""
NEAR_TIE = 1e-3
"""A top-2 logit gap (fp32 forward) below this is a near-tie: rounding can flip a greedy pick there."""


def divergence(model, prompts: list[list[int]], G: int, ref, got) -> dict | None:
    """Where two greedy rollouts of the same prompts first differ, and whether that step is a near-tie."""
    first = None
    for b, (x, y) in enumerate(zip(ref.completion_ids, got.completion_ids)):
        t = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None if len(x) == len(y) else min(len(x), len(y)))
        if t is not None and (first is None or t < first[1]):
            first = (b, t)
    if first is None:
        return None
    b, t = first
    before = [float((ref.completion_logp[r][:t] - got.completion_logp[r][:t]).abs().max()) if t else 0.0
              for r in range(len(ref.completion_ids))]
    ids = torch.tensor([prompts[b // G] + ref.completion_ids[b][:t]], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    gap = float(top[0] - top[1])
    return {"row": b, "step": t, "eager_token": ref.completion_ids[b][t] if t < len(ref.completion_ids[b]) else None,
            "mode_token": got.completion_ids[b][t] if t < len(got.completion_ids[b]) else None,
            "max_logp_diff_before": max(before), "top2_logit_gap_fp32": gap,
            "cause": "rounding at a near-tie" if gap < NEAR_TIE else "the modes compute different logits (not a near-tie)"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (CUDA graphs are captured per rollout, so the capture is in every timed call)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, modes eager and static: checks only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    shape = DRY if args.dry_run else REAL
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    modes = ["eager", "static"] + (["cuda_graph"] if device.type == "cuda" else [])
    torch.backends.cuda.matmul.allow_tf32 = False  # the check's fp32 is fp32
    model = qwen2_bench_model(vocab=shape["vocab"], hidden=shape["hidden"], layers=shape["layers"]).to(device=device, dtype=CHECK_DTYPE)
    G, L = shape["G"], shape["L"]
    prompts = [random_prompt(shape["P"], shape["vocab"], seed=i) for i in range(shape["prompts"])]
    seeds = list(range(len(prompts)))
    out: dict = {"benchmark": "sampler_decode_modes_gpu", "command": "python benchmarks/gpu/bench_sampler.py " + " ".join(argv or sys.argv[1:]),
                 "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": str(dtype),
                 "check_dtype": str(CHECK_DTYPE), "shape": shape,
                 "checks": {}, "seconds": {}, "tokens_per_s": {}, "speed_vs_hf_generate": {}}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")

    ids = torch.tensor(prompts, device=device).repeat_interleave(G, dim=0)
    with torch.no_grad():
        hf_greedy = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=L,
                                   min_new_tokens=L, pad_token_id=0)[:, shape["P"]:].tolist()
    samplers = {m: HFGroupSampler(model, decode=m) for m in modes}
    greedy = SamplingConfig(greedy=True, max_new_tokens=L)
    ok: dict[str, bool] = {}
    ref = None
    for m, s in samplers.items():
        batch = s.generate(prompts, group_size=G, sampling=greedy)
        got = batch.completion_ids
        ref = batch if ref is None else ref
        ok[m] = got == ref.completion_ids
        out["checks"][m] = {"equals_eager": ok[m], "share_equal_to_hf_generate": sum(a == b for a, b in zip(got, hf_greedy)) / len(got)}
        if not ok[m]:
            out["checks"][m]["divergence"] = divergence(model, prompts, G, ref, batch)
        save()
    print(json.dumps(out["checks"]), flush=True)
    if args.dry_run:
        save()
        return 0 if all(ok.values()) else 1
    model.to(dtype)
    samplers = {m: HFGroupSampler(model, decode=m) for m in modes}
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=L)
    tokens = len(prompts) * G * L

    def gen():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=L,
                              min_new_tokens=L, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)

    with torch.no_grad():
        cases = {"hf_generate": gen}
        cases.update({f"fastrl_{m}": (lambda s=s: s.generate(prompts, group_size=G, sampling=cfg, prompt_seeds=seeds))
                      for m, s in samplers.items() if ok[m]})
        for name, fn in cases.items():
            out["seconds"][name] = _best(fn, device, args.repeats)
            out["tokens_per_s"][name] = tokens / out["seconds"][name]
            out["speed_vs_hf_generate"] = {k: out["seconds"]["hf_generate"] / v for k, v in out["seconds"].items()}
            save()
            print(name, round(out["seconds"][name], 4), flush=True)
    if not args.no_vllm:
        try:
            import vllm  # noqa: F401
        except ImportError:
            out["vllm"] = "not installed"
        else:
            out["vllm"] = _time_vllm(model, prompts, G, L, device, args.repeats)
            if isinstance(out["vllm"], dict):
                out["seconds"]["vllm"] = out["vllm"]["seconds"]
                out["tokens_per_s"]["vllm"] = tokens / out["vllm"]["seconds"]
                out["speed_vs_hf_generate"]["vllm"] = out["seconds"]["hf_generate"] / out["vllm"]["seconds"]
        save()
    print(json.dumps(out["speed_vs_hf_generate"]), flush=True)
    return 0


def _time_vllm(model, prompts, G, L, device, repeats):
    """The same prompts through an in-process vLLM engine built from the same weights."""
    import tempfile

    from fastrl.rollout.vllm import VLLMGroupSampler

    path = Path(tempfile.mkdtemp()) / "bench_qwen2"
    model.save_pretrained(path)
    try:
        sampler = VLLMGroupSampler(path, dtype="bfloat16", max_model_len=len(prompts[0]) + L + 8, gpu_memory_utilization=0.3)
    except Exception as e:  # noqa: BLE001 -- recorded, the other results stand
        return f"engine failed: {type(e).__name__}: {e}"[:500]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=L)
    seconds = _best(lambda: sampler.generate(prompts, group_size=G, sampling=cfg, prompt_seeds=list(range(len(prompts)))), device, repeats)
    sampler.close()
    return {"seconds": seconds}


if __name__ == "__main__":
    sys.exit(main())
