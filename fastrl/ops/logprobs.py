"""Log-probs (and entropy) of targets under a linear LM head, without [tokens, vocab] logits.

``linear_logprobs(hidden, weight, targets)`` equals
``log_softmax((hidden @ weight.T + bias) / temperature).gather(-1, targets)`` (see
``fastrl.reference.logprobs`` for the formula), but never holds the logits: the forward
keeps four fp32 numbers per token (running max, sum of exponentials, entropy term and
target logit) and the backward recomputes the logits tile by tile (Triton) or chunk by
chunk (PyTorch) to form the gradients of ``hidden``, ``weight`` and ``bias``.

``fused_linear_policy_loss`` feeds those log-probs straight into
``fastrl.ops.policy_loss`` (on CPU it forms the gradients in the same pass as the logits
when each token's loss gradient depends only on that token).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from fastrl._checks import (
    check_float,
    check_global_count,
    check_int,
    check_is_weight,
    check_mask,
    check_nonempty,
    check_same_device,
    check_scalar,
    resolve_backend,
    select_global_count,
)
from fastrl.config import PolicyLossConfig
from fastrl.ops.aggregation import aggregation_weights

__all__ = ["linear_logprobs", "fused_linear_policy_loss"]

# PyTorch path: size in bytes of one fp32 [chunk_tokens, V] work buffer (two are live at
# a time). Override with FASTRL_LOGPROBS_CHUNK_MB.
TORCH_CHUNK_BYTES = int(float(os.environ.get("FASTRL_LOGPROBS_CHUNK_MB", "128")) * 2**20)


def _chunk_rows(vocab: int) -> int:
    return max(1, TORCH_CHUNK_BYTES // (4 * max(vocab, 1)))


# --------------------------------------------------------------------------- helpers


def _shard_info(weight: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(vocab offset of this rank's rows, total vocab size) as 0-dim int64 tensors."""
    v_local = torch.tensor([weight.shape[0]], dtype=torch.int64, device=weight.device)
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


def _torch_stats(h, weight, bias, y, inv_temp, with_entropy):
    """(m, s, w, t) for rows of ``h``, chunked over rows: peak extra memory O(chunk x V)."""
    n = h.shape[0]
    f32 = dict(dtype=torch.float32, device=h.device)
    m, s, t = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    w = torch.empty(n, **f32) if with_entropy else None
    step = _chunk_rows(weight.shape[0])
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
        if with_entropy:
            e = torch.exp(z)
            s[sl] = e.sum(1)
            w[sl] = torch.linalg.vecdot(e, z)
            del e
        else:  # one [chunk, V] buffer: exponentiate in place
            s[sl] = z.exp_().sum(1)
        del z
    return m, s, w, t


def _torch_grads(h, weight, bias, y, lse, ent, gl, ge, inv_temp, need_h, need_w, need_b):
    """Gradients wrt hidden/weight/bias, recomputing logits chunk by chunk."""
    n, hd = h.shape
    v = weight.shape[0]
    gh = torch.empty(n, hd, dtype=h.dtype, device=h.device) if need_h else None
    gw = torch.zeros(v, hd, dtype=torch.float32, device=h.device) if need_w else None
    gb = torch.zeros(v, dtype=torch.float32, device=h.device) if need_b else None
    step = _chunk_rows(v)
    w_logits = _logits_weight(weight)
    for i in range(0, n, step):
        sl = slice(i, min(i + step, n))
        z = _torch_logits(h[sl], w_logits, bias, inv_temp)
        z -= lse[sl, None]  # log p
        glc = gl[sl]
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
        else:  # g = -gl * p, in place: one [chunk, V] buffer
            g = z.exp_()
            g *= -glc[:, None]
            del z
        yc = y[sl]
        g.scatter_add_(1, yc.clamp(min=0)[:, None], torch.where(yc >= 0, glc, torch.zeros_like(glc))[:, None])
        if inv_temp != 1.0:
            g *= inv_temp
        if gb is not None:
            gb += g.sum(0)
        gq = g if h.dtype == torch.float32 else g.to(h.dtype)
        del g
        if gh is not None:
            torch.mm(gq, weight, out=gh[sl])
        if gw is not None:
            if gq.dtype == torch.float32:
                gw.addmm_(gq.T, h[sl])
            else:
                gw += gq.T @ h[sl]
        z = g = gq = None  # noqa: F841  (free this chunk's buffer before the next one)
    return gh, gw, gb


