"""The KV store of one ``HFGroupSampler`` rollout and the attention entry point that reads it.

:class:`CascadeKV` holds each layer's keys/values in two parts: the distinct prompts, stored once
(``[Hkv, U, P_max, D]``, right-padded to the longest, written by the prefill), and each row's
suffix (``[B, Hkv, capacity, D]``, preallocated and written in place: the tokens a row ran after
its prompt). Its ``attend`` is the attention of every layer of the sampler's forwards: the
packed prefill (causal within each prompt), the decode steps over the row's stored prompt and
its own suffix (``fastrl.ops.decode_attention``: batched PyTorch, or the Triton cascade kernels
with one query per row), and the static-shape steps a CUDA graph captures. The store also keeps
the row layout (which prompt each row reads), narrows itself to the rows still sampling and
widens back, and keeps or copies rows (dropped or forked trajectories of a multi-turn state).

The model reaches the store through transformers' ``AttentionInterface``: :func:`register_attention`
registers :func:`shared_prefix_attention` as ``ATTN_NAME``, and the sampler passes the store in
the forward's keyword arguments under ``KV_KWARG`` (the route transformers uses for its paged cache).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastrl.ops.decode_attention import DecodeAttentionPlan, PrefixRows, padded_prefix_attention, prepare_decode_attention

ATTN_NAME = "fastrl_shared_prefix"
"""The attention implementation's name in transformers' ``AttentionInterface``."""
KV_KWARG = "fastrl_shared_prefix_kv"
"""The forward keyword argument that hands the store to the attention function."""
PREFILL_PAD_WASTE = 2.0
"""The prefill attends the distinct prompts in one right-padded batch when that costs at most
this many times the attention over the prompts alone (``U * P_max^2 <= 2 * sum P^2``), else
one attention call per prompt."""

__all__ = ["ATTN_NAME", "KV_KWARG", "PREFILL_PAD_WASTE", "CascadeKV", "register_attention", "shared_prefix_attention"]


class CascadeKV:
    """Per-layer KV store of one rollout: the distinct prompts (padded) and each row's suffix.

    ``prefix_k[l]``/``prefix_v[l]``: ``[Hkv, U, P, D]``, the ``U`` distinct prompts padded to
    the longest ``P`` (written once by the prefill). ``suffix_k[l]``/``suffix_v[l]``:
    ``[B, Hkv, capacity, D]``, zero-initialised, written in place: row ``b``'s first
    ``suffix_len[b]`` slots hold the keys/values of the tokens it has run after its prompt
    (sampled tokens, and in multi-turn rollouts the appended environment tokens); the last
    slot is a scratch slot that padded query positions write to and nothing reads.

    Narrowed (:meth:`narrow`, by the eager decode once enough rows have stopped): the forwards
    run only some rows, whose suffix rows were moved to the front (``order[i]``: the batch row
    held in suffix row ``i``); ``batch``, ``prefix_of``, ``suffix_len`` and the layout are
    theirs, and the forwards read and write the first ``batch`` suffix rows (views of the
    full tensors). :meth:`widen` restores the batch's order.
    """

    def __init__(self, *, num_layers: int, prompt_lens: list[int], backend: str, device: torch.device):
        self.num_layers = num_layers
        self.prompt_lens = prompt_lens
        self.cu_seqlens = [0]
        for n in prompt_lens:
            self.cu_seqlens.append(self.cu_seqlens[-1] + n)
        self.backend = backend
        self.device = device
        self.P = max(prompt_lens)
        bias = torch.zeros(len(prompt_lens), self.P, device=device)
        for u, n in enumerate(prompt_lens):
            bias[u, n:] = float("-inf")
        self.prefix_bias = bias if any(n < self.P for n in prompt_lens) else None  # None: no prompt is padded
        # the prefill attends all prompts at once, right-padded, unless padding would cost more
        # than PREFILL_PAD_WASTE times the attention of the prompts themselves
        U, P = len(prompt_lens), self.P
        self._prefill_padded = U * P * P <= PREFILL_PAD_WASTE * sum(n * n for n in prompt_lens)
        if self._prefill_padded and U > 1:
            t = torch.arange(P, device=device)
            start = torch.tensor(self.cu_seqlens[:-1], device=device)[:, None]
            n = torch.tensor(prompt_lens, device=device)[:, None]
            self._prefill_index = start + torch.minimum(t[None, :], n - 1)  # [U, P]
            self._prefill_real = (torch.arange(U, device=device)[:, None] * P + t[None, :])[t[None, :] < n]
        self.mode = "prefill"
        self.prefix_k: list[torch.Tensor | None] = [None] * num_layers
        self.prefix_v: list[torch.Tensor | None] = [None] * num_layers
        self.suffix_k: list[torch.Tensor | None] = [None] * num_layers
        self.suffix_v: list[torch.Tensor | None] = [None] * num_layers
        self.capacity = 0
        self.peak_bytes = 0
        self.order: list[int] | None = None  # None: not narrowed
        self._dropped_len: list[int] = []  # narrowed: the suffix length of each row when it was left out
        self.rows_run = 0
        """Rows run by the forwards after the prefill (:meth:`set_forward`), summed over them."""

    # ---- layout of the rows
    def set_rows(self, prefix_of: list[int], *, group_size: int = 1) -> None:
        """Row ``b`` reads prompt ``prefix_of[b]`` (``group_size``: rows come in groups of
        that many consecutive rows with one prompt, which the Triton kernel exploits). Every
        row's suffix is empty."""
        self.full_prefix_of = list(prefix_of)
        self.full_group_size = group_size
        self.order = None
        self._splits: int | None = None  # the Triton prefix split of the full batch, kept when narrowed
        self._layout(self.full_prefix_of, group_size)
        self.suffix_len = [0] * self.batch

    def _layout(self, prefix_of: list[int], group_size: int) -> None:
        """The layout of the rows a forward runs (``batch``: the first rows of the suffix
        tensors); suffix lengths untouched."""
        self.prefix_of = list(prefix_of)
        self.rows = PrefixRows.build(self.prefix_of, len(self.prompt_lens), self.device)
        self.group_size = group_size if self.rows.identity and self.rows.per_prefix == group_size else 1
        self.batch = len(prefix_of)
        first = self.prefix_of[:: self.group_size]
        self._tri_start = torch.tensor([u * self.P for u in first], dtype=torch.int32, device=self.device)
        self._tri_len = torch.tensor([self.prompt_lens[u] for u in first], dtype=torch.int32, device=self.device)
        self._plan: DecodeAttentionPlan | None = None  # made at the layout's first one-token Triton step
        self.prompt_len_rows = torch.tensor([self.prompt_lens[u] for u in self.prefix_of], dtype=torch.long, device=self.device)

    def _permute(self, index: list[int]) -> None:
        """Suffix row ``i`` becomes the current row ``index[i]`` (one ``index_select`` per tensor)."""
        index_t = torch.tensor(index, dtype=torch.long, device=self.device)
        for ts in (self.suffix_k, self.suffix_v):
            for layer, t in enumerate(ts):
                if t is not None:
                    ts[layer] = t.index_select(0, index_t)

    def narrow(self, rows: list[int]) -> None:
        """Run only these rows (ascending indices into the full batch, a subset of the rows run
        now) in the following forwards: their suffix rows are moved first (the others keep
        their keys/values and length, unread, after them) and the layout is theirs.
        :meth:`widen` restores the full batch."""
        current = self.order[: self.batch] if self.order is not None else list(range(self.batch))
        if rows == current:
            return
        kept = set(rows)
        if len(kept) != len(rows) or rows != sorted(rows) or not kept <= set(current):
            raise ValueError(f"narrow: rows must be ascending rows of the current forward {current}, got {rows}")
        if self.order is None:
            self.order = list(range(self.batch))
            self._dropped_len = [0] * self.batch
        for b, n in zip(current, self.suffix_len):
            if b not in kept:
                self._dropped_len[b] = n
        where = {b: i for i, b in enumerate(self.order)}
        order = rows + [b for b in self.order if b not in kept]
        self._permute([where[b] for b in order])
        self.order = order
        length = dict(zip(current, self.suffix_len))
        self.suffix_len = [length[b] for b in rows]
        self._layout([self.full_prefix_of[b] for b in rows], self.full_group_size)

    def widen(self) -> None:
        """Undo :meth:`narrow`: the suffix rows back in the batch's order, the full layout;
        a row left out keeps the suffix length it had when it was left out."""
        if self.order is None:
            return
        lens = self._dropped_len
        for b, n in zip(self.order, self.suffix_len):
            lens[b] = n
        where = {b: i for i, b in enumerate(self.order)}
        self._permute([where[b] for b in range(len(self.order))])
        self.order = None
        self._layout(self.full_prefix_of, self.full_group_size)
        self.suffix_len = lens

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order): the others' suffix memory is released."""
        assert self.order is None, "keep: the store is narrowed (widen() first)"
        if rows == list(range(self.batch)):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for ts in (self.suffix_k, self.suffix_v):
            for layer, t in enumerate(ts):
                if t is not None:
                    ts[layer] = t.index_select(0, index)
        lens = [self.suffix_len[b] for b in rows]
        self.set_rows([self.prefix_of[b] for b in rows])
        self.suffix_len = lens

    def reserve(self, slots: int) -> None:
        """Room for ``slots`` suffix tokens per row (plus the scratch slot); grows by copying."""
        assert self.order is None, "reserve: the store is narrowed (widen() first)"
        need = slots + 1
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity) if self.capacity else need
        for ts in (self.suffix_k, self.suffix_v):
            for layer in range(self.num_layers):
                Hkv, _, _, D = self.prefix_k[layer].shape
                t = self.prefix_k[layer].new_zeros(self.batch, Hkv, new_cap, D)
                if ts[layer] is not None:
                    t[:, :, : self.capacity - 1] = ts[layer][:, :, : self.capacity - 1]
                ts[layer] = t
        self.capacity = new_cap
        self.peak_bytes = max(self.peak_bytes, self.bytes())

    # ---- one forward of T query positions per row (left-padded)
    def set_forward(self, counts: list[int], T: int) -> torch.Tensor:
        """Before a forward of ``T`` positions per row of which the last ``counts[b]`` are row
        ``b``'s new tokens (the rest padding). Returns the ``[B, T]`` position ids."""
        self.mode = "decode"
        B, starts = self.batch, self.suffix_len
        self.rows_run += B
        dev = self.device
        self.T = T
        uniform = all(c == T for c in counts) and all(s == starts[0] for s in starts)
        if uniform:  # every row writes slots [s, s + T): a slice; T == 1 needs no mask
            s0 = starts[0]
            self.write = (s0, s0 + T)
            self.S = s0 + T
            self.suffix_bias = None if T == 1 else torch.zeros(T, self.S, device=dev).masked_fill_(
                torch.arange(self.S, device=dev)[None, :] > (s0 + torch.arange(T, device=dev))[:, None], float("-inf")
            ).expand(B, T, self.S)
            pos = self.prompt_len_rows[:, None] + (s0 + torch.arange(T, device=dev))[None, :]
        else:
            start_t = torch.tensor(starts, dtype=torch.long, device=dev)[:, None]
            pad_t = T - torch.tensor(counts, dtype=torch.long, device=dev)[:, None]
            t = torch.arange(T, device=dev)[None, :]
            rel = t - pad_t  # index among the row's new tokens; < 0 on padding
            real = rel >= 0
            slot = torch.where(real, start_t + rel, torch.full_like(rel, self.capacity - 1))
            self.write = (torch.arange(B, device=dev)[:, None].expand(B, T), slot)
            self.S = max(s + c for s, c in zip(starts, counts))
            j = torch.arange(self.S, device=dev)[None, None, :]
            see = j <= (start_t + rel)[:, :, None]  # padding sees no slot (its output is dropped)
            self.suffix_bias = torch.zeros(B, T, self.S, device=dev).masked_fill_(~see, float("-inf"))
            pos = (self.prompt_len_rows[:, None] + start_t + rel).clamp_min(0)
        self.suffix_len = [s + c for s, c in zip(starts, counts)]
        self._tri_slen = None
        if T == 1 and self.backend == "triton":
            self._tri_slen = torch.tensor(self.suffix_len, dtype=torch.int32, device=dev)
        return pos

    # ---- static-shape decode steps (one token per row; capturable in a CUDA graph)
    def start_static(self) -> None:
        """Before static decode steps: each row's next write slot lives on the device
        (``static_slot``, advanced in place by :meth:`static_step_end`), and attention reads
        the whole suffix capacity under a mask built from it, so no shape or host value
        changes from step to step."""
        dev = self.device
        self.static_slot = torch.tensor(self.suffix_len, dtype=torch.long, device=dev)
        self._static_slen = torch.empty_like(self.static_slot)  # suffix lengths the Triton kernels read
        self._brange = torch.arange(self.batch, device=dev)
        self._slots = torch.arange(self.capacity, device=dev)

    def static_step_begin(self) -> torch.Tensor:
        """Device ops of a static step before the forward; returns the ``[B, 1]`` positions."""
        self.mode = "static"
        if self.backend == "triton":  # the eager step's kernels, lengths from the device
            torch.add(self.static_slot, 1, out=self._static_slen)
        else:
            see = self._slots[None, :] <= self.static_slot[:, None]  # slots written so far plus this one
            self.static_bias = torch.zeros(see.shape, device=self.device).masked_fill_(~see, float("-inf"))[:, None, :]
        return (self.prompt_len_rows + self.static_slot)[:, None]

    def static_step_end(self) -> None:
        self.static_slot.add_(1)

    def bytes(self) -> int:
        total = 0
        for ts in (self.prefix_k, self.prefix_v, self.suffix_k, self.suffix_v):
            for t in ts:
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def _cascade(self, layer: int, query: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, slen: torch.Tensor,
                 scaling: float) -> torch.Tensor:
        """One query per row through the Triton cascade (``[B, Hq, 1, D]`` -> ``[B, 1, Hq, D]``). The
        plan is checked and built at the layout's first step and reused by every layer and step
        after it (no checks or allocation per call); its prefix split is the full batch's. The
        result is the plan's output buffer: the layer's output projection reads it before the
        next layer's call overwrites it."""
        pk, pv = self.prefix_k[layer], self.prefix_v[layer]
        Hkv, U, P, D = pk.shape
        args = (query[:, :, 0], pk.view(Hkv, U * P, D), pv.view(Hkv, U * P, D), self._tri_start, self._tri_len, sk, sv, slen)
        if self._plan is None:
            self._plan = prepare_decode_attention(*args, group_size=self.group_size, scale=scaling, backend="triton",
                                                  max_prefix_len=P, splits=self._splits)
            self._splits = self._plan.splits
        return self._plan(*args).unsqueeze(1)

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        layer = module.layer_idx
        if self.mode == "prefill":
            # query [1, Hq, sum P, D], key/value [1, Hkv, sum P, D]; causal within each prompt
            cu = self.cu_seqlens
            U = len(self.prompt_lens)
            Hkv, D = key.shape[1], key.shape[3]
            gqa = query.shape[1] != key.shape[1]
            if U > 1 and self._prefill_padded:
                # all prompts at once, right-padded to P (pad slots repeat a prompt's last token:
                # causal attention keeps them out of every real query, and the decode steps'
                # prefix_bias masks them); one gather in, one SDPA, one gather out
                P, Hq = self.P, query.shape[1]
                pad_idx = self._prefill_index  # [U, P] packed positions
                pk = key[0][:, pad_idx]  # [Hkv, U, P, D]
                pv = value[0][:, pad_idx]
                out = F.scaled_dot_product_attention(
                    query[0][:, pad_idx].transpose(0, 1), pk.transpose(0, 1), pv.transpose(0, 1), is_causal=True, scale=scaling,
                    enable_gqa=gqa,
                )  # [U, Hq, P, D]
                self.prefix_k[layer], self.prefix_v[layer] = pk, pv
                self.peak_bytes = max(self.peak_bytes, self.bytes())
                out = out.transpose(1, 2).reshape(U * P, Hq, D).index_select(0, self._prefill_real)
                return out[None]  # [1, sum P, Hq, D]
            outs = []
            pk = key.new_zeros(Hkv, U, self.P, D)
            pv = value.new_zeros(Hkv, U, self.P, D)
            for u, (a, b) in enumerate(zip(cu[:-1], cu[1:])):  # once per rollout, not per token
                pk[:, u, : b - a] = key[0, :, a:b]
                pv[:, u, : b - a] = value[0, :, a:b]
                outs.append(
                    F.scaled_dot_product_attention(
                        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=gqa
                    )
                )
            self.prefix_k[layer], self.prefix_v[layer] = pk, pv
            self.peak_bytes = max(self.peak_bytes, self.bytes())
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
            return out.transpose(1, 2)  # [1, sum P, Hq, D]
        # query [B, Hq, T, D], key/value [B, Hkv, T, D]: write the new keys/values in place,
        # into the first B rows of the suffix tensors (all of them unless narrowed)
        sk, sv = self.suffix_k[layer][: self.batch], self.suffix_v[layer][: self.batch]
        if self.mode == "static":  # T == 1, slots and mask from device tensors, the full capacity
            sk[self._brange, :, self.static_slot] = key[:, :, 0]
            sv[self._brange, :, self.static_slot] = value[:, :, 0]
            if self.backend == "triton":  # the same kernels as the eager step, so the same numbers
                return self._cascade(layer, query, sk, sv, self._static_slen, scaling)
            return padded_prefix_attention(
                query, self.prefix_k[layer], self.prefix_v[layer], self.prefix_bias, self.rows, sk, sv, self.static_bias, scale=scaling,
            )
        if isinstance(self.write[0], int):
            a, b = self.write
            sk[:, :, a:b] = key
            sv[:, :, a:b] = value
        else:
            rows, slots = self.write
            sk[rows, :, slots] = key.transpose(1, 2)
            sv[rows, :, slots] = value.transpose(1, 2)
        if self._tri_slen is not None:  # one query per row: the Triton cascade kernels
            return self._cascade(layer, query, sk, sv, self._tri_slen, scaling)
        return padded_prefix_attention(
            query, self.prefix_k[layer], self.prefix_v[layer], self.prefix_bias, self.rows,
            sk[:, :, : self.S], sv[:, :, : self.S], self.suffix_bias, scale=scaling,
        )


def shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry point (registered as ``ATTN_NAME``)."""
    kv: CascadeKV | None = kwargs.get(KV_KWARG)
    if kv is None:
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} only runs inside HFGroupSampler "
            "(it needs the sampler's shared-prefix KV store)"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention layers are not supported by HFGroupSampler")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return kv.attend(module, query, key, value, float(scaling)), None


def register_attention() -> None:
    """Register :func:`shared_prefix_attention` in transformers' ``AttentionInterface`` as ``ATTN_NAME``."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, shared_prefix_attention)

