"""Log-probs (and entropy) of targets under a linear LM head, without [tokens, vocab] logits.

``linear_logprobs(hidden, weight, targets)`` equals
``log_softmax((hidden @ weight.T + bias) / temperature).gather(-1, targets)`` (see
``fastrl.reference.logprobs`` for the formula), but never holds the logits: the forward
keeps four fp32 numbers per token (running max, sum of exponentials, entropy term and
target logit) and the backward recomputes the logits tile by tile (Triton; PyTorch:
``backward_tile`` tokens x vocabulary entries at a time, the forward ``chunk_rows(V)`` tokens
at a time) to form the gradients of ``hidden``, ``weight`` and ``bias``.

Backends (``LOGPROB_BACKENDS``; ``auto``: ``chunked`` on CUDA, ``torch`` elsewhere):

- ``chunked``: per token chunk a cuBLAS logits GEMM (fp32 out) and the Triton row kernels
  of ``csrc_triton.logprob_rows`` (stats; the logits gradient written in place). Here (log-probs
  alone, and whatever needs the gradient after the forward: sequence-level ratios, vocabulary
  shards) the backward recomputes each chunk's logits: 4 GEMM-equivalents, only [N] statistics
  saved. Token-level policy losses take the one pass of ``fused_policy_loss`` (3). Budget per
  launch: ``csrc_triton/logprob_rows.py``; any shape: ``benchmarks/gpu/logprob_floor.py``.
- ``triton``: the fully fused kernels of ``csrc_triton.logprobs`` (5 GEMM-equivalents; slow on
  Hopper, see its docstring): kept selectable by name.
- ``torch``: plain PyTorch chunks (the CPU default).

The policy loss from hidden states, ``fused_linear_policy_loss``, lives in
``fastrl.ops.fused_policy_loss`` (import it from there or from ``fastrl.ops``: this module
does not import it, so the dependency runs one way).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from fastrl._checks import (
    check_float,
    check_int,
    check_nonempty,
    check_same_device,
    check_scalar,
    resolve_backend,
)

__all__ = ["LOGPROB_BACKENDS", "backward_tile", "chunk_rows", "chunked_rows", "linear_logprobs", "resolve_logprob_backend"]

# PyTorch path: the byte budget of one fp32 [chunk_tokens, V] logits buffer (at most two
# are live at a time, with the entropy). A fixed number of bytes, so the token chunk
# shrinks as V grows and the logits memory does not follow V or the token count. 48 MiB:
# the peak stays below Liger-Kernel's fused GRPO loss at every shape
# benchmarks/bench_logprobs_memory.py covers (its chunk is one 512-token sequence, ~62 MiB
# at V = 32000; 64 MiB tied it there on a second call), and it is above glibc's largest
# dynamic mmap threshold (32 MiB), so each buffer is its own mapping and goes back to the
# OS when freed (heap-sized buffers fragment the heap: a 32 MiB budget peaked higher than
# 64 MiB on CPU). Override with FASTRL_LOGPROBS_CHUNK_MB.
DEFAULT_CHUNK_MB = 48
TORCH_CHUNK_BYTES = int(float(os.environ.get("FASTRL_LOGPROBS_CHUNK_MB", str(DEFAULT_CHUNK_MB))) * 2**20)


def chunk_rows(vocab: int, *, weight_grad_hidden: int = 0) -> int:
    """Tokens per chunk of the PyTorch path (``linear_logprobs``'s forward, whose backward
    tiles by ``backward_tile``, and ``fused_linear_policy_loss``), from the vocabulary ``V`` and, in a pass that forms the
    LM head's weight gradient, the hidden size ``H`` (``weight_grad_hidden``; 0 otherwise):

        rows = max(TORCH_CHUNK_BYTES // (4 V), H, 1)

    The byte budget bounds the fp32 [rows, V] logits buffer, so the token chunk shrinks as V
    grows and no buffer follows the token count (the Triton path has no such buffer: fixed
    tiles, see csrc_triton/logprobs.py). A pass that forms the weight gradient adds each
    chunk's ``g.T @ h`` into the fp32 [V, H] gradient, re-reading and re-writing its 4 V H
    bytes once per chunk, and that GEMM's inner dimension is the chunk's rows: at V =
    151,936 the budget alone gives 82 rows, so a 2,048-token micro-batch re-accumulated the
    155 MB gradient 25 times in skinny GEMMs. At least H rows there: ceil(N / H)
    accumulations (8 at H = 256), and the chunk buffer is then at most as large as the
    weight gradient the pass produces anyway (the op's extra memory stays O(V H), not
    O(N V)). Forward-only passes (no weight gradient) keep the budget's rows.
    Before/after: benchmarks/bench_logprobs_chunk.py."""
    return max(1, TORCH_CHUNK_BYTES // (4 * max(vocab, 1)), int(weight_grad_hidden))


# The chunked path (``backend="chunked"``, the default on CUDA): the byte budget of one fp32
# [chunk_tokens, V] raw-logits buffer. Larger chunks re-read the LM head and re-accumulate
# the fp32 [V, H] weight gradient fewer times (each accumulation reads and writes 8 V H
# bytes: 4.4 GB at V = 151,936, H = 3,584, ~1 ms on an H200), smaller ones hold less: 1.25
# GiB gives 2,048 tokens at V = 151,936 (the audit's design-A chunk; benchmarks/gpu/
# logprob_floor.py prints the memory and time this predicts). Override with
# FASTRL_CHUNKED_LOGITS_MB or pass ``chunk_tokens`` to the op.
DEFAULT_CHUNKED_LOGITS_MB = 1280
CHUNKED_LOGITS_BYTES = int(float(os.environ.get("FASTRL_CHUNKED_LOGITS_MB", str(DEFAULT_CHUNKED_LOGITS_MB))) * 2**20)
CHUNK_ALIGN = 256  # tokens: chunk sizes are multiples of it (whole GEMM tiles, a few distinct shapes)

LOGPROB_BACKENDS = ("auto", "chunked", "triton", "torch")
"""Backends of ``linear_logprobs`` / ``fused_linear_policy_loss``: ``chunked`` is the
token-chunked cuBLAS path (GEMMs in PyTorch + the Triton row kernels of
``csrc_triton.logprob_rows``); ``triton`` the fully fused Triton kernels of
``csrc_triton.logprobs``; ``torch`` plain PyTorch. ``auto``: ``chunked`` on CUDA (until a
GPU run measures a shape where another path wins, see ``MEASURED_FASTEST``), ``torch``
elsewhere."""

MEASURED_FASTEST: dict[tuple[int, int, str], str] = {}
"""(H, V, dtype name) -> backend a GPU run measured fastest (``benchmarks/gpu/
bench_logprob_loss.py`` writes the rows to put here). Empty: no GPU has measured yet, so
``auto`` takes ``chunked`` on CUDA, whose speed rests on cuBLAS rather than Triton tuning."""


def resolve_logprob_backend(backend: str, device: torch.device, *, hidden: int = 0, vocab: int = 0,
                            dtype: torch.dtype | None = None) -> str:
    """``backend`` (one of ``LOGPROB_BACKENDS``) resolved for tensors on ``device``:
    ``auto`` is ``MEASURED_FASTEST`` for the shape when a GPU run filled it, else ``chunked``
    on CUDA and ``torch`` elsewhere. ``chunked`` on CPU needs ``TRITON_INTERPRET=1`` (its row
    kernels run in the interpreter, how CI tests the path)."""
    from fastrl._checks import check_choice, triton_available, triton_interpreter_enabled

    check_choice("backend", backend, LOGPROB_BACKENDS)
    if backend == "auto":
        if device.type != "cuda" or not triton_available():
            return "torch"
        return MEASURED_FASTEST.get((int(hidden), int(vocab), str(dtype).replace("torch.", "")), "chunked")
    if backend == "chunked":
        if not triton_available():
            raise ValueError("backend='chunked' requested but triton is not importable (its row kernels are Triton)")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise ValueError(f"backend='chunked' needs CUDA tensors (got {device.type}); on CPU set TRITON_INTERPRET=1")
        return "chunked"
    return resolve_backend(backend, device)


def chunked_rows(vocab: int, tokens: int, chunk_tokens: int | None = None) -> int:
    """Tokens per chunk of the chunked path: ``chunk_tokens`` when given (a test seam),
    else ``CHUNKED_LOGITS_BYTES // (4 V)`` rounded down to a multiple of ``CHUNK_ALIGN``
    (at least ``CHUNK_ALIGN``); never more than ``tokens``."""
    if chunk_tokens is not None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        rows = chunk_tokens
    else:
        rows = max(CHUNK_ALIGN, CHUNKED_LOGITS_BYTES // (4 * max(vocab, 1)) // CHUNK_ALIGN * CHUNK_ALIGN)
    return max(1, min(rows, int(tokens)))


# --------------------------------------------------------------------------- helpers


def _shard_info(weight: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(vocab offset of this rank's rows, total vocab size) as 0-dim int64 tensors. Made by
    fills on the weight's device: ``torch.tensor([...], device="cuda")`` copies from pageable
    host memory, a host synchronisation (the H200's sync debug mode caught it)."""
    v_local = torch.full((1,), weight.shape[0], dtype=torch.int64, device=weight.device)
    if group is None:
        return torch.zeros((), dtype=torch.int64, device=weight.device), v_local[0]
    world = dist.get_world_size(group)
    sizes = [torch.empty_like(v_local) for _ in range(world)]
    dist.all_gather(sizes, v_local, group=group)
    sizes_t = torch.cat(sizes)
    rank = dist.get_rank(group)
    return sizes_t[:rank].sum(), sizes_t.sum()


def _combine(m, s, w, t, group):
    """Per-row (m, s, w, t) of one vocab shard -> (lse, logp, entropy) of the full vocab.

    ``s`` and ``w`` are relative to ``m``: s = sum exp(u - m), w = sum exp(u - m) (u - m).
    """
    if group is not None:
        m_glob = m.clone()
        dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=group)
        a = torch.exp(m - m_glob)
        parts = [a * s, t]
        if w is not None:
            parts.append(a * (w + (m - m_glob) * s))
        packed = torch.stack(parts)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        s, t = packed[0], packed[1]
        w = packed[2] if w is not None else None
        m = m_glob
    log_s = torch.log(s)
    lse = m + log_s
    logp = t - lse
    ent = log_s - w / s if w is not None else None
    return lse, logp, ent