# --------------------------------------------------------------------------- autograd


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, offset, temperature, with_entropy, ignore_index, group, impl, tiles):
        # hidden [N, H], weight [V_local, H], bias [V_local] | None, targets [N] int64 (global ids)
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        inv_temp = 1.0 / temperature
        valid = targets != ignore_index
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
            m, s, w, t = _torch_stats(h_w, weight, bias, y_w, inv_temp, with_entropy)

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

        ctx.save_for_backward(h_w, weight, bias, y_w, lse, ent_w, idx, n_work, row_ok if idx is None else None)
        ctx.cfg = (n, inv_temp, group, impl, tiles, with_entropy)
        if with_entropy:
            return logp, ent
        return logp, None

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        h_w, weight, bias, y_w, lse, ent_w, idx, n_work, row_ok = ctx.saved_tensors
        n, inv_temp, group, impl, tiles, with_entropy = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if grad_logp is None and grad_ent is None:
            return (None,) * 11
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
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


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
    ignore_index: int = -100,
    process_group: Any = None,
    backend: str = "auto",
    tiles: dict[str, dict[str, int]] | None = None,
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
        ignore_index: targets equal to it (padding) cost nothing, give logp = entropy = 0
            and receive zero gradient.
        process_group: tensor-parallel vocabulary (Megatron-style). Each rank passes the
            same ``hidden``/``targets`` and its own contiguous slice of the LM head rows
            (rank r holds the rows after those of ranks < r; slices may differ in size).
            The op all-reduces the max, the sum of exponentials, the target logit and the
            entropy term, and in backward sums ``grad_hidden`` over ranks, so every rank
            gets the result of the unsplit op; ``grad_weight`` is this rank's slice.
        backend: "auto" (Triton on CUDA, PyTorch otherwise), "triton" or "torch".
        tiles: optional Triton tile sizes (see ``csrc_triton.logprobs.HOPPER_TILES``).

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
    impl = resolve_backend(backend, device)
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

    logp, ent = _LinearLogprobs.apply(
        h2, w2, b, y, offset, float(temperature), bool(return_entropy), ignore_index, process_group, impl, tiles
    )
    logp = logp.reshape(targets.shape)
    if return_entropy:
        return logp, ent.reshape(targets.shape)
    return logp


