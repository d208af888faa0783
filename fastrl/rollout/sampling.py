"""Logits to tokens: the logit warping (temperature, top-k, top-p) and the draw with its log-prob.

Sampling and log-probs (:func:`sample_tokens`): the next-token logits are taken in fp32 and
divided by the temperature; top-k then top-p filtering set the dropped tokens to ``-inf``
(both by a partial sort, :func:`warp_logits`); the sampled token's log-prob is ``log_softmax``
of that filtered, tempered distribution (renormalised over the kept tokens) -- the distribution
the token was actually drawn from -- computed at the sampled entry only (``x - max - log sum
exp``), never as a ``[B, V]`` log-softmax. With ``top_k=0, top_p=1`` this equals
``log_softmax(model(input_ids).logits / temperature)`` recomputed by the training forward.
With filtering on, it is larger than that (by ``-log`` of the kept probability mass) and
importance ratios against the unfiltered training distribution are not 1 at the first
step; ``greedy=True`` takes the argmax and reports its log-prob under the same (tempered,
filtered) distribution. Draws: with per-row uniforms (per-prompt seeds), the inverse CDF of
those uniforms over ``exp(x - max)``, found by a two-level fp64 search (block sums, then one
block: no full-vocabulary fp64 cumulative sum), which picks the same tokens as a full fp64 CDF
(bar thresholds within fp64 rounding of a boundary); else ``torch.multinomial`` with the
given generator.
"""

from __future__ import annotations

import torch

from fastrl.rollout.base import SamplingConfig

CDF_BLOCK = 1024
"""Tokens per block of the two-level inverse-CDF search (block sums, then one block)."""
CDF_CAST_ELEMENTS = 1 << 17
"""The block sums are taken over rows holding at most this many entries at a time (their fp64
cast, 1 MiB, stays in cache instead of a fresh ``[B, V]`` fp64 buffer each step)."""
TOP_P_FIRST_K = 1024
"""Candidates the top-p filter sorts first (the full sort runs only if their mass is short of ``top_p``)."""

