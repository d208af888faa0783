"""The frozen reference policy, held in memory or on disk between its passes.

The reference policy scores each rollout once per step (``ref_logp``) and is idle for the
rest of the step; in memory it costs a full copy of the weights during the whole update,
where the process's peak is (parameters, gradients, AdamW's two moments and the reference:
five copies of the weights). ``ReferencePolicy(module, offload_path=...)`` keeps the weights
in a file instead (``torch.save`` of the parameters, fp32 as trained), maps it read-only
(``torch.load(mmap=True)``) for the duration of ``resident()`` and drops the mapping after,
so the update runs with four copies. The values are the same tensors bit for bit (the file
is written once from the in-memory reference), so the reference log-probs do not change;
the cost is reading the file once per step (from the page cache after the first step).

``offload_path=None`` keeps the module in memory (``resident()`` yields it as is).
The offload is for a single process: under torchrun every rank would need the file.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["OFFLOAD_FILE", "REFERENCE_OFFLOADS", "ReferencePolicy", "offload_reference"]

REFERENCE_OFFLOADS = ("auto", "off", "disk")
"""``TrainConfig.reference_offload`` values: auto (disk for a single-process CPU run), off (in memory), disk."""

OFFLOAD_FILE = "offloaded_weights.pt"
"""The reference's weights file, in the run's ``reference/`` directory (beside its HF copy)."""


def offload_reference(mode: str, *, device: torch.device, sharded: bool) -> bool:
    """Whether the reference's weights live on disk between passes: ``disk`` (single process
    only), ``off`` never, ``auto`` on a single-process CPU run (no device-to-host copy per
    step there, and the reference is a fifth copy of the weights at the update's peak)."""
    if mode == "off" or sharded:
        return False
    return mode == "disk" or device.type == "cpu"


class ReferencePolicy:
    """A frozen reference module whose parameters are in memory only inside ``resident()``
    when ``offload_path`` is given (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, *, offload_path: Path | None):
        self._module = module.eval().requires_grad_(False)
        self.offload_path = offload_path
        if offload_path is None:
            return
        self._params = dict(module.named_parameters())  # tied weights appear once (named_parameters dedups)
        os.makedirs(offload_path.parent, exist_ok=True)
        tmp = offload_path.with_suffix(".tmp")
        torch.save({name: p.detach() for name, p in self._params.items()}, tmp)
        os.replace(tmp, offload_path)
        self._release()

    @property
    def module(self) -> torch.nn.Module:
        """The reference module (its parameters are empty outside ``resident()`` when offloaded)."""
        return self._module

    @property
    def offloaded(self) -> bool:
        return self.offload_path is not None

    def _release(self) -> None:
        for p in self._params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    @contextlib.contextmanager
    def resident(self) -> Iterator[torch.nn.Module]:
        """The reference module with its weights in memory, for the duration of the block."""
        if self.offload_path is None:
            yield self._module
            return
        state = torch.load(self.offload_path, mmap=True, weights_only=True, map_location="cpu")
        try:
            for name, p in self._params.items():
                t = state[name]
                p.data = t if t.device == p.device else t.to(p.device)
            del state
            yield self._module
        finally:
            self._release()