# --------------------------------------------------------------------------- fused policy loss


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
    config: PolicyLossConfig = PolicyLossConfig(),
    temperature: float = 1.0,
    entropy: bool = False,
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    process_group: Any = None,
    backend: str = "auto",
    tiles: dict[str, dict[str, int]] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of ``fastrl.ops.policy_loss`` computed from hidden states.

    Exactly ``policy_loss(linear_logprobs(hidden, weight, targets', ...), old_logp,
    advantages, mask, ...)`` where ``targets'`` ignores the tokens outside ``mask`` (so
    padding costs nothing and may hold any id), with the per-token entropy passed to
    ``policy_loss`` when ``config.entropy_coef != 0`` or ``entropy=True`` (then the
    ``entropy_mean``/``entropy_loss`` metrics are reported).

    Args:
        hidden: [B, T, H] last hidden states (the ones that predict ``targets``).
        weight, bias: LM head [V, H] and optional [V] (a vocab shard with ``process_group``).
        targets: [B, T] sampled token ids.
        old_logp, advantages, mask, ref_logp, rollout_logp, is_weight, config, global_token_count,
            global_seq_count: as in ``fastrl.ops.policy_loss`` (every ``PolicyLossConfig``
            option, including sequence-level ratios and global-token normalisation).
        temperature: sampling temperature the logits are divided by.
        entropy: compute the entropy (metrics) even when ``config.entropy_coef == 0``.
        process_group: tensor-parallel vocabulary, see ``linear_logprobs``.
        backend: for both the log-probs and the loss.

    Returns:
        ``(loss, metrics)`` as ``policy_loss``; ``loss`` is differentiable wrt ``hidden``,
        ``weight`` and ``bias``.

    Memory: the [B*T, V] logits are never held. Triton (and PyTorch on CUDA, with
    tensor parallelism, or for sequence-level ratios / importance weights): the forward
    keeps O(B*T) statistics and the backward recomputes the logits in tiles / token chunks
    once the loss has given d loss / d logp and d loss / d entropy per token (4 GEMM passes).
    PyTorch on CPU with token-level ratios: each token chunk's logits are computed once and
    turned into grad_hidden / grad_weight in the same pass (3 GEMM passes, like the logits
    path); those gradients are held until backward (``EAGER_TORCH_LOSS`` switches it off).
    """
    from fastrl.ops.policy_loss import policy_loss

    check_float("hidden", hidden, ndim=3)
    check_int("targets", targets, ndim=2)
    if tuple(targets.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:2])} (hidden.shape[:2]), got {tuple(targets.shape)}")
    check_mask("mask", mask, tuple(targets.shape))
    # every per-token input is validated before any work (the one-pass path indexes them)
    B, T = targets.shape
    check_float("old_logp", old_logp, shape=(B, T))
    check_float("advantages", advantages)
    if tuple(advantages.shape) not in ((B, T), (B,)):
        raise ValueError(f"advantages must have shape (B, T) = {(B, T)} or (B,) = {(B,)}, got {tuple(advantages.shape)}")
    for name, t in (("ref_logp", ref_logp), ("rollout_logp", rollout_logp)):
        if t is not None:
            check_float(name, t, shape=(B, T))
    check_is_weight(is_weight, B, T)
    check_same_device(hidden=hidden, targets=targets, old_logp=old_logp, advantages=advantages, mask=mask,
                      ref_logp=ref_logp, rollout_logp=rollout_logp, is_weight=is_weight)
    ignore_index = -100
    keep = mask if mask.dtype == torch.bool else mask != 0
    targets_eff = torch.where(keep, targets.to(torch.int64), torch.full_like(targets, ignore_index, dtype=torch.int64))
    with_entropy = bool(entropy) or config.entropy_coef != 0
    if _eager_applies(hidden, weight, bias, rollout_logp, config, process_group, backend):
        _validate(hidden, weight, targets_eff, bias, temperature, ignore_index)
        _check_target_range(targets_eff.reshape(-1), ignore_index, weight.shape[0])
        return _fused_eager_torch(
            hidden, weight, bias, targets_eff, keep, old_logp, advantages, mask, ref_logp=ref_logp,
            rollout_logp=rollout_logp, is_weight=is_weight, config=config, temperature=float(temperature), with_entropy=with_entropy,
            global_token_count=global_token_count, global_seq_count=global_seq_count,
        )
    out = linear_logprobs(
        hidden, weight, targets_eff, bias=bias, temperature=temperature, return_entropy=with_entropy,
        ignore_index=ignore_index, process_group=process_group, backend=backend, tiles=tiles,
    )
    logp, ent = out if with_entropy else (out, None)
    return policy_loss(
        logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=ent, rollout_logp=rollout_logp,
        is_weight=is_weight, config=config, global_token_count=global_token_count, global_seq_count=global_seq_count, backend=backend,
    )


# --------------------------------------------------------------------------- fused policy loss, one pass (CPU)

# The PyTorch path of fused_linear_policy_loss computes the gradients in the forward pass
# (3 GEMMs per token chunk: logits, grad_hidden, grad_weight) instead of recomputing the
# logits in backward (4 GEMMs), when the loss gradient of a token depends only on that
# token (token-level ratio and importance weights). Set False to always compose
# policy_loss(linear_logprobs(...)).
EAGER_TORCH_LOSS = True


def _eager_applies(hidden, weight, bias, rollout_logp, config, process_group, backend) -> bool:
    if not EAGER_TORCH_LOSS or process_group is not None or hidden.device.type != "cpu":
        return False
    if resolve_backend(backend, hidden.device) != "torch":
        return False
    if config.ratio_level != "token" or (rollout_logp is not None and config.is_level != "token"):
        return False
    if config.surrogate == "vespo":  # its weight depends on the whole row
        return False
    needs = [t.requires_grad for t in (hidden, weight, bias) if t is not None]
    return torch.is_grad_enabled() and any(needs)


class _PrecomputedGrads(torch.autograd.Function):
    """Returns ``loss``; its backward hands out gradients computed in the forward pass.

    They are saved tensors (freed by autograd after a backward without ``retain_graph``)
    and never modified, so a retained graph can be differentiated again."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, gh, gw, gb):
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_out):
        gh, gw, gb = ctx.saved_tensors
        dh, dw, db = ctx.dtypes
        out = [None] * 7
        if gh is not None and ctx.needs_input_grad[1]:
            out[1] = (gh * grad_out).to(dh)
        if gw is not None and ctx.needs_input_grad[2]:
            out[2] = (gw * grad_out).to(dw)
        if gb is not None and ctx.needs_input_grad[3]:
            out[3] = (gb * grad_out).to(db)
        return tuple(out)


