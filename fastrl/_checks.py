"""Input validation and backend dispatch shared by every op.

Every public op validates its inputs with these helpers before any work starts, so a
bad call fails with a ``ValueError``/``TypeError`` that names the argument and what was
expected. Nothing is broadcast silently and nothing here synchronises with the device.
"""

from __future__ import annotations

import math
import os
from typing import Literal

import torch

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


def check_float(name: str, x: object, *, ndim: int | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A floating-point tensor, optionally of a given rank or exact shape."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    _check_shape(name, x, ndim=ndim, shape=shape)
    return x


def check_int(name: str, x: object, *, ndim: int | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """An integer tensor (ids, indices), optionally of a given rank or exact shape."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    _check_shape(name, x, ndim=ndim, shape=shape)
    return x


def check_mask(name: str, mask: object, shape: tuple[int, ...]) -> torch.Tensor:
    """A 0/1 mask of exactly ``shape``; bool, integer or float dtypes are accepted."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name} must be a real or bool tensor, got dtype {mask.dtype}")
    _check_shape(name, mask, shape=tuple(shape))
    return mask


def _check_shape(name: str, x: torch.Tensor, *, ndim: int | None = None, shape: tuple[int, ...] | None = None) -> None:
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_is_weight(is_weight: object, B: int, T: int) -> None:
    """``is_weight`` of the policy losses: None, or a float ``[B, T]``, ``[B]`` or ``[B, 1]`` tensor."""
    if is_weight is None:
        return
    check_float("is_weight", is_weight)
    if tuple(is_weight.shape) not in ((B, T), (B,), (B, 1)):
        raise ValueError(f"is_weight must have shape (B, T) = {(B, T)}, (B,) = {(B,)} or (B, 1) = {(B, 1)}, "
                         f"got {tuple(is_weight.shape)}")


def check_nonempty(name: str, x: torch.Tensor) -> None:
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); ops need at least one element")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors live on one device; returns it."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} but {first} is on {device}; all inputs must share one device")
    if device is None:
        raise ValueError("no tensor inputs given")
    return device


def check_scalar(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
) -> float | None:
    """A finite Python number inside an optional interval."""
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{name} must be a number, got None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (value < low or (value == low and not low_inclusive)):
        raise ValueError(f"{name} must be {'>=' if low_inclusive else '>'} {low}, got {value}")
    if high is not None and (value > high or (value == high and not high_inclusive)):
        raise ValueError(f"{name} must be {'<=' if high_inclusive else '<'} {high}, got {value}")
    return value


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value  # type: ignore[return-value]


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch"]:
    """Pick the implementation for ``device``.

    ``auto`` means Triton for CUDA tensors and the PyTorch path otherwise. ``triton``
    on CPU tensors is allowed only under ``TRITON_INTERPRET=1`` (how the test suite
    runs the kernels without a GPU).
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if not triton_available():
        raise ValueError("backend='triton' requested but triton is not importable")
    if device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device.type}); on CPU set TRITON_INTERPRET=1 "
            "before importing triton to run the kernels in the interpreter"
        )
    return "triton"


def check_global_count(name: str, value: object, device: torch.device) -> torch.Tensor | float | None:
    """A global token/sequence count (the loss denominator of a whole batch split into
    micro-batches or ranks), validated one way for every loss op.

    The rule, shared by ``policy_loss``, ``value_loss`` and ``fused_linear_policy_loss``
    and their references (which count applies to which ``loss_agg`` is decided by
    ``fastrl.ops.aggregation.global_count_for``):

    - ``None``: the local count is used.
    - a Python ``int``/``float`` (not ``bool``): finite and >= 0, else ``ValueError``.
    - a tensor with exactly one element (0-dim, ``[1]``, ...), integer or floating dtype,
      on the inputs' ``device`` (else ``ValueError``; it is never moved silently). It is read
      on the device, so a CUDA count costs no host sync; on CPU a negative or non-finite
      value is a ``ValueError`` (on CUDA it cannot be checked without a sync).
    - a count of 0 is taken as 1 (``effective_count``): a fully masked batch has loss 0.

    Returns a float or a detached 0-dim tensor.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a 1-element tensor, got shape {tuple(value.shape)}")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number tensor, got dtype {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but the inputs are on {device}; pass it on {device}")
        value = value.detach().reshape(())
        if value.device.type == "cpu":
            v = float(value)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        return value
    return check_scalar(name, value, low=0.0)


def effective_count(count: torch.Tensor | float, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | None = None) -> torch.Tensor:
    """``count`` as a 0-dim tensor of ``dtype``, with 0 taken as 1 (see ``check_global_count``).
    A Python number becomes a device tensor through a fill (no host-to-device copy)."""
    if not isinstance(count, torch.Tensor):
        return torch.full((), float(count) if count > 0 else 1.0, dtype=dtype, device=device)
    c = count.to(device=device, dtype=dtype).reshape(())
    return torch.where(c > 0, c, torch.ones_like(c))