_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _logits_weight(weight: torch.Tensor) -> torch.Tensor:
    """The LM head as the logits GEMM reads it: on CPU a bf16/fp16 head is widened to fp32
    once per call (CPU has no low-precision GEMM with an fp32 output); elsewhere as is."""
    if weight.dtype in _LOW_PRECISION and weight.device.type != "cuda":
        return weight.float()
    return weight


def _torch_logits(h, weight, bias, inv_temp):
    """fp32 logits of a row chunk, accumulated and returned in fp32 like the Triton kernel
    (a bf16 GEMM output would round every logit to bf16 before the softmax: log-prob
    errors of ~1e-2 instead of ~1e-6). ``weight`` comes from ``_logits_weight``."""
    if h.dtype != weight.dtype:
        h = h.to(weight.dtype)
    if h.dtype in _LOW_PRECISION:  # CUDA: the low-precision GEMM writes fp32 directly
        z = torch.mm(h, weight.T, out_dtype=torch.float32)
    else:
        z = h @ weight.T
    if z.dtype != torch.float32:
        z = z.float()
    if bias is not None:
        z += bias
    if inv_temp != 1.0:
        z *= inv_temp
    return z


def _torch_stats(h, weight, bias, y, inv_temp, with_entropy, sampled=None):
    """(m, s, w, t) for rows of ``h``, chunked over rows: peak extra memory O(chunk x V).

    ``sampled`` (bool [rows], with ``with_entropy``): the entropy term ``w`` of those rows
    only (NaN elsewhere), from a copy of their logits taken before the chunk's buffer is
    exponentiated in place -- the other rows cost what ``with_entropy=False`` costs."""
    n = h.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    m, s, t = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    w = (torch.empty(n, **f32) if sampled is None else torch.full((n,), float("nan"), **f32)) if with_entropy else None
    step = chunk_rows(weight.shape[0])  # forward: no weight gradient formed here
    w_logits = _logits_weight(weight)
    for i in range(0, n, step):
        sl = slice(i, min(i + step, n))
        z = _torch_logits(h[sl], w_logits, bias, inv_temp)
        mc = z.amax(1)
        z -= mc[:, None]
        yc = y[sl]
        tc = z.gather(1, yc.clamp(min=0)[:, None]).squeeze(1) + mc
        t[sl] = torch.where(yc >= 0, tc, torch.zeros_like(tc))
        m[sl] = mc
        if with_entropy and sampled is not None:  # the subsample's rows, then in place as without entropy
            rows = sampled[sl].nonzero().squeeze(1)
            zs = z.index_select(0, rows)
            e = torch.exp(zs)
            w[sl].index_copy_(0, rows, torch.linalg.vecdot(e, zs))
            del e, zs
            s[sl] = z.exp_().sum(1)
        elif with_entropy:
            e = torch.exp(z)
            s[sl] = e.sum(1)
            w[sl] = torch.linalg.vecdot(e, z)
            del e
        else:  # one [chunk, V] buffer: exponentiate in place
            s[sl] = z.exp_().sum(1)
        del z
    return m, s, w, t