__all__ = ["CDF_BLOCK", "CDF_CAST_ELEMENTS", "TOP_P_FIRST_K", "process_logits", "sample_tokens", "warp_logits"]


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probs ``[B, V]`` (fp32) of the distribution tokens are drawn from:
    ``log_softmax(warp_logits(logits, sampling))``."""
    return torch.log_softmax(warp_logits(logits, sampling), dim=-1)


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, *, uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None,
    work: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[B, V]`` and its log-prob under the processed
    distribution (``process_logits``), without materialising that ``[B, V]`` log-softmax.

    ``x = warp_logits(logits)``; ``greedy``: ``argmax x``. Otherwise ``e = exp(x - max x)``
    (unnormalised probabilities, one pass) is drawn from: by the inverse CDF at ``uniforms``
    (``[B]`` in [0, 1), fp64; the two-level search of :func:`_inverse_cdf_sample`, whose fp64
    block sums also give the row total), else ``torch.multinomial`` with ``generator``. The
    log-prob is ``x[tok] - max x - log(sum e)``: log-softmax's own formula at one entry.
    ``work``: an fp32 buffer of at least ``[B, V]`` for ``e`` (reused across steps).
    """
    x = warp_logits(logits, sampling)
    if sampling.greedy:
        tok = torch.argmax(x, dim=-1)
        return tok, x.gather(1, tok[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
    m = x.amax(-1, keepdim=True)
    e = (x - m if work is None else torch.sub(x, m, out=work[: x.shape[0], : x.shape[1]])).exp_()
    if uniforms is not None:
        tok, total = _inverse_cdf(e, uniforms)
    else:
        tok = torch.multinomial(e, 1, generator=generator)[:, 0]
        total = e.sum(-1, dtype=torch.float64)
    logp = x.gather(1, tok[:, None])[:, 0] - m[:, 0] - torch.log(total).float()
    return tok, logp


def warp_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The logits of the distribution tokens are drawn from ``[B, V]`` (fp32, not normalised).

    ``logits / temperature``, then top-k (ties with the k-th value are kept), then top-p
    (the smallest set of most likely tokens whose probability reaches ``top_p``; the most
    likely token is always kept); dropped tokens get ``-inf``; ``log_softmax`` renormalises.
    Both filters use a partial sort: top-k a ``topk``; top-p the ``TOP_P_FIRST_K`` most
    likely tokens, and the full sort only where some row's nucleus reaches past them (a
    flat distribution). The kept set is the full sort's, bar a boundary token whose
    preceding mass is within fp32 rounding of ``top_p`` (the candidates' probabilities are
    normalised by the whole row's log-sum-exp rather than the sorted row's sum).
    """
    x = logits.float()
    if sampling.temperature != 1.0:  # x / 1 == x: skip a full-vocabulary pass
        x = x / sampling.temperature
    V = x.shape[-1]
    if 0 < sampling.top_k < V:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        k = min(TOP_P_FIRST_K, V)
        top, order = torch.topk(x, k, dim=-1)  # sorted, most likely first
        probs = (top - torch.logsumexp(x, dim=-1, keepdim=True)).exp()
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p  # mass of the strictly more likely tokens
        if k < V and bool(drop_sorted[:, -1].all()):  # every row's nucleus lies inside the candidates
            keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, order, ~drop_sorted)
            x = x.masked_fill(~keep, float("-inf"))
        else:  # a nucleus reaches past them (a flat distribution): the full sort, as before
            sorted_x, order = torch.sort(x, dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= sampling.top_p
            x = x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return x


def _inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor, *, block: int = CDF_BLOCK) -> torch.Tensor:
    """Row b's token: the first index whose cumulative probability exceeds ``u[b] * total``
    (``u`` in [0, 1)). A zero-probability token is never picked.

    Two-level search in fp64: the sums of blocks of ``block`` tokens, the block where the
    threshold falls, then the cumulative sum inside that one block. The same index as a
    full-vocabulary fp64 cumulative sum except where the threshold lies within fp64
    rounding (~1e-13 of the total) of a boundary, without its ``[B, V]`` fp64 buffer.
    """
    return _inverse_cdf(probs, u, block=block)[0]


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, *, block: int = CDF_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_inverse_cdf_sample`, also returning each row's fp64 total ``[B]``."""
    Bn, V = probs.shape
    if V <= block:  # one block: the full fp64 CDF itself
        cdf = probs.double().cumsum(-1)
        total = cdf[:, -1]
        x = torch.minimum(u.to(torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, x[:, None], right=True)[:, 0].clamp(max=V - 1), total
    nb = -(-V // block)
    full = (V // block) * block
    sums = probs.new_empty(Bn, nb, dtype=torch.float64)
    rows = max(1, CDF_CAST_ELEMENTS // max(full, 1))  # the fp64 cast of a few rows at a time stays in cache
    for r in range(0, Bn if full else 0, rows):
        torch.sum(probs[r : r + rows, :full].reshape(-1, V // block, block), -1, dtype=torch.float64, out=sums[r : r + rows, : V // block])
    if full < V:
        torch.sum(probs[:, full:], -1, dtype=torch.float64, keepdim=True, out=sums[:, V // block :])
    cdf_blocks = sums.cumsum(-1)  # [B, nb]
    total = cdf_blocks[:, -1]
    x = torch.minimum(u.to(torch.float64) * total, torch.nextafter(total, torch.zeros_like(total)))
    k = torch.searchsorted(cdf_blocks, x[:, None], right=True)[:, 0].clamp(max=nb - 1)
    offset = torch.where(k > 0, cdf_blocks.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(total))
    idx = k[:, None] * block + torch.arange(block, device=probs.device)[None, :]  # [B, block]
    inside = idx < V
    p = torch.where(inside, probs.gather(1, idx.clamp(max=V - 1)), torch.zeros((), dtype=probs.dtype, device=probs.device))
    cdf = p.double().cumsum(-1) + offset[:, None]
    j = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]
    # j == block only if rounding put the threshold past the block's own sum: its last likely token
    last = torch.where(p > 0, torch.arange(block, device=probs.device)[None, :], -1).amax(-1)
    j = torch.where(j >= block, last, j)
    return (k * block + j).clamp(max=V - 1), total