def _fused_eager_torch(
    hidden, weight, bias, targets_eff, keep, old_logp, advantages, mask, *, ref_logp, rollout_logp, is_weight, config,
    temperature, with_entropy, global_token_count, global_seq_count,
):
    """fused_linear_policy_loss on CPU with the gradients formed in the same pass as the logits.

    d loss / d logp_t = c_t * dl_t/dlogp_t, where c_t = f_b / D is the aggregation weight of
    token t (``fastrl.ops.aggregation``, the rule ``policy_loss`` applies) and l_t its
    per-token loss: dl_t/dlogp_t comes from ``policy_loss`` on each token chunk with a plain
    token sum.
    The loss value and metrics come from one ``policy_loss`` call on the detached log-probs.
    """
    from fastrl.ops.policy_loss import policy_loss

    B, T, hd = hidden.shape
    inv_temp = 1.0 / temperature
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    h2 = hidden.detach().reshape(-1, hd).to(dtype)
    w2 = weight.detach().to(dtype)
    b2 = bias.detach() if bias is not None else None
    idx = keep.reshape(-1).nonzero().squeeze(1)
    hw = h2.index_select(0, idx)
    yw = targets_eff.reshape(-1).index_select(0, idx)
    n, V = idx.numel(), w2.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    counts = dict(global_token_count=global_token_count, global_seq_count=global_seq_count)

    # aggregation weight of every token: f_b / D (fastrl.ops.aggregation, the rule policy_loss applies)
    count_name, count = select_global_count(config.loss_agg, global_token_count, global_seq_count)
    global_count = check_global_count(count_name, count, hidden.device)
    f_row, inv_d = aggregation_weights(keep.sum(1, dtype=torch.float32), loss_agg=config.loss_agg,
                                       norm_length=config.norm_length, global_count=global_count)
    c_tok = (f_row * inv_d)[:, None].expand(B, T).reshape(-1).index_select(0, idx)

    def pick(x):
        return None if x is None else x.reshape(-1).index_select(0, idx)

    adv_full = advantages[:, None].expand(B, T) if advantages.dim() == 1 else advantages
    old_w, adv_w, ref_w, roll_w = pick(old_logp), pick(adv_full), pick(ref_logp), pick(rollout_logp)
    isw_w = None if is_weight is None else pick(is_weight.reshape(B, -1).expand(B, T))
    tok_cfg = config.replace(loss_agg="seq-mean-token-sum", norm_length=None)

    def token_grads(sl, lp_c, ent_c):
        lp = lp_c.detach().requires_grad_()
        en = ent_c.detach().requires_grad_() if ent_c is not None else None
        c = lp.shape[0]
        with torch.enable_grad():
            loss_c, _ = policy_loss(
                lp[None], old_w[sl][None], adv_w[sl][None], torch.ones(1, c, **f32),
                ref_logp=ref_w[sl][None] if ref_w is not None else None,
                entropy=en[None] if en is not None else None,
                rollout_logp=roll_w[sl][None] if roll_w is not None else None,
                is_weight=isw_w[sl][None] if isw_w is not None else None,
                config=tok_cfg, global_seq_count=1.0, backend="torch",
            )
            inputs = [lp] + ([en] if en is not None else [])
            grads = torch.autograd.grad(loss_c, inputs, allow_unused=True)
        gl = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        ge = grads[1] if en is not None and grads[1] is not None else None
        w = c_tok[sl]
        return gl * w, (ge * w if ge is not None else None)

    need_h, need_w = hidden.requires_grad, weight.requires_grad
    need_b = bias is not None and bias.requires_grad
    logp_w = torch.empty(n, **f32)
    ent_w = torch.empty(n, **f32) if with_entropy else None
    gh = torch.empty(n, hd, dtype=dtype, device=hidden.device) if need_h else None
    gw = torch.zeros(V, hd, **f32) if need_w else None
    gb = torch.zeros(V, **f32) if need_b else None
    step = _chunk_rows(V)
    w_logits = _logits_weight(w2)
    for i in range(0, n, step):
        sl = slice(i, min(i + step, n))
        z = _torch_logits(hw[sl], w_logits, b2, inv_temp)
        z -= z.amax(1, keepdim=True)  # u - m
        yc = yw[sl]
        t = z.gather(1, yc[:, None]).squeeze(1)
        if with_entropy:
            e = torch.exp(z)
            ssum = e.sum(1)
            log_s = ssum.log()
            ent_c = log_s - torch.linalg.vecdot(e, z) / ssum
        else:
            ssum = z.exp_().sum(1)  # z now holds exp(u - m) = p * s
            log_s = ssum.log()
            ent_c = None
        lp_c = t - log_s
        logp_w[sl] = lp_c
        if ent_w is not None:
            ent_w[sl] = ent_c
        gl, ge = token_grads(sl, lp_c, ent_c)
        gl_t = gl * inv_temp
        # g = (gl * (onehot - p) - ge * p * (log p + H)) / T, built in the chunk buffers
        if with_entropy:
            if ge is not None:
                z -= log_s[:, None]  # log p
                z += ent_c[:, None]
                z *= e
                z *= (-(ge * inv_temp) / ssum)[:, None]
                e *= (gl_t / ssum)[:, None]
                z -= e
                g = z
                del e
            else:
                e *= (-gl_t / ssum)[:, None]
                g = e
                del z
        else:
            z *= (-gl_t / ssum)[:, None]
            g = z
        g.scatter_add_(1, yc[:, None], gl_t[:, None])
        if gb is not None:
            gb += g.sum(0)
        gq = g if dtype == torch.float32 else g.to(dtype)
        del g
        if gh is not None:
            torch.mm(gq, w2, out=gh[sl])
        if gw is not None:
            if gq.dtype == torch.float32:
                gw.addmm_(gq.T, hw[sl])
            else:
                gw += gq.T @ hw[sl]
        # drop every reference to this chunk's buffer before the next chunk allocates one
        z = g = gq = None  # noqa: F841

    logp = torch.zeros(B * T, **f32).index_copy_(0, idx, logp_w).reshape(B, T)
    ent = torch.zeros(B * T, **f32).index_copy_(0, idx, ent_w).reshape(B, T) if with_entropy else None
    with torch.no_grad():
        loss, metrics = policy_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=ent,
                                    rollout_logp=rollout_logp, is_weight=is_weight, config=config, backend="torch",
                                    **counts)
    gh_full = None
    if gh is not None:
        gh_full = torch.zeros(B * T, hd, dtype=dtype, device=hidden.device).index_copy_(0, idx, gh).reshape(B, T, hd)
    loss = _PrecomputedGrads.apply(loss, hidden, weight, bias, gh_full, gw, gb)
    return loss, metrics