def backward_tile(tokens: int, vocab: int) -> tuple[int, int]:
    """``(rows, cols)`` of the PyTorch backward's fp32 logits tile (``_torch_grads``): at most
    ``TORCH_CHUNK_BYTES`` (``rows * cols * 4``), as square as the budget allows
    (``side = isqrt(budget / 4)``, 3,547 at 48 MiB), all the tokens when they fit the side:

        rows = min(tokens, side),  cols = min(V, budget // (4 rows))

    The backward adds each tile's ``g.T @ h`` into the ``[V, H]`` weight gradient and
    ``g @ W`` into the ``[tokens, H]`` hidden gradient; tiling both the tokens and the
    vocabulary, the first is re-read ``ceil(tokens / rows)`` - 1 times and the second
    ``ceil(V / cols)`` - 1 times, which square tiles balance. At V = 151,936, H = 256, 2,048
    tokens: one 2,048 x 6,144 tile column (48 MiB), the weight gradient written once, the 2 MiB
    hidden gradient re-read 24 times; the token chunks of ``chunk_rows`` before (256-row
    [256, V] chunks, 155 MB each, the weight gradient re-accumulated 8 times) held a buffer the
    size of the weight gradient at the update's memory peak."""
    side = max(1, math.isqrt(TORCH_CHUNK_BYTES // 4))
    rows = max(1, min(int(tokens), side))
    cols = max(1, min(int(vocab), TORCH_CHUNK_BYTES // (4 * rows)))
    return rows, cols


def _torch_grads(h, weight, bias, y, lse, ent, gl, ge, inv_temp, need_h, need_w, need_b):
    """Gradients wrt hidden/weight/bias, recomputing the logits tile by tile (``backward_tile``)."""
    n, hd = h.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    gh = torch.zeros(n, hd, **f32) if need_h else None  # fp32, summed over the vocabulary tiles
    new = torch.empty if n else torch.zeros  # the first token chunk writes gw/gb (no chunk: zero)
    gw = new(v, hd, **f32) if need_w else None
    gb = new(v, **f32) if need_b else None
    rows, cols = backward_tile(n, v)
    w_logits = _logits_weight(weight)
    for i in range(0, n, rows):
        sl = slice(i, min(i + rows, n))
        hs, glc, yc = h[sl], gl[sl], y[sl]
        first = i == 0
        for j in range(0, v, cols):
            vs = slice(j, min(j + cols, v))
            z = _torch_logits(hs, w_logits[vs], bias[vs] if bias is not None else None, inv_temp)
            z -= lse[sl, None]  # log p
            if ge is not None:
                p = torch.exp(z)
                # g = gl * (onehot - p) - ge * p * (log p + entropy)
                z += ent[sl, None]
                z *= p
                z *= -ge[sl, None]
                p *= glc[:, None]
                z -= p
                g = z
                del p
            else:  # g = -gl * p, in place: one tile buffer
                g = z.exp_()
                g *= -glc[:, None]
                del z
            here = (yc >= vs.start) & (yc < vs.stop)
            g.scatter_add_(1, (yc - vs.start).clamp(0, g.shape[1] - 1)[:, None], torch.where(here, glc, torch.zeros_like(glc))[:, None])
            if inv_temp != 1.0:
                g *= inv_temp
            if gb is not None:
                if first:
                    torch.sum(g, 0, out=gb[vs])
                else:
                    gb[vs] += g.sum(0)
            gq = g if h.dtype == torch.float32 else g.to(h.dtype)
            del g
            if gh is not None:
                if gq.dtype == torch.float32:
                    gh[sl].addmm_(gq, weight[vs])
                else:
                    gh[sl] += gq @ weight[vs]
            if gw is not None:
                hq = hs if gq.dtype == hs.dtype else hs.to(gq.dtype)
                if first and gq.dtype == torch.float32:
                    torch.mm(gq.T, hq, out=gw[vs])
                elif gq.dtype == torch.float32:
                    gw[vs].addmm_(gq.T, hq)
                elif first:
                    gw[vs] = (gq.T @ hq).float()
                else:
                    gw[vs] += gq.T @ hq
            z = g = gq = None  # noqa: F841  (free this tile's buffer before the next one)
    return gh, gw, gb  # gh in fp32: the caller all-reduces it (vocab shards) and casts it to the hidden dtype


# --------------------------------------------------------------------------- chunked path (cuBLAS GEMMs + Triton row kernels)


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32 (a bf16/fp16 GEMM writes fp32 directly)."""
    if a.dtype in _LOW_PRECISION:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b)


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into the fp32 ``acc`` (one GEMM with beta = 1; bf16/fp16 operands
    through cuBLAS's fp32-output addmm, so no product is rounded before it is added)."""
    if a.dtype in _LOW_PRECISION:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a, b)


def _chunked_stats(h, weight, bias, y, inv_temp, with_entropy, rows):
    """(m, s, w, t) of every row of ``h``: per token chunk one logits GEMM and one
    ``row_stats`` pass (``csrc_triton.logprob_rows``). Extra memory: one fp32 [rows, V]."""
    from csrc_triton.logprob_rows import row_stats

    n = h.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    m, s, t = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    w = torch.empty(n, **f32) if with_entropy else None
    w_logits = _logits_weight(weight)
    for i in range(0, n, rows):
        sl = slice(i, min(i + rows, n))
        z = _torch_logits(h[sl], w_logits, None, 1.0)
        mc, sc, wc, tc = row_stats(z, bias, y[sl].contiguous(), inv_temp, with_entropy)
        m[sl], s[sl], t[sl] = mc, sc, tc
        if w is not None:
            w[sl] = wc
        del z
    return m, s, w, t


def _chunked_grads(h, weight, bias, y, lse, ent, gl, ge, inv_temp, need_h, need_w, need_b, rows):
    """Gradients wrt hidden (fp32) / weight (fp32) / bias (fp32) from per-token ``gl``/``ge``:
    per token chunk the logits GEMM again, ``row_grad`` writing ``d loss / d logits``
    (in place in fp32; bf16/fp16 inputs on CUDA: a buffer of their dtype), then
    ``g @ W`` and ``g.T @ h`` (cuBLAS, fp32 accumulation)."""
    from csrc_triton.logprob_rows import row_grad

    n, hd = h.shape
    v = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    gh = torch.zeros(n, hd, **f32) if need_h else None
    gw = torch.zeros(v, hd, **f32) if need_w else None
    gb = torch.zeros(v, **f32) if need_b else None
    w_logits = _logits_weight(weight)
    gdt = w_logits.dtype  # the gradient GEMMs' operand dtype
    for i in range(0, n, rows):
        sl = slice(i, min(i + rows, n))
        z = _torch_logits(h[sl], w_logits, None, 1.0)
        out = z if gdt == torch.float32 else torch.empty(z.shape, dtype=gdt, device=z.device)
        g = row_grad(z, out, bias, y[sl].contiguous(), lse[sl].contiguous(),
                     ent[sl].contiguous() if ge is not None else None, gl[sl].contiguous(),
                     ge[sl].contiguous() if ge is not None else None, inv_temp)
        del z, out
        if gb is not None:
            gb += g.sum(0, dtype=torch.float32)
        if gh is not None:
            gh[sl] = _mm_f32(g, w_logits)
        if gw is not None:
            _addmm_f32_(gw, g.T, h[sl].to(gdt))
        del g
    return gh, gw, gb


# --------------------------------------------------------------------------- autograd


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, offset, temperature, with_entropy, ignore_index, group, impl, tiles,
                entropy_rows, chunk_tokens):
        # hidden [N, H], weight [V_local, H], bias [V_local] | None, targets [N] int64 (global ids)
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        inv_temp = 1.0 / temperature
        valid = targets != ignore_index
        # entropy_rows: the entropy of those (scored) rows only -- a metric's subsample; not differentiable
        sampled = valid & entropy_rows if (with_entropy and entropy_rows is not None) else None
        y_local = targets - offset
        in_shard = valid & (y_local >= 0) & (y_local < weight.shape[0])
        y_local = torch.where(in_shard, y_local, torch.full_like(y_local, -1))

        if impl == "triton":
            from csrc_triton.logprobs import logprobs_fwd

            # Valid rows first, so ignored rows are skipped without a host sync.
            idx = torch.argsort((~valid).to(torch.int8), stable=True)
            n_work = valid.sum().to(torch.int32).reshape(1)
            h_w = hidden.index_select(0, idx).contiguous()
            y_w = y_local.index_select(0, idx).contiguous()
            m, s, w, t = logprobs_fwd(h_w, weight, bias, y_w, n_work, inv_temp=inv_temp, with_entropy=with_entropy, tiles=tiles)
            row_ok = torch.arange(n, device=hidden.device) < n_work
        elif impl == "chunked":
            # compaction: one host sync on CUDA (the scored-token count sizes the chunks), so
            # no GEMM runs on an ignored row and garbage there (NaN/inf) is never read
            idx = valid.nonzero().squeeze(1)
            h_w, y_w = hidden.index_select(0, idx), y_local.index_select(0, idx)
            row_ok, n_work = None, None
            rows = chunked_rows(weight.shape[0], idx.shape[0], chunk_tokens)
            m, s, w, t = _chunked_stats(h_w, weight, bias, y_w, inv_temp, with_entropy, rows)
        else:
            if hidden.device.type == "cpu":
                idx = valid.nonzero().squeeze(1)  # free on CPU: no device to sync with
                h_w, y_w = hidden.index_select(0, idx), y_local.index_select(0, idx)
                row_ok = None
            else:
                # no compaction (it would sync): zero the ignored rows instead, so NaN/inf
                # padding in them cannot reach the weight gradient (0 * NaN is NaN)
                idx, h_w, y_w = None, torch.where(valid[:, None], hidden, 0.0), y_local
                row_ok = valid
            n_work = None
            sampled_w = sampled.index_select(0, idx) if (sampled is not None and idx is not None) else sampled
            m, s, w, t = _torch_stats(h_w, weight, bias, y_w, inv_temp, with_entropy, sampled_w)

        lse, logp_w, ent_w = _combine(m, s, w, t, group)
        if row_ok is not None:
            zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
            logp_w = torch.where(row_ok, logp_w, zero)
            ent_w = torch.where(row_ok, ent_w, zero) if ent_w is not None else None
        if idx is not None:
            logp = torch.zeros(n, dtype=torch.float32, device=hidden.device).index_copy_(0, idx, logp_w[: idx.shape[0]])
            ent = (
                torch.zeros(n, dtype=torch.float32, device=hidden.device).index_copy_(0, idx, ent_w[: idx.shape[0]])
                if ent_w is not None
                else None
            )
        else:
            logp, ent = logp_w, ent_w
        if sampled is not None:  # (the Triton kernel computes every row's: keep the subsample's only)
            ent = torch.where(sampled | ~valid, ent, torch.full_like(ent, float("nan")))
            ctx.mark_non_differentiable(ent)
            ent_w = None

        ctx.save_for_backward(h_w, weight, bias, y_w, lse, ent_w, idx, n_work, row_ok if idx is None else None)
        ctx.cfg = (n, inv_temp, group, impl, tiles, with_entropy and sampled is None, chunk_tokens)
        if with_entropy:
            return logp, ent
        return logp, None

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h_w, weight, bias, y_w, lse, ent_w, idx, n_work, row_ok = ctx.saved_tensors
        n, inv_temp, group, impl, tiles, with_entropy, chunk_tokens = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if grad_logp is None and grad_ent is None:
            return (None,) * 13
        dev = h_w.device
        if grad_logp is None:
            grad_logp = torch.zeros(n, dtype=torch.float32, device=dev)
        gl = grad_logp.float()
        ge = grad_ent.float() if (with_entropy and grad_ent is not None) else None
        if idx is not None:
            gl = gl.index_select(0, idx)
            ge = ge.index_select(0, idx) if ge is not None else None
        else:  # PyTorch path on CUDA, no compaction: ignored rows get zero gradient
            gl = torch.where(row_ok, gl, torch.zeros_like(gl))
            ge = torch.where(row_ok, ge, torch.zeros_like(ge)) if ge is not None else None
        if impl == "triton":
            from csrc_triton.logprobs import logprobs_bwd

            gl = gl.contiguous()
            ge = ge.contiguous() if ge is not None else None
            gh, gw, gb = logprobs_bwd(
                h_w, weight, bias, y_w, n_work, lse, ent_w if ge is not None else None, gl, ge,
                inv_temp=inv_temp, need_hidden=need_h, need_weight=need_w or need_b, tiles=tiles,
            )
        elif impl == "chunked":
            rows = chunked_rows(weight.shape[0], h_w.shape[0], chunk_tokens)
            gh, gw, gb = _chunked_grads(h_w, weight, bias, y_w, lse, ent_w, gl, ge, inv_temp, need_h, need_w, need_b, rows)
        else:
            gh, gw, gb = _torch_grads(h_w, weight, bias, y_w, lse, ent_w, gl, ge, inv_temp, need_h, need_w, need_b)
        grad_hidden = grad_weight = grad_bias = None
        if need_h:
            if group is not None:
                gh = gh.float() if gh.dtype != torch.float32 else gh
                dist.all_reduce(gh, op=dist.ReduceOp.SUM, group=group)
            gh = gh.to(h_w.dtype)
            if idx is not None:
                grad_hidden = torch.zeros(n, gh.shape[1], dtype=h_w.dtype, device=dev).index_copy_(0, idx, gh[: idx.shape[0]])
            else:
                grad_hidden = gh
        if need_w:
            grad_weight = gw.to(weight.dtype)
        if need_b:
            grad_bias = gb.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None, None


# --------------------------------------------------------------------------- public op


def _validate(hidden, weight, targets, bias, temperature, ignore_index):
    check_float("hidden", hidden)
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape [..., H], got a 0-dim tensor")
    check_float("weight", weight, ndim=2)
    check_int("targets", targets)
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), got {tuple(targets.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got {tuple(weight.shape)}"
        )
    check_nonempty("targets", targets)
    check_nonempty("weight", weight)
    if hidden.shape[-1] == 0:
        raise ValueError("hidden has H = 0 features")
    if bias is not None:
        check_float("bias", bias, shape=(weight.shape[0],))
    check_scalar("temperature", temperature, low=0.0, low_inclusive=False)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    return check_same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)


def _check_target_range(targets, ignore_index, vocab_total):
    """Targets must be in [0, V) or equal ignore_index. On CPU this raises ValueError; on
    CUDA it is a device-side assert (no host sync)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_total))
    if targets.device.type == "cpu":
        if bool(bad.any()):
            first = targets[bad][0].item()
            raise ValueError(
                f"targets must be in [0, {int(vocab_total)}) or equal ignore_index={ignore_index}; found {first}"
            )
    else:
        torch._assert_async(~bad.any(), "fastrl.linear_logprobs: targets out of range [0, V) (and not ignore_index)")


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_rows: torch.Tensor | None = None,
    ignore_index: int = -100,
    process_group: Any = None,
    backend: str = "auto",
    tiles: dict[str, dict[str, int]] | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token under ``softmax((hidden @ weight.T + bias) / temperature)``.

    Args:
        hidden: [..., H] last hidden states, any float dtype.
        weight: [V, H] LM head (the vocabulary rows of this rank when ``process_group``).
        targets: [...] (= ``hidden.shape[:-1]``) integer token ids in [0, V_total), or
            ``ignore_index``.
        bias: optional [V] LM head bias.
        temperature: logits are divided by it (> 0), as samplers do.
        return_entropy: also return the entropy of the tempered distribution per token.
        entropy_rows: with ``return_entropy``, None (every token; differentiable) or a bool
            tensor of the shape of ``targets``: a subsample for a metric -- the entropy of
            those tokens only, NaN at the other scored tokens (0 at ignored ones, as
            always), and no gradient through it (``fastrl.ops.stats.every_kth`` picks every
            k-th of a mask). The PyTorch path computes nothing for the other rows (their
            cost is ``return_entropy=False``'s); the Triton kernel computes every row's in
            the same pass and the others are set to NaN.
        ignore_index: targets equal to it (padding) cost nothing, give logp = entropy = 0
            and receive zero gradient.
        process_group: tensor-parallel vocabulary (Megatron-style). Each rank passes the
            same ``hidden``/``targets`` and its own contiguous slice of the LM head rows
            (rank r holds the rows after those of ranks < r; slices may differ in size).
            The op all-reduces the max, the sum of exponentials, the target logit and the
            entropy term, and in backward sums ``grad_hidden`` over ranks, so every rank
            gets the result of the unsplit op; ``grad_weight`` is this rank's slice.
        backend: "auto", "chunked", "triton" or "torch" (``LOGPROB_BACKENDS``; "auto":
            "chunked" on CUDA, "torch" otherwise). "chunked": per token chunk one cuBLAS
            logits GEMM and a Triton row pass; the backward recomputes each chunk's logits
            (GEMM + row kernel writing the logits gradient) and runs the two gradient GEMMs
            (4 GEMM-equivalents with the forward's). "triton": the fully fused kernels of
            ``csrc_triton.logprobs`` (5 GEMM-equivalents, slow on Hopper: kept by name).
        tiles: optional Triton tile sizes (see ``csrc_triton.logprobs.HOPPER_TILES``).
        chunk_tokens: tokens per chunk of the "chunked" backend (default ``chunked_rows``);
            results do not depend on it beyond fp32 rounding (the tests compare chunkings).

    Returns:
        ``logp`` with the shape of ``targets`` in fp32, or ``(logp, entropy)`` when
        ``return_entropy``. Differentiable wrt ``hidden``, ``weight`` and ``bias``
        (through both outputs).

    The [tokens, V] logits are never stored: the forward keeps O(tokens) statistics and
    the backward recomputes the logits tile by tile. Targets out of range raise a
    ValueError on CPU and trip a device-side assert on CUDA.

    Precision: the logits are accumulated and kept in fp32 for every input dtype on both
    backends (bf16 inputs: log-prob error ~1e-6, not the ~1e-2 of bf16-rounded logits). On
    CPU a bf16/fp16 LM head is widened to an fp32 copy for the duration of the call.
    """
    device = _validate(hidden, weight, targets, bias, temperature, ignore_index)
    impl = resolve_logprob_backend(backend, device, hidden=hidden.shape[-1], vocab=weight.shape[0],
                                   dtype=torch.promote_types(hidden.dtype, weight.dtype))
    if process_group is not None and not dist.is_initialized():
        raise ValueError("process_group was given but torch.distributed is not initialised")
    hdim = hidden.shape[-1]
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    h2 = hidden.reshape(-1, hdim).to(dtype)
    w2 = weight.to(dtype)
    if impl == "triton":
        h2, w2 = h2.contiguous(), w2.contiguous()
    y = targets.reshape(-1).to(torch.int64)
    b = bias.contiguous() if bias is not None else None

    offset, vocab_total = _shard_info(weight, process_group)
    _check_target_range(y, ignore_index, vocab_total)
    rows = None
    if entropy_rows is not None:
        if not isinstance(entropy_rows, torch.Tensor) or entropy_rows.dtype != torch.bool or \
                tuple(entropy_rows.shape) != tuple(targets.shape):
            raise ValueError(f"entropy_rows must be a bool tensor of the shape of targets {tuple(targets.shape)}, got "
                             f"{tuple(entropy_rows.shape) if isinstance(entropy_rows, torch.Tensor) else type(entropy_rows).__name__}"
                             f"{' ' + str(entropy_rows.dtype) if isinstance(entropy_rows, torch.Tensor) else ''}")
        rows = entropy_rows.reshape(-1).to(y.device)

    logp, ent = _LinearLogprobs.apply(
        h2, w2, b, y, offset, float(temperature), bool(return_entropy), ignore_index, process_group, impl, tiles,
        rows, chunk_tokens,
    )
    logp = logp.reshape(targets.shape)
    if return_entropy:
        return logp, ent.reshape(targets.shape)
    return logp
