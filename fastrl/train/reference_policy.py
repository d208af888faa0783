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

The file is trusted only as written: its size and CRC-32 are recorded when it is written and
checked before every pass (the CRC reads pages the pass maps anyway; about 40 ms for the 160 MB
of a 151,936-entry vocabulary at hidden 256), and the mapped tensors' names, shapes and dtypes
are checked against the module's. A file that was deleted, truncated, replaced or rewritten
(another process in the run directory, a full disk, a damaged sector) is restored from
``restore`` (the reference's saved HF copy, ``load_reference``) and rewritten, with a
warning; with no ``restore`` it raises ``ReferenceOffloadError`` naming the file.
"""

from __future__ import annotations

import contextlib
import copy
import mmap
import os
import warnings
import zlib
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from fastrl.errors import InputError

__all__ = ["OFFLOAD_FILE", "REFERENCE_OFFLOADS", "ReferenceOffloadError", "ReferencePolicy", "load_reference", "offload_reference"]

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


class ReferenceOffloadError(RuntimeError):
    """The reference's offloaded weights file is missing or not the one written, and there is
    nothing to restore it from."""


CRC_CHUNK = 1 << 24
"""Bytes per ``zlib.crc32`` call over the mapped file (bounded slices of the mapping)."""


def _file_signature(path: Path) -> tuple[int, int]:
    """``(size, CRC-32)`` of the file's bytes."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0, 0
        crc = 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            for start in range(0, size, CRC_CHUNK):
                crc = zlib.crc32(view[start:start + CRC_CHUNK], crc)
    return size, crc


class ReferencePolicy:
    """A frozen reference module whose parameters are in memory only inside ``resident()``
    when ``offload_path`` is given (see the module docstring). ``restore``: returns the
    reference's parameters by name (as ``named_parameters()``) when the file must be rewritten."""

    def __init__(self, module: torch.nn.Module, *, offload_path: Path | None,
                 restore: Callable[[], Mapping[str, torch.Tensor]] | None = None):
        self._module = module.eval().requires_grad_(False)
        self.offload_path = offload_path
        self._restore = restore
        self.restored = 0
        """Times the offloaded file was found damaged and rewritten from ``restore``."""
        if offload_path is None:
            return
        self._params = dict(module.named_parameters())  # tied weights appear once (named_parameters dedups)
        self._layout = {name: (tuple(p.shape), p.dtype) for name, p in self._params.items()}
        os.makedirs(offload_path.parent, exist_ok=True)
        self._write({name: p.detach() for name, p in self._params.items()})
        self._release()

    def _write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        tmp = self.offload_path.with_suffix(".tmp")
        torch.save(dict(tensors), tmp)
        os.replace(tmp, self.offload_path)
        self._signature = _file_signature(self.offload_path)

    def _problem(self, state: Mapping[str, torch.Tensor]) -> str | None:
        """What is wrong with a loaded state against the module's layout, or ``None``."""
        if set(state) != set(self._layout):
            return f"its tensors are {sorted(set(state) ^ set(self._layout))[:3]} away from the module's"
        for name, (shape, dtype) in self._layout.items():
            t = state[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                return f"{name} is {tuple(t.shape)} {t.dtype}, the module's is {shape} {dtype}"
        return None

    def _load(self) -> Mapping[str, torch.Tensor]:
        """The mapped state, checked; rewritten from ``restore`` first where the file is damaged."""
        path = self.offload_path
        why = None
        try:
            if _file_signature(path) != self._signature:
                why = "its bytes are not the ones written (size or CRC-32)"
            else:
                state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
                why = self._problem(state)
                if why is None:
                    return state
        except FileNotFoundError:
            why = "it is missing"
        except Exception as err:  # a truncated or overwritten zip archive  # noqa: BLE001
            why = f"it does not load ({type(err).__name__}: {err})"
        if self._restore is None:
            raise ReferenceOffloadError(f"the reference policy's offloaded weights {path}: {why}; nothing to restore it from "
                                        f"(run with --reference_offload off to keep the reference in memory)")
        fresh = {name: t.detach().to("cpu") for name, t in self._restore().items() if name in self._layout}
        wrong = self._problem(fresh)
        if wrong is not None:
            raise ReferenceOffloadError(f"the reference policy's offloaded weights {path}: {why}, and its restore copy "
                                        f"does not match the module: {wrong}")
        warnings.warn(f"the reference policy's offloaded weights {path}: {why}; rewritten from the saved reference",
                      RuntimeWarning, stacklevel=3)
        self._write(fresh)
        self.restored += 1
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")

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
        state = self._load()
        try:
            for name, p in self._params.items():
                t = state[name]
                p.data = t if t.device == p.device else t.to(p.device)
            del state
            yield self._module
        finally:
            self._release()


def load_reference(policy: torch.nn.Module, *, path: Path, resume: bool, save: bool, device: torch.device,
                   offload: bool = False) -> ReferencePolicy:
    """The frozen reference policy: the policy at the start of RL, saved once to ``path`` so a
    resumed run keeps the same one. ``offload``: its weights stay in a file under ``path``
    between its passes (``fastrl.train.reference_policy``)."""
    import transformers

    if resume:
        if not (path / "config.json").exists():
            raise InputError(f"resume: the reference policy of this run is missing ({path})")
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    else:
        ref = copy.deepcopy(policy)
        if save:
            ref.save_pretrained(path, safe_serialization=True)
    restore = None
    if (path / "config.json").exists():  # the saved copy (every single-process run's main rank saves it)
        def restore() -> dict[str, torch.Tensor]:
            saved = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return {name: p.detach() for name, p in saved.named_parameters()}
    return ReferencePolicy(ref, offload_path=path / OFFLOAD_FILE if offload else None, restore=restore)

