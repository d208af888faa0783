"""The policy loss straight from hidden states: ``fused_linear_policy_loss``.

``fused_linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask, ...)`` is
``policy_loss(linear_logprobs(hidden, weight, targets', ...), old_logp, advantages, mask,
...)`` without the ``[tokens, vocab]`` logits. Two paths (``which_path`` names the one a call
takes; ``fastrl bench`` and ``benchmarks/gpu/bench_logprob_loss.py`` report it):

- one pass (the ``chunked`` backend, the CUDA default, on any device; the ``torch`` backend
  on CPU), for token-level ratio and importance weight (PPO, GRPO, DAPO, Dr. GRPO, CISPO,
  SAPO; with KL and entropy terms): each token chunk's logits are computed once (a GEMM),
  turned into log-probs, the per-token loss gradients and ``d loss / d logits`` (the row
  kernels of ``csrc_triton.logprob_rows``, or PyTorch ops), then ``grad_hidden`` (``g @ W``)
  and the fp32 ``grad_weight`` (``g.T @ h``): three GEMMs, no recompute. It works because
  then the loss gradient of a token depends only on that token:
  ``d loss / d logp_t = c_t * d l_t / d logp_t`` with ``l_t`` the per-token loss (from
  ``policy_loss`` itself, on each chunk: one home for every surrogate formula) and ``c_t``
  the aggregation weight of token ``t`` (``fastrl.ops.aggregation``, the rule every loss
  uses). The backward only scales the saved gradients by ``grad_output``.
- composed (sequence-level ratios or importance weights: GSPO and the like; VESPO, whose
  weight depends on the whole row; tensor-parallel vocabulary shards; no gradient needed;
  the ``triton`` backend; ``one_pass=False``): ``linear_logprobs`` then ``policy_loss``. With
  the ``chunked`` backend that is the cheapest exact second pass: logits GEMM + stats in the
  forward ([N] statistics saved), logits GEMM again + gradient row kernel + the two gradient
  GEMMs in the backward (4 GEMM-equivalents); without a gradient, one GEMM + stats.
"""

from __future__ import annotations

from typing import Any

import torch

import fastrl.ops.logprobs as _lp  # shared helpers, looked up at call time (one definition, patchable)
from fastrl._checks import (
    check_float,
    check_int,
    check_is_weight,
    check_mask,
    check_same_device,
)
from fastrl.config import SURROGATE_SPECS, PolicyLossConfig
from fastrl.ops.aggregation import GlobalCounts, aggregation_weights, resolve_global_count
from fastrl.ops.logprobs import linear_logprobs
from fastrl.ops.policy_loss import policy_loss

__all__ = ["fused_linear_policy_loss"]

