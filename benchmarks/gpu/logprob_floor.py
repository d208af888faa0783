"""The FLOP / byte budget of the log-prob loss family and its floor on Hopper, for any
(N, H, V, dtype): what each path must do, the time that predicts, and -- given the JSON of
a GPU run of ``bench_logprob_loss.py`` -- the achieved TFLOP/s and share of the floor.

    python benchmarks/gpu/logprob_floor.py                       # the issue's four shapes, bf16, H200
    python benchmarks/gpu/logprob_floor.py --n 8192 --h 3584 --v 151936 --scored 7168 --gpu h100
    python benchmarks/gpu/logprob_floor.py --results logprob_loss.json

The floor of forward + backward is three N x V x H GEMMs (logits, d/d hidden, d/d weight)
over the scored tokens; of the no-grad pass (old / reference log-probs) one. Everything
else a path does is counted against it:

- ``chunked`` one pass (token-level losses; ``fastrl.ops.fused_policy_loss``): per chunk of
  C tokens the logits GEMM, the stats row pass (reads 4 V bytes a token), the gradient row
  pass (reads 4 V, writes e V: e = 2 for bf16/fp16, in place for fp32), ``g @ W`` and
  ``g.T @ h`` added into the fp32 [V, H] weight gradient (that addmm reads and writes 8 V H
  bytes a chunk). Three GEMMs.
- ``chunked`` two pass (sequence-level ratios, ``linear_logprobs`` alone, vocabulary shards):
  the forward's GEMM + stats pass, then the backward's GEMM again + gradient pass + the two
  gradient GEMMs. Four GEMMs.
- ``chunked`` forward (no grad): one GEMM + the stats pass.
- ``triton`` (the fused kernels of ``csrc_triton/logprobs.py``): five GEMMs, and the fp32
  weight-gradient tile read and written at every K step (``_bwd_weight_kernel``:
  2 * 4 * BV * BK bytes per (token tile, vocab tile, K step)) -- the RMW alone bounds it.
- ``naive`` (materialised logits, fp32 ``log_softmax``): three GEMMs over all N tokens plus
  about ``NAIVE_BYTES_PER_LOGIT`` bytes of elementwise traffic per logit (est.).

Times are predictions: GEMM FLOPs at the measured bf16 GEMM rate plus bytes at the HBM
bandwidth, serialised (no overlap assumed). They are marked predicted wherever they are
printed or written; a GPU run replaces them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

GPUS = {
    # dense bf16 GEMM TFLOP/s as measured (H200: the issue's 790 from the first H200 run;
    # H100 SXM: the same tensor cores, assumed equal -- replace with a measurement), HBM TB/s
    # from the data sheets (H100 SXM 3.35, H200 4.8).
    "h200": {"gemm_tflops": 790.0, "hbm_tbps": 4.8, "sms": 132},
    "h100": {"gemm_tflops": 790.0, "hbm_tbps": 3.35, "sms": 132},
}
ISSUE_SHAPES = [(8192, 1536, 151936), (8192, 3584, 151936), (8192, 4096, 128256), (32768, 1536, 151936)]
SCORED_SHARE = 7 / 8  # the benchmarks mask the last 1/8 of each row (fastrl skips those tokens)
NAIVE_BYTES_PER_LOGIT = 24  # est.: bf16 logits write/read, fp32 log_softmax in/out, its backward and cast
FUSED_TILES = {"BN": 64, "BV": 128, "BK": 64}  # csrc_triton.logprobs.HOPPER_TILES
ELEM = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Launch:
    name: str
    flops: float
    bytes: float
    note: str = ""


def _gemm(n, h, v):
    return 2.0 * n * v * h


def default_chunk(v: int, n: int) -> int:
    """The chunked path's default tokens per chunk (``fastrl.ops.logprobs.chunked_rows``)."""
    try:
        from fastrl.ops.logprobs import chunked_rows
    except Exception:  # the model also runs without fastrl importable
        return max(256, (1280 * 2**20 // (4 * v)) // 256 * 256)
    return chunked_rows(v, n)


def launches(path: str, n: int, h: int, v: int, dtype: str = "bfloat16", *, scored: int | None = None,
             chunk: int | None = None) -> list[Launch]:
    """The launches of ``path`` (``floor``, ``floor_fwd``, ``chunked_one_pass``,
    ``chunked_two_pass``, ``chunked_forward``, ``triton``, ``triton_forward``, ``naive``,
    ``naive_forward``) at N tokens of which ``scored`` are scored, with their FLOPs and bytes
    (bytes: compulsory device-memory traffic outside the GEMMs' own operand reads, plus each
    GEMM's operands and output once)."""
    e = ELEM[dtype]
    ns = n if scored is None else scored
    g = _gemm(ns, h, v)
    op_bytes = (ns * h + v * h) * e  # one GEMM's operands, once
    if path in ("floor", "floor_fwd"):
        k = 3 if path == "floor" else 1
        return [Launch(f"{k} GEMM(s), nothing else", k * g, k * op_bytes)]
    if path.startswith("chunked"):
        c = chunk or default_chunk(v, ns)
        chunks = math.ceil(ns / c)
        stats = Launch("row_stats (reads fp32 logits)", 0, 4.0 * ns * v)
        grad_w = (4.0 + e) * ns * v  # read fp32 logits, write g (fp32 in place or bf16/fp16)
        grad = Launch("row_grad (reads fp32 logits, writes g)", 0, grad_w)
        logits = Launch(f"logits GEMM x{chunks} chunks of {c} (fp32 out)", g, chunks * v * h * e + ns * h * e + 4.0 * ns * v)
        gh = Launch("g @ W", g, chunks * v * h * e + ns * v * e + ns * h * e)
        gw = Launch("g.T @ h into fp32 grad_weight (addmm)", g, ns * v * e + ns * h * e + chunks * 8.0 * v * h)
        if path == "chunked_forward":
            return [logits, stats]
        if path == "chunked_one_pass":
            return [logits, stats, grad, gh, gw]
        if path == "chunked_two_pass":
            relog = Launch("backward: logits GEMM again", g, logits.bytes)
            return [logits, stats, relog, grad, gh, gw]
    if path in ("triton", "triton_forward"):
        t = FUSED_TILES
        pairs = math.ceil(ns / t["BN"]) * math.ceil(v / t["BV"])
        ks = math.ceil(h / t["BK"])
        out = [Launch("_fwd_kernel", g, pairs * ks * (t["BN"] + t["BV"]) * t["BK"] * e, "operand bytes L2->SM")]
        if path == "triton":
            out.append(Launch("_bwd_hidden_kernel (recompute + g@W, fp32 atomics)", 2 * g, pairs * ks * t["BN"] * t["BK"] * 4.0))
            out.append(Launch("_bwd_weight_kernel (recompute + g^T@h, fp32 RMW per K step)", 2 * g,
                              pairs * ks * t["BV"] * t["BK"] * 8.0))
        return out
    if path in ("naive", "naive_forward"):
        gn = _gemm(n, h, v)
        if path == "naive_forward":
            return [Launch("logits GEMM", gn, (n * h + v * h) * e + n * v * e),
                    Launch("fp32 log_softmax + gather (est.)", 0, 10.0 * n * v)]
        return [Launch("3 GEMMs over all N", 3 * gn, 3 * ((n * h + v * h) * e + n * v * e)),
                Launch("elementwise fp32 softmax passes (est.)", 0, NAIVE_BYTES_PER_LOGIT * n * v)]
    raise ValueError(f"unknown path {path!r}")


def predict_ms(ls: list[Launch], gpu: str = "h200") -> float:
    """Serialised prediction: FLOPs at the GEMM rate plus bytes at HBM bandwidth (ms)."""
    spec = GPUS[gpu]
    return sum(lc.flops / (spec["gemm_tflops"] * 1e12) + lc.bytes / (spec["hbm_tbps"] * 1e12) for lc in ls) * 1e3


def floor_ms(n, h, v, *, scored=None, gpu="h200", forward_only=False) -> float:
    """The floor: 3 GEMMs (1 for the no-grad pass) of the scored tokens at the GEMM rate."""
    ns = n if scored is None else scored
    k = 1 if forward_only else 3
    return k * _gemm(ns, h, v) / (GPUS[gpu]["gemm_tflops"] * 1e12) * 1e3


def peak_extra_bytes(path: str, n: int, h: int, v: int, dtype: str = "bfloat16", *, scored=None, chunk=None) -> float:
    """Predicted peak memory above the inputs (the returned gradients included)."""
    e = ELEM[dtype]
    ns = n if scored is None else scored
    grads = (n * h + v * h) * e
    if path.startswith("chunked"):
        c = min(chunk or default_chunk(v, ns), ns)
        work = 4.0 * c * v + (0 if e == 4 else e * c * v)
        if path == "chunked_forward":
            return 4.0 * c * v
        acc = 4.0 * v * h  # the fp32 weight-gradient accumulator
        if path == "chunked_one_pass":
            # chunks: logits + g + accumulator + grad_hidden; then the accumulator rounded to the
            # weight dtype (both alive a moment); backward: the saved gradients and their scaled copies
            return max(work + acc + n * h * e, acc + v * h * e + n * h * e, 2.0 * grads)
        return work + acc + grads
    if path.startswith("naive"):
        return (e + 4 + 4) * n * v + grads
    if path.startswith("triton"):
        return 4.0 * v * h + 4.0 * n * h + grads
    return grads


def table(shapes, dtype="bfloat16", gpu="h200", scored_share=SCORED_SHARE) -> list[dict]:
    rows = []
    for n, h, v in shapes:
        ns = int(round(n * scored_share))
        row = {"N": n, "scored": ns, "H": h, "V": v, "dtype": dtype, "gpu": gpu,
               "floor_ms": _sig(floor_ms(n, h, v, scored=ns, gpu=gpu)),
               "floor_fwd_ms": _sig(floor_ms(n, h, v, scored=ns, gpu=gpu, forward_only=True)),
               "chunk": default_chunk(v, ns), "predicted": True}
        for p in ("chunked_one_pass", "chunked_two_pass", "chunked_forward", "triton", "naive", "naive_forward"):
            ls = launches(p, n, h, v, dtype, scored=None if p.startswith("naive") else ns)
            row[f"{p}_ms"] = _sig(predict_ms(ls, gpu))
            row[f"{p}_peak_gib"] = round(peak_extra_bytes(p, n, h, v, dtype, scored=ns) / 2**30, 2)
        rows.append(row)
    return rows


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (a tiny dry-run share stays non-zero)."""
    return float(f"{x:.{digits}g}")


def achieved(results: dict, gpu: str | None = None) -> list[dict]:
    """Per timed row of a ``bench_logprob_loss.py`` JSON (``rows``: N, H, V, scored, impl,
    mode 'fwd_bwd' | 'no_grad', median_ms): achieved TFLOP/s of the floor's useful FLOPs
    (3 GEMMs of the scored tokens, 1 without grad) and the share of the floor
    (floor time / measured time: 1.0 is at the floor)."""
    gpu = gpu or results.get("gpu_kind", "h200")
    out = []
    for r in results.get("rows", []):
        if r.get("median_ms") is None:
            continue
        fwd = r["mode"] == "no_grad"
        useful = (1 if fwd else 3) * _gemm(r["scored"], r["H"], r["V"])
        fl = floor_ms(r["N"], r["H"], r["V"], scored=r["scored"], gpu=gpu, forward_only=fwd)
        out.append({**{k: r[k] for k in ("N", "H", "V", "impl", "mode", "median_ms")},
                    "achieved_tflops": _sig(useful / (r["median_ms"] * 1e-3) / 1e12),
                    "share_of_floor": _sig(fl / r["median_ms"]), "floor_ms": _sig(fl)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int)
    ap.add_argument("--h", type=int)
    ap.add_argument("--v", type=int)
    ap.add_argument("--scored", type=int, help="scored tokens (default 7/8 of N, the benchmarks' mask)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(ELEM))
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--results", help="a bench_logprob_loss.py JSON: print achieved TFLOP/s and share of the floor")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = ap.parse_args(argv)
    if args.results:
        with open(args.results) as f:
            rows = achieved(json.load(f), args.gpu)
        print(json.dumps(rows, indent=1) if args.json else "\n".join(
            f"{r['impl']:>22s} {r['mode']:8s} N={r['N']} H={r['H']} V={r['V']}: {r['median_ms']:.2f} ms, "
            f"{r['achieved_tflops']} TFLOP/s, {r['share_of_floor']:.2f} of the floor ({r['floor_ms']} ms)" for r in rows))
        return 0
    if args.n or args.h or args.v:
        if not (args.n and args.h and args.v):
            ap.error("--n, --h and --v go together")
        shapes = [(args.n, args.h, args.v)]
        share = (args.scored / args.n) if args.scored else SCORED_SHARE
    else:
        shapes, share = ISSUE_SHAPES, SCORED_SHARE
    rows = table(shapes, args.dtype, args.gpu, share)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"PREDICTED (no GPU measurement): {args.gpu}, {GPUS[args.gpu]['gemm_tflops']} TFLOP/s GEMM, "
          f"{GPUS[args.gpu]['hbm_tbps']} TB/s HBM, {args.dtype}")
    for r in rows:
        print(f"N={r['N']} (scored {r['scored']}) H={r['H']} V={r['V']}: floor {r['floor_ms']} ms fwd+bwd, "
              f"{r['floor_fwd_ms']} ms no-grad; chunk {r['chunk']} tokens")
        for p in ("chunked_one_pass", "chunked_two_pass", "chunked_forward", "triton", "naive", "naive_forward"):
            print(f"  {p:18s} {r[p + '_ms']:9.2f} ms  peak above inputs {r[p + '_peak_gib']:6.2f} GiB  (predicted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
