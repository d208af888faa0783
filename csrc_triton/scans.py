"""Reverse scans along the sequence (GAE, discounted returns) in one Triton launch.

The recursion
-------------
Going backwards in time, the GAE state ``s = (A_next, V_next)`` is updated by an affine map
per token::

    masked in :  A' = gamma*lam * A + gamma * V + (r - v)      V' = v
    masked out:  A' = A                                        V' = V

i.e. ``s_t = M_t s_{t+1} + c_t`` with an upper-triangular ``M_t = [[p, q], [0, u]]``:
``(p, q, u) = (gamma*lam, gamma, 0)`` and ``c = (r - v, v)`` where masked in, the identity
``(1, 0, 1)``, ``c = 0`` where masked out. Upper-triangular affine maps are closed under
composition, so a map is 5 numbers ``(p, q, u, c1, c2)`` and composing two of them is an
associative operator -- the masked "last-seen value" carry (``V_next`` = value at the next
masked-in token) rides inside the same scan as the advantage. ``s_t`` is the composition
``F_t o F_{t+1} o ... o F_{T-1}`` applied to ``s_T = 0``; the output is ``A[t] = c1`` of
that composition where masked in. Discounted returns are the scalar case
``(p, c) = (gamma, r)`` (the kernel's ``HAS_VALUES=False``). No division anywhere: only
products of numbers in [0, 1], so small ``gamma*lam`` underflows gracefully to 0.

One launch, parallel over sequences and over chunks of time
------------------------------------------------------------
Each program owns one chunk of ``BLOCK`` tokens of one row. It

1. takes a ticket from an atomic counter (the order programs actually started in) and maps
   it to ``(row, chunk)`` with chunks of a row handed out last-to-first, so a program only
   ever waits on programs that started before it (no deadlock on a GPU, and the sequential
   Triton interpreter never waits at all);
2. scans its chunk locally with ``tl.associative_scan(..., reverse=True)``;
3. publishes its chunk aggregate (flag 1), then looks back over the chunks to its right
   (decoupled look-back, Merrill & Garland 2016): an aggregate (flag 1) is folded in and the
   walk continues, an inclusive state (flag 2) ends the walk;
4. publishes its own inclusive state (flag 2) and writes its outputs.

Scratch: an int32 status buffer of ``B * n_chunks + 1`` words that must be zero at launch
(the launcher allocates it with ``torch.zeros``), and float32 buffers for the aggregates
and inclusive states. Outputs are float32; inputs may be any float dtype, any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per chunk on a GPU, whatever the row length: a chunk that followed T compiled the
# kernel again as the padded length changed. 1024 lanes at 4 warps keep 8 tokens per thread
# for the in-register scan. Shorter rows only mask lanes: ALU work on idle lanes, no memory
# traffic, and a short row is one chunk that needs no look-back (not timed: no GPU was at
# hand; a compile that a T-dependent chunk triggers costs 0.5-1 s).
DEFAULT_BLOCK = 1024


@triton.jit
def _compose5(pa, qa, ua, c1a, c2a, pb, qb, ub, c1b, c2b):
    # b o a: apply a (the later tokens) first, then b.
    return (
        pb * pa,
        pb * qa + qb * ua,
        ub * ua,
        pb * c1a + qb * c2a + c1b,
        ub * c2a + c2b,
    )


@triton.jit
def _compose2(pa, ca, pb, cb):
    return pb * pa, pb * ca + cb


# The chunk and tile counts only index the status/scratch words: exempt from the JIT's
# integer specialisation (== 1, % 16), which would otherwise compile per batch shape.
@triton.jit(do_not_specialize=["n_chunks", "n_tiles"])
def _reverse_affine_scan_kernel(
    r_ptr, v_ptr, m_ptr,
    adv_ptr, ret_ptr,
    agg_ptr, inc_ptr, status_ptr,
    T, n_chunks, n_tiles,
    stride_rb, stride_rt, stride_vb, stride_vt, stride_mb, stride_mt,
    gamma, gamma_lam,
    BLOCK: tl.constexpr,
    HAS_VALUES: tl.constexpr,
    PUBLISH_EVERY: tl.constexpr,
):
    # 1. ticket -> (row, chunk); chunks of a row are handed out from the end.
    ticket = tl.atomic_add(status_ptr + n_tiles, 1)
    row = ticket // n_chunks
    chunk = n_chunks - 1 - (ticket - row * n_chunks)
    tile_base = row * n_chunks
    row64 = row.to(tl.int64)

    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    m = tl.load(m_ptr + row64 * stride_mb + offs * stride_mt, mask=inb, other=0) != 0
    r = tl.load(r_ptr + row64 * stride_rb + offs * stride_rt, mask=inb, other=0.0).to(tl.float32)

    # 2. per-token maps and the local reverse scan.
    if HAS_VALUES:
        v = tl.load(v_ptr + row64 * stride_vb + offs * stride_vt, mask=inb, other=0.0).to(tl.float32)
        p = tl.where(m, gamma_lam, 1.0)
        q = tl.where(m, gamma, 0.0)
        u = tl.where(m, 0.0, 1.0)
        c1 = tl.where(m, r - v, 0.0)
        c2 = tl.where(m, v, 0.0)
        p, q, u, c1, c2 = tl.associative_scan((p, q, u, c1, c2), 0, _compose5, reverse=True)
    else:
        p = tl.where(m, gamma, 1.0)
        c1 = tl.where(m, r, 0.0)
        p, c1 = tl.associative_scan((p, c1), 0, _compose2, reverse=True)

    # The chunk aggregate is the scan's first element (it composes the whole chunk).
    first = tl.arange(0, BLOCK) == 0
    ap = tl.sum(tl.where(first, p, 0.0), 0)
    ac1 = tl.sum(tl.where(first, c1, 0.0), 0)
    if HAS_VALUES:
        aq = tl.sum(tl.where(first, q, 0.0), 0)
        au = tl.sum(tl.where(first, u, 0.0), 0)
        ac2 = tl.sum(tl.where(first, c2, 0.0), 0)

    # 3. publish the aggregate, then look back over the chunks to the right.
    tile = tile_base + chunk
    tl.store(agg_ptr + tile * 5 + 0, ap)
    tl.store(agg_ptr + tile * 5 + 3, ac1)
    if HAS_VALUES:
        tl.store(agg_ptr + tile * 5 + 1, aq)
        tl.store(agg_ptr + tile * 5 + 2, au)
        tl.store(agg_ptr + tile * 5 + 4, ac2)
    tl.atomic_xchg(status_ptr + tile, 1, sem="release")

    # Running composition (rp, rq, ru, rc1, rc2) of the chunks passed so far; identity at start.
    zero = gamma * 0.0  # a float32 scalar (gamma is finite)
    rp = zero + 1.0
    rq = zero
    ru = zero + 1.0
    rc1 = zero
    rc2 = zero
    carry_a = zero
    carry_v = zero
    j = chunk + 1
    pending = j < n_chunks
    while pending:
        flag = tl.atomic_add(status_ptr + tile_base + j, 0, sem="acquire")
        is_inc = flag == 2
        is_agg = flag == 1
        jt = tile_base + j
        # Inclusive state of chunk j (the state entering it from the right, applied through it).
        sa = tl.load(inc_ptr + jt * 2 + 0, mask=is_inc, other=0.0, volatile=True)
        carry_a = tl.where(is_inc, rp * sa + rc1, carry_a)
        if HAS_VALUES:
            sv = tl.load(inc_ptr + jt * 2 + 1, mask=is_inc, other=0.0, volatile=True)
            carry_a = tl.where(is_inc, rp * sa + rq * sv + rc1, carry_a)
            carry_v = tl.where(is_inc, ru * sv + rc2, carry_v)
        # Aggregate only: fold chunk j into the running composition (j is applied first).
        gp = tl.load(agg_ptr + jt * 5 + 0, mask=is_agg, other=1.0, volatile=True)
        gc1 = tl.load(agg_ptr + jt * 5 + 3, mask=is_agg, other=0.0, volatile=True)
        if HAS_VALUES:
            gq = tl.load(agg_ptr + jt * 5 + 1, mask=is_agg, other=0.0, volatile=True)
            gu = tl.load(agg_ptr + jt * 5 + 2, mask=is_agg, other=1.0, volatile=True)
            gc2 = tl.load(agg_ptr + jt * 5 + 4, mask=is_agg, other=0.0, volatile=True)
            np_, nq, nu, nc1, nc2 = _compose5(gp, gq, gu, gc1, gc2, rp, rq, ru, rc1, rc2)
            rq = tl.where(is_agg, nq, rq)
            ru = tl.where(is_agg, nu, ru)
            rc2 = tl.where(is_agg, nc2, rc2)
        else:
            np_, nc1 = _compose2(gp, gc1, rp, rc1)
        rp = tl.where(is_agg, np_, rp)
        rc1 = tl.where(is_agg, nc1, rc1)
        j = tl.where(is_agg, j + 1, j)
        pending = flag != 2

    # 4. own inclusive state, then the outputs. (PUBLISH_EVERY > 1 is a test hook: most chunks
    # then stay at flag 1, so look-backs must fold aggregates -- a path the sequential
    # interpreter otherwise never takes. The last chunk always publishes, so it stays correct.)
    if (chunk % PUBLISH_EVERY == 0) | (chunk == n_chunks - 1):
        if HAS_VALUES:
            tl.store(inc_ptr + tile * 2 + 0, ap * carry_a + aq * carry_v + ac1)
            tl.store(inc_ptr + tile * 2 + 1, au * carry_v + ac2)
        else:
            tl.store(inc_ptr + tile * 2 + 0, ap * carry_a + ac1)
        tl.atomic_xchg(status_ptr + tile, 2, sem="release")

    out_offs = row64 * T + offs
    if HAS_VALUES:
        a = p * carry_a + q * carry_v + c1
        tl.store(adv_ptr + out_offs, tl.where(m, a, 0.0), mask=inb)
        tl.store(ret_ptr + out_offs, tl.where(m, a + v, 0.0), mask=inb)
    else:
        a = p * carry_a + c1
        tl.store(adv_ptr + out_offs, tl.where(m, a, 0.0), mask=inb)


def _launch(rewards, values, mask, gamma, gamma_lam, block, publish_every=1):
    B, T = rewards.shape
    block = int(block)
    if block < 2 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 2, got {block}")
    if rewards.device.type == "cpu":
        # The interpreter (CPU) scans element by element in Python and compiles nothing: there
        # a chunk shrinks to the row. On a GPU it stays fixed, so no compile key follows T.
        block = min(block, max(16, triton.next_power_of_2(T)))
    n_chunks = triton.cdiv(T, block)
    n_tiles = B * n_chunks
    dev = rewards.device
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    adv = torch.empty(B, T, dtype=torch.float32, device=dev)
    ret = torch.empty(B, T, dtype=torch.float32, device=dev) if values is not None else adv
    agg = torch.empty(n_tiles * 5, dtype=torch.float32, device=dev)
    inc = torch.empty(n_tiles * 2, dtype=torch.float32, device=dev)
    status = torch.zeros(n_tiles + 1, dtype=torch.int32, device=dev)
    v = values if values is not None else rewards
    num_warps = 4 if block <= 1024 else 8
    _reverse_affine_scan_kernel[(n_tiles,)](
        rewards, v, mask,
        adv, ret,
        agg, inc, status,
        T, n_chunks, n_tiles,
        rewards.stride(0), rewards.stride(1), v.stride(0), v.stride(1), mask.stride(0), mask.stride(1),
        float(gamma), float(gamma_lam),
        BLOCK=block, HAS_VALUES=values is not None, PUBLISH_EVERY=int(publish_every),
        num_warps=num_warps,
    )
    return adv, ret


def gae_fwd(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
    block: int = DEFAULT_BLOCK, publish_every: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Un-whitened GAE ``(advantages, returns)``, float32 ``[B, T]``; inputs ``[B, T]``, any strides.

    ``block`` is the chunk length (a power of two; fixed on a GPU, so the compile key does not
    follow T; under the CPU interpreter rows shorter than it use the next power of two >= T,
    at least 16); ``publish_every`` is a test hook (see the kernel).
    """
    return _launch(rewards, values, mask, gamma, gamma * lam, block, publish_every)


def discounted_returns_fwd(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, block: int = DEFAULT_BLOCK,
    publish_every: int = 1,
) -> torch.Tensor:
    """Discounted reward-to-go, float32 ``[B, T]``; inputs ``[B, T]``, any strides."""
    adv, _ = _launch(rewards, None, mask, gamma, gamma, block, publish_every)
    return adv