_IGNORE = -100  # the ignore_index given to linear_logprobs for tokens outside the mask


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
    global_counts: GlobalCounts | None = None,
    process_group: Any = None,
    backend: str = "auto",
    tiles: dict[str, dict[str, int]] | None = None,
    one_pass: bool = True,
    chunk_tokens: int | None = None,
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
            global_seq_count, global_counts: as in ``fastrl.ops.policy_loss`` (every ``PolicyLossConfig``
            option, including sequence-level ratios and global-token normalisation).
        temperature: sampling temperature the logits are divided by.
        entropy: compute the entropy (metrics) even when ``config.entropy_coef == 0``.
        process_group: tensor-parallel vocabulary, see ``linear_logprobs``.
        backend: of the log-probs, ``fastrl.ops.logprobs.LOGPROB_BACKENDS`` ("auto" is
            "chunked" on CUDA, "torch" elsewhere); the loss itself runs on "auto" for
            "chunked" and on the named backend otherwise.
        tiles: Triton tile sizes of the log-probs kernels (see ``linear_logprobs``).
        one_pass: where it applies (the "chunked" or "torch" backend, a gradient needed,
            token-level ratio and importance weight, not VESPO, no tensor parallelism): form
            the gradients in the same pass as the logits (3 GEMMs per token chunk instead of
            4, see "Memory" below). False always composes ``policy_loss(linear_logprobs(...))``.
            Loss, metrics and gradients are the same either way (the tests compare the paths).
        chunk_tokens: tokens per chunk of the "chunked" backend (see ``linear_logprobs``).

    Returns:
        ``(loss, metrics)`` as ``policy_loss``; ``loss`` is differentiable wrt ``hidden``,
        ``weight`` and ``bias``.

    Memory: the [B*T, V] logits are never held. The composed path (Triton; PyTorch on CUDA;
    tensor parallelism; sequence-level ratios / importance weights): the forward keeps O(B*T)
    statistics and the backward recomputes the logits in tiles / token chunks once the loss
    has given d loss / d logp and d loss / d entropy per token (4 GEMM passes; the fused
    Triton kernels 5). The one pass ("chunked" anywhere, PyTorch on CPU; token-level ratios):
    each token chunk's logits are computed once and turned into grad_hidden / grad_weight in
    the same pass (3 GEMM passes); those gradients are held until backward (the "chunked"
    weight gradient accumulated in fp32 and held in the weight's dtype; ``one_pass=False``
    switches it off). Chunks: ``fastrl.ops.logprobs.chunked_rows(V, N)`` tokens for
    "chunked" (one fp32 [chunk, V] logits buffer of ~1.25 GiB, and a bf16/fp16 gradient
    buffer beside it for such inputs), ``chunk_rows(V, weight_grad_hidden=H)`` for PyTorch.
    """
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
    keep = mask if mask.dtype == torch.bool else mask != 0
    targets_eff = torch.where(keep, targets.to(torch.int64), torch.full_like(targets, _IGNORE, dtype=torch.int64))
    with_entropy = bool(entropy) or config.entropy_coef != 0
    impl = _lp.resolve_logprob_backend(backend, hidden.device, hidden=hidden.shape[-1], vocab=weight.shape[0],
                                       dtype=torch.promote_types(hidden.dtype, weight.dtype))
    if one_pass and _one_pass_applies(impl, hidden, weight, bias, rollout_logp, config, process_group):
        _lp._validate(hidden, weight, targets_eff, bias, temperature, _IGNORE)
        _lp._check_target_range(targets_eff.reshape(-1), _IGNORE, weight.shape[0])
        global_count = resolve_global_count(config.loss_agg, hidden.device, global_counts=global_counts,
                                            global_token_count=global_token_count, global_seq_count=global_seq_count)
        return _fused_one_pass(
            hidden, weight, bias, targets_eff, keep, old_logp, advantages, mask, ref_logp=ref_logp,
            rollout_logp=rollout_logp, is_weight=is_weight, config=config, temperature=float(temperature),
            with_entropy=with_entropy, global_count=global_count,
            counts=dict(global_counts=global_counts, global_token_count=global_token_count, global_seq_count=global_seq_count),
            rows_impl=impl, chunk_tokens=chunk_tokens,
        )
    out = linear_logprobs(
        hidden, weight, targets_eff, bias=bias, temperature=temperature, return_entropy=with_entropy,
        ignore_index=_IGNORE, process_group=process_group, backend=impl, tiles=tiles, chunk_tokens=chunk_tokens,
    )
    logp, ent = out if with_entropy else (out, None)
    return policy_loss(
        logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=ent, rollout_logp=rollout_logp,
        is_weight=is_weight, config=config, global_token_count=global_token_count, global_seq_count=global_seq_count,
        global_counts=global_counts, backend=_loss_backend(backend),
    )


def _loss_backend(backend: str) -> str:
    """The ``policy_loss`` backend for a log-prob backend: its own name where the loss has
    it ("triton", "torch"), else "auto"."""
    return backend if backend in ("triton", "torch") else "auto"


def which_path(backend: str, device: torch.device | str, *, config: PolicyLossConfig = PolicyLossConfig(),
               needs_grad: bool = True, tensor_parallel: bool = False, has_rollout_logp: bool = False,
               hidden: int = 0, vocab: int = 0, dtype: torch.dtype = torch.bfloat16, one_pass: bool = True) -> str:
    """The path ``fused_linear_policy_loss`` takes, in words (what ``fastrl bench`` and the
    benchmarks report): ``"<backend>/one-pass"`` (3 GEMM-equivalents), ``"<backend>/two-pass"``
    (forward GEMM, backward GEMM recompute + 2 gradient GEMMs: 4) or ``"<backend>/forward"``
    (no gradient: 1 GEMM)."""
    device = torch.device(device)
    impl = _lp.resolve_logprob_backend(backend, device, hidden=hidden, vocab=vocab, dtype=dtype)
    if not needs_grad:
        return f"{impl}/forward"
    token_level = _token_level(config, has_rollout_logp)
    one = one_pass and not tensor_parallel and token_level and (impl == "chunked" or (impl == "torch" and device.type == "cpu"))
    return f"{impl}/{'one-pass' if one else 'two-pass'}"


def _token_level(config: PolicyLossConfig, has_rollout: bool) -> bool:
    """d loss / d logp_t depends on token t alone (up to the aggregation weight c_t)."""
    if config.ratio_level != "token" or (has_rollout and config.is_level != "token"):
        return False
    return not SURROGATE_SPECS[config.surrogate].sequence_weight  # (vespo: its weight depends on the whole row)


# --------------------------------------------------------------------------- one pass


def _one_pass_applies(impl, hidden, weight, bias, rollout_logp, config, process_group) -> bool:
    """The one-pass path runs for the "chunked" backend (any device) and the "torch" backend
    on CPU (where it is the cheaper of the PyTorch forms), never with tensor parallelism."""
    if process_group is not None:
        return False
    if not (impl == "chunked" or (impl == "torch" and hidden.device.type == "cpu")):
        return False
    if not _token_level(config, rollout_logp is not None):
        return False
    needs = [t.requires_grad for t in (hidden, weight, bias) if t is not None]
    return torch.is_grad_enabled() and any(needs)


def _token_agg_weights(
    mask: torch.Tensor, *, loss_agg: str, norm_length: float | None, global_count: torch.Tensor | float | None,
) -> torch.Tensor:
    """[B, T] fp32 weight ``c_t`` of each token's loss in the aggregated loss (0 outside
    ``mask``): ``loss = sum_t c_t l_t``, so ``d loss / d l_t = c_t = f_b / D`` of
    ``fastrl.ops.aggregation`` (the rule ``policy_loss`` aggregates with)."""
    mf = (mask if mask.dtype == torch.bool else mask != 0).to(torch.float32)
    f_row, inv_d = aggregation_weights(mf.sum(1), loss_agg=loss_agg, norm_length=norm_length,
                                       global_count=global_count)
    return (f_row[:, None] * mf) * inv_d


class _PrecomputedGrads(torch.autograd.Function):
    """Returns ``loss``; its backward hands out gradients computed in the forward pass,
    scaled by ``grad_output`` (in fp32 arithmetic, rounded once to the parameter's dtype: a
    gradient held in bf16/fp16 is then rounded twice unless ``grad_output`` is a power of two).

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
        for i, (g, dt) in enumerate(((gh, dh), (gw, dw), (gb, db)), start=1):
            if g is not None and ctx.needs_input_grad[i]:
                # scaled in the saved dtype and written once in the parameter's: no temporary of the
                # saved gradient's size (the fp32 [V, H] weight gradient is the op's largest buffer)
                out[i] = torch.mul(g, grad_out, out=torch.empty(g.shape, dtype=dt, device=g.device))
        return tuple(out)


