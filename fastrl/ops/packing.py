"""Padding-free packed sequences in the loss path: ``PackedLayout`` and the ops' packed entry.

A micro-batch of ``S`` variable-length sequences is packed back to back into ``N`` tokens:
per-token tensors are ``[1, N]`` (or ``[N]``) and the boundaries are ``cu_seqlens``
(int32, ``[S + 1]``, ``cu_seqlens[s]`` = first token of sequence ``s``, ``cu_seqlens[S] = N``),
the convention of flash-attention's varlen kernels. ``PackedLayout`` is built from them
once per micro-batch on the host, before any device work, and reused by every op:
``policy_loss``, ``value_loss``, ``gae`` and ``discounted_returns`` take it (or the
``cu_seqlens`` themselves) as ``cu_seqlens=`` and give the same loss, metrics and
gradients as on the padded ``[S, T]`` rows (``T`` = longest sequence).

How the ops use it: each packed per-token input is scattered once into its ``[S, T]`` row
view (one ``index_copy`` with the layout's prebuilt index; differentiable, its backward is
one gather) and the padded op runs unchanged, so every aggregation mode, GSPO's sequence
ratio, sequence-level IS weights, global counts and both backends behave exactly as on
padded rows, with no second implementation to keep in step. The cost is the ``[S, T]``
copies of a handful of per-token float vectors: O(S * T) floats, negligible next to the
activations that produced them (a ``[N, hidden]`` tensor per layer). Nothing reads the
layout's values on the host inside an op (no device synchronisation).

``PackedGroups`` (``fastrl.ops.shared_prefix_attention``) packs the *model input* of
shared-prefix groups; its ``M`` scored tokens, in sample order, are a packed sequence set
whose ``PackedLayout`` is ``PackedLayout.from_lengths(packed.completion_lens)``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["PackedLayout", "as_packed_layout", "packed_to_rows"]


def _as_int(name: str, value: object) -> int:
    """An int from an integer-like host value (int, numpy integer); bools and floats raise."""
    if isinstance(value, (bool, float)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where ``S`` sequences lie in a packed ``[1, N]`` row, and the map to ``[S, T]`` rows.

    Build it once per micro-batch from host data (``from_cu_seqlens`` or ``from_lengths``)
    and pass it as ``cu_seqlens=`` to every op of the loss path; the ops then never read
    its values on the host. Sequences may have length 0 (they own no token and count as
    empty rows: they add nothing to any loss, metric or count, like a fully masked padded
    row). Token ``i`` of the packed row is token ``positions[i]`` of sequence
    ``seq_ids[i]``, i.e. element ``padded_index[i] = seq_ids[i] * max_len + positions[i]``
    of the flattened ``[S, max_len]`` rows. The tensors live on ``device``; ``on(device)``
    gives (and caches) the same layout on another device.
    """

    seq_lens: tuple[int, ...]
    """Length of each sequence (>= 0), in packed order."""
    num_tokens: int
    """N = sum(seq_lens): the packed row's length."""
    max_len: int
    """T = max(seq_lens): the width of the padded ``[S, T]`` view."""
    cu_seqlens: torch.Tensor
    """int32 ``[S + 1]``: sequence boundaries (0, then the cumulative lengths)."""
    seq_ids: torch.Tensor
    """int64 ``[N]``: the sequence of each packed token."""
    positions: torch.Tensor
    """int64 ``[N]``: each token's position in its sequence (0-based)."""
    padded_index: torch.Tensor
    """int64 ``[N]``: each token's element in the flattened ``[S, T]`` view."""
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def device(self) -> torch.device:
        return self.padded_index.device

    @classmethod
    def from_lengths(cls, seq_lens: Sequence[int], *, device: torch.device | str | None = None) -> "PackedLayout":
        """The layout of sequences of the given lengths (ints >= 0, at least one)."""
        if isinstance(seq_lens, torch.Tensor):
            raise TypeError("seq_lens must be a sequence of ints (host data), got a tensor; use from_cu_seqlens")
        try:
            lens = tuple(seq_lens)
        except TypeError as e:
            raise TypeError(f"seq_lens must be a sequence of ints, got {type(seq_lens).__name__}") from e
        if not lens:
            raise ValueError("seq_lens must hold at least one sequence")
        lens = tuple(_as_int(f"seq_lens[{s}]", n) for s, n in enumerate(lens))
        for s, n in enumerate(lens):
            if n < 0:
                raise ValueError(f"seq_lens[{s}] must be >= 0, got {n}")
        device = torch.device("cpu") if device is None else torch.device(device)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        S, N, T = len(lens), int(sum(lens)), max(lens)
        cu = torch.zeros(S + 1, dtype=torch.int64)
        torch.cumsum(lens_t, 0, out=cu[1:])
        seq_ids = torch.repeat_interleave(torch.arange(S), lens_t, output_size=N)
        positions = torch.arange(N) - cu[:-1].repeat_interleave(lens_t, output_size=N)
        return cls(
            seq_lens=lens,
            num_tokens=N,
            max_len=T,
            cu_seqlens=cu.to(device=device, dtype=torch.int32),
            seq_ids=seq_ids.to(device),
            positions=positions.to(device),
            padded_index=(seq_ids * T + positions).to(device),
        )

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | Sequence[int], *, device: torch.device | str | None = None) -> "PackedLayout":
        """The layout of the boundaries ``cu_seqlens`` (``[S + 1]`` ints: 0, non-decreasing;
        equal neighbours are an empty sequence). A tensor is read on the host: on a GPU
        that is one device->host copy, so build the layout once per micro-batch, before
        the ops (which accept only host data or a layout). ``device`` defaults to the
        tensor's device (CPU for a list)."""
        if isinstance(cu_seqlens, torch.Tensor):
            if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
                raise TypeError(f"cu_seqlens must be an integer tensor (int32 by convention), got {cu_seqlens.dtype}")
            if cu_seqlens.dim() != 1:
                raise ValueError(f"cu_seqlens must be 1-D [S + 1], got shape {tuple(cu_seqlens.shape)}")
            if device is None:
                device = cu_seqlens.device
            cu = cu_seqlens.tolist()
        else:
            try:
                cu = list(cu_seqlens)
            except TypeError as e:
                raise TypeError(f"cu_seqlens must be an integer tensor or a sequence of ints, got {type(cu_seqlens).__name__}") from e
            cu = [_as_int(f"cu_seqlens[{i}]", c) for i, c in enumerate(cu)]
        if len(cu) < 2:
            raise ValueError(f"cu_seqlens must have S + 1 >= 2 entries (at least one sequence), got {len(cu)}")
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
        lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        for s, n in enumerate(lens):
            if n < 0:
                raise ValueError(
                    f"cu_seqlens must be non-decreasing, got cu_seqlens[{s}] = {cu[s]} > cu_seqlens[{s + 1}] = {cu[s + 1]}")
        return cls.from_lengths(lens, device=device)

    def on(self, device: torch.device | str) -> "PackedLayout":
        """This layout with its tensors on ``device`` (cached: one copy per device)."""
        device = torch.device(device)
        if device == self.device:
            return self
        if device not in self._on_device:
            self._on_device[device] = PackedLayout(
                seq_lens=self.seq_lens, num_tokens=self.num_tokens, max_len=self.max_len,
                cu_seqlens=self.cu_seqlens.to(device), seq_ids=self.seq_ids.to(device),
                positions=self.positions.to(device), padded_index=self.padded_index.to(device),
            )
        return self._on_device[device]

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``[N]`` or ``[1, N]`` -> ``[S, T]`` rows, zero (``False``) past each
        sequence's end; same dtype, differentiable (the backward gathers the packed tokens)."""
        flat = x.reshape(self.num_tokens)
        index = self.on(x.device).padded_index
        return flat.new_zeros(self.num_seqs * self.max_len).index_copy(0, index, flat).view(self.num_seqs, self.max_len)

    def to_packed(self, rows: torch.Tensor, *, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
        """``[S, T]`` rows -> their packed ``[N]`` tokens (reshaped to ``shape`` if given)."""
        if tuple(rows.shape) != (self.num_seqs, self.max_len):
            raise ValueError(f"rows must have shape (S, T) = {(self.num_seqs, self.max_len)}, got {tuple(rows.shape)}")
        out = rows.reshape(-1).index_select(0, self.on(rows.device).padded_index)
        return out if shape is None else out.reshape(shape)


def as_packed_layout(cu_seqlens: "PackedLayout | torch.Tensor | Sequence[int]") -> PackedLayout:
    """A ``PackedLayout`` as is, or one built from host ``cu_seqlens`` (a list or a CPU
    tensor). ``cu_seqlens`` on a GPU raises: reading it would synchronise the op with the
    host; build ``PackedLayout.from_cu_seqlens`` once per micro-batch instead."""
    if isinstance(cu_seqlens, PackedLayout):
        return cu_seqlens
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type not in ("cpu", "meta"):
        raise ValueError(
            f"cu_seqlens is on {cu_seqlens.device}: an op would have to read it on the host (a device sync). "
            "Build fastrl.ops.PackedLayout.from_cu_seqlens(cu_seqlens) once per micro-batch and pass that as cu_seqlens=")
    return PackedLayout.from_cu_seqlens(cu_seqlens)


def packed_to_rows(
    cu_seqlens: "PackedLayout | torch.Tensor | Sequence[int]",
    *,
    per_sequence: tuple[str, ...] = (),
    **tensors: torch.Tensor | None,
) -> tuple[PackedLayout, tuple[torch.Tensor | None, ...]]:
    """Validate packed inputs and return ``(layout, their [S, T] row views)`` in argument order.

    Every tensor (``None`` passes through) must have the shape of the first one, ``[N]`` or
    ``[1, N]`` with ``N = cu_seqlens[-1]``; the names in ``per_sequence`` may instead be
    ``[S]`` (one value per sequence; passed through unchanged). With ``[N]`` inputs and
    ``N == S`` the two readings coincide only if every sequence has one token; otherwise
    (empty sequences) a 1-D ``[N]`` per-sequence name raises: pass ``[1, N]`` inputs.
    """
    layout = as_packed_layout(cu_seqlens)
    N, S = layout.num_tokens, layout.num_seqs
    shape: tuple[int, ...] | None = None
    out: list[torch.Tensor | None] = []
    for name, x in tensors.items():
        if x is None:
            out.append(None)
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if shape is None:
            shape = tuple(x.shape)
            if shape not in ((N,), (1, N)):
                raise ValueError(
                    f"{name} must be packed as [N] or [1, N] with N = cu_seqlens[-1] = {N} tokens, got shape {shape}")
        if name in per_sequence and shape == (N,) == (S,) and layout.max_len != 1:
            raise ValueError(
                f"{name} of shape ({N},) is ambiguous: N = S = {N} but not every sequence has one token; "
                "pass the per-token inputs as [1, N] (then a per-sequence tensor is [S])")
        if tuple(x.shape) == shape:
            out.append(layout.to_padded(x))
        elif name in per_sequence and tuple(x.shape) == (S,):
            out.append(x)
        else:
            also = f" or (S,) = {(S,)}" if name in per_sequence else ""
            raise ValueError(f"{name} must have the packed shape {shape}{also}, got {tuple(x.shape)}")
    return layout, tuple(out)