def _fused_one_pass(
    hidden, weight, bias, targets_eff, keep, old_logp, advantages, mask, *, ref_logp, rollout_logp, is_weight, config,
    temperature, with_entropy, global_count, counts, rows_impl="torch", chunk_tokens=None,
):
    """fused_linear_policy_loss with the gradients formed in the same pass as the logits.

    d loss / d logp_t = c_t * dl_t/dlogp_t: c_t from ``_token_agg_weights``, dl_t/dlogp_t
    (and dl_t/dentropy_t) from ``policy_loss`` on each token chunk aggregated as a plain
    token sum (the per-token loss formula has one home: ``policy_loss``). The loss value and
    metrics come from one ``policy_loss`` call on the detached log-probs.

    Per token chunk (scored tokens only: compacted first, one host sync on CUDA):
    ``rows_impl="chunked"``: the logits GEMM (fp32 out), ``row_stats``, the chunk's
    per-token gradients, ``row_grad`` writing d loss / d logits (fp32: in place; bf16/fp16
    on CUDA: a buffer of that dtype), ``g @ W`` into grad_hidden's rows and ``g.T @ h``
    added to the fp32 grad_weight: three GEMMs, no recompute. ``rows_impl="torch"``: the
    same in PyTorch ops (the CPU default).
    """
    chunked = rows_impl == "chunked"
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

    def pick(x):
        return None if x is None else x.reshape(-1).index_select(0, idx)

    c_tok = pick(_token_agg_weights(mask, loss_agg=config.loss_agg, norm_length=config.norm_length,
                                    global_count=global_count))
    adv_full = advantages[:, None].expand(B, T) if advantages.dim() == 1 else advantages
    old_w, adv_w, ref_w, roll_w = pick(old_logp), pick(adv_full), pick(ref_logp), pick(rollout_logp)
    isw_w = None if is_weight is None else pick(is_weight.reshape(B, -1).expand(B, T))
    tok_cfg = config.replace(loss_agg="seq-mean-token-sum", norm_length=None)
    loss_backend = "torch" if not chunked else "auto"

    def token_grads(sl, lp_c, ent_c):
        """(c_t dl_t/dlogp_t, c_t dl_t/dentropy_t or None) of the tokens in ``sl``."""
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
                config=tok_cfg, global_seq_count=1.0, backend=loss_backend,
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
    # grad_hidden goes straight to its [B*T, H] rows (no compacted copy held beside it)
    gh_full = torch.zeros(B * T, hd, dtype=dtype, device=hidden.device) if need_h else None
    gw = torch.zeros(V, hd, **f32) if need_w else None
    gb = torch.zeros(V, **f32) if need_b else None
    if chunked:
        step = _lp.chunked_rows(V, n, chunk_tokens)
    else:
        step = _lp.chunk_rows(V, weight_grad_hidden=hd if need_w else 0)
    w_logits = _lp._logits_weight(w2)
    for i in range(0, n, step):
        sl = slice(i, min(i + step, n))
        if chunked:
            gq = _chunk_grad_rows(hw[sl], w_logits, b2, yw[sl].contiguous(), inv_temp, with_entropy, sl, logp_w,
                                  ent_w, token_grads)
        else:
            gq = _chunk_grad_torch(hw[sl], w_logits, b2, yw[sl], inv_temp, with_entropy, sl, logp_w, ent_w,
                                   token_grads, dtype)
        if gb is not None:
            gb += gq.sum(0, dtype=torch.float32)
        if gh_full is not None:
            gh_full.index_copy_(0, idx[sl], torch.mm(gq, w_logits).to(dtype) if chunked else torch.mm(gq, w2))
        if gw is not None:
            if chunked:
                _lp._addmm_f32_(gw, gq.T, hw[sl].to(gq.dtype))
            elif gq.dtype == torch.float32:
                gw.addmm_(gq.T, hw[sl])
            else:
                gw += gq.T @ hw[sl]
        # drop every reference to this chunk's buffer before the next chunk allocates one
        gq = None  # noqa: F841

    logp = torch.zeros(B * T, **f32).index_copy_(0, idx, logp_w).reshape(B, T)
    ent = torch.zeros(B * T, **f32).index_copy_(0, idx, ent_w).reshape(B, T) if with_entropy else None
    with torch.no_grad():
        loss, metrics = policy_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=ent,
                                    rollout_logp=rollout_logp, is_weight=is_weight, config=config, backend=loss_backend,
                                    **counts)
    if gh_full is not None:
        gh_full = gh_full.reshape(B, T, hd)
    if chunked and gw is not None and weight.dtype in (torch.bfloat16, torch.float16):
        # accumulated in fp32, held until backward in the weight's dtype: the fp32 [V, H] buffer
        # (2 GiB at V = 151,936, H = 3,584) is not alive beside the chunk buffers' successors
        # nor beside the gradient handed to autograd
        gw = gw.to(weight.dtype)
    loss = _PrecomputedGrads.apply(loss, hidden, weight, bias, gh_full, gw, gb)
    return loss, metrics


def _chunk_grad_rows(h_c, w_logits, bias, y_c, inv_temp, with_entropy, sl, logp_w, ent_w, token_grads):
    """One chunk of the "chunked" one pass: the logits GEMM, ``row_stats``, the per-token
    gradients, ``row_grad``. Returns d loss / d logits of the chunk (fp32 in place of the
    logits, or a buffer of the GEMM operand dtype) and fills the chunk's log-probs / entropy."""
    from csrc_triton.logprob_rows import row_grad, row_stats

    z = _lp._torch_logits(h_c, w_logits, None, 1.0)
    m, s, w, t = row_stats(z, bias, y_c, inv_temp, with_entropy)
    lse, lp_c, ent_c = _lp._combine(m, s, w, t, None)
    logp_w[sl] = lp_c
    if ent_w is not None:
        ent_w[sl] = ent_c
    gl, ge = token_grads(sl, lp_c, ent_c)
    out = z if w_logits.dtype == torch.float32 else torch.empty(z.shape, dtype=w_logits.dtype, device=z.device)
    return row_grad(z, out, bias, y_c, lse, ent_c if ge is not None else None, gl.contiguous(),
                    ge.contiguous() if ge is not None else None, inv_temp)


def _chunk_grad_torch(h_c, w_logits, b2, yc, inv_temp, with_entropy, sl, logp_w, ent_w, token_grads, dtype):
    """One chunk of the PyTorch one pass (the CPU default): the same quantities as
    ``_chunk_grad_rows`` in PyTorch ops. Returns d loss / d logits in ``dtype``."""
    z = _lp._torch_logits(h_c, w_logits, b2, inv_temp)
    z -= z.amax(1, keepdim=True)  # u - m
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
    return g if dtype == torch.float32 else g.to(dtype)
