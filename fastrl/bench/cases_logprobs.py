"""Benchmark cases: forward + backward of the GRPO loss from LM-head hidden states.

Implementations (same inputs, same loss: token ratio, clip 0.2, k3 KL with beta 0.04,
per-sequence token mean):

- ``fastrl``: ``fastrl.ops.fused_linear_policy_loss`` (no [tokens, V] logits; backend "auto":
  the token-chunked cuBLAS one pass on CUDA, the PyTorch one pass on CPU -- the case's note
  says which ran).
- ``naive``: ``hidden @ weight.T``, fp32 ``log_softmax``, ``gather`` (TRL's default path),
  then the loss in plain PyTorch.
- ``trl_selective``: the same logits with TRL's ``selective_log_softmax``.
- ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (chunked PyTorch; ``torch.compile``
  on CUDA, eager on CPU where compiling takes about a minute per shape).

``build_grpo`` is the builder both the in-process harness and the fresh-process memory
measurement (``fastrl.bench.memory``) use.
"""

from __future__ import annotations

import torch

from fastrl.bench.harness import BenchCase

IMPLS = ("fastrl", "naive", "trl_selective", "liger")
BETA, EPS = 0.04, 0.2


def _grpo_from_logp(logp, old, ref, adv, mask):
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - EPS, 1 + EPS))
    d = ref - logp
    per_tok = pg + BETA * (torch.exp(d) - d - 1)
    return ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def build_grpo(
    impl: str,
    tokens: int,
    hidden: int,
    vocab: int,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    seq_len: int = 512,
    seed: int = 0,
    backend: str = "auto",
):
    """Inputs for one GRPO step and a zero-argument callable doing forward + backward.

    The callable has a ``device`` attribute (used by the memory measurement).
    """
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    T = min(seq_len, tokens)
    B = max(1, tokens // T)
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(B, T, hidden, generator=g) * 1.0).to(dev, dt).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(dev, dt).requires_grad_()
    y = torch.randint(0, vocab, (B, T), generator=g).to(dev)
    mask = torch.ones(B, T, device=dev)
    mask[:, T - T // 8 :] = 0  # some right padding
    old = (-torch.rand(B, T, generator=g) * 8 - 8).to(dev)
    ref = old + 0.05 * torch.randn(B, T, generator=g).to(dev)
    adv = torch.randn(B, generator=g).to(dev)

    def reset():
        h.grad = None
        w.grad = None

    if impl == "fastrl":
        from fastrl.config import PolicyLossConfig
        from fastrl.ops import fused_linear_policy_loss

        cfg = PolicyLossConfig.preset("grpo")

        def run():
            reset()
            loss, _ = fused_linear_policy_loss(h, w, y, old, adv, mask, ref_logp=ref, config=cfg, backend=backend)
            loss.backward()

    elif impl == "naive":

        def run():
            reset()
            logits = h @ w.T
            logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, y[..., None]).squeeze(-1)
            _grpo_from_logp(logp, old, ref, adv, mask).backward()

    elif impl == "trl_selective":
        from trl.trainer.utils import selective_log_softmax

        def run():
            reset()
            logits = h @ w.T
            logp = selective_log_softmax(logits, y)
            _grpo_from_logp(logp.float(), old, ref, adv, mask).backward()

    elif impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(
            beta=BETA, epsilon_low=EPS, epsilon_high=EPS, loss_type="grpo", use_ref_model=True,
            compiled=dev.type == "cuda",
        )

        def run():
            reset()
            loss = loss_fn(h, w, y, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0]
            loss.backward()

    else:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    run.device = dev
    return run


def _shapes(device: torch.device, quick: bool) -> list[tuple[int, int, int]]:
    if device.type == "cuda":
        if quick:
            return [(2048, 1024, 32000), (8192, 4096, 151936)]
        return [(n, h, v) for n in (2048, 8192, 32768) for h in (1024, 4096) for v in (32000, 151936)]
    if quick:
        return [(512, 64, 4096)]
    # CPU (2 shared cores): trimmed; the 8192 x 151936 memory target is measured by
    # benchmarks/bench_logprobs_memory.py in fresh processes.
    return [(2048, 256, 32000), (2048, 256, 151936)]


# The optional baselines and the package each needs.
OPTIONAL_BASELINES = {"trl_selective": "trl", "liger": "liger_kernel"}


def missing_baselines() -> dict[str, str]:
    """Baseline rows this run cannot have -> the package that is not installed."""
    import importlib.util

    return {impl: pkg for impl, pkg in OPTIONAL_BASELINES.items() if importlib.util.find_spec(pkg) is None}


def available_impls() -> tuple[str, ...]:
    """IMPLS whose packages are installed (TRL and Liger-Kernel are optional baselines)."""
    missing = missing_baselines()
    return tuple(i for i in IMPLS if i not in missing)


def _path_note(device: torch.device, hidden: int, vocab: int, dtype: str) -> str:
    """Which path ``fastrl`` (backend "auto") takes here, in the words of ``which_path``."""
    from fastrl.config import PolicyLossConfig
    from fastrl.ops.fused_policy_loss import which_path

    path = which_path("auto", device, config=PolicyLossConfig.preset("grpo"), hidden=hidden, vocab=vocab,
                      dtype=getattr(torch, dtype))
    return f"fastrl path: {path}"


def cases(device: torch.device, quick: bool) -> list[BenchCase]:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    out = []
    for n, hd, v in _shapes(device, quick):
        builder_kwargs = {name: dict(impl=name, tokens=n, hidden=hd, vocab=v, dtype=dtype, device=str(device))
                          for name in available_impls()}
        impls = {name: build_grpo(**kw) for name, kw in builder_kwargs.items()}
        out.append(
            BenchCase(
                op="grpo_loss_fwd_bwd",
                shape=f"N={n} H={hd} V={v} {dtype}",
                impls=impls,
                note=_path_note(device, hd, v, dtype) + ("; liger eager (compiled=False) on CPU" if device.type != "cuda" else ""),
                repeats=3 if quick else (2 if device.type != "cuda" else 5),
                # Peak memory is the point of the fused path: on CPU it is measured per
                # implementation in a fresh process (on CUDA the harness measures it in place).
                memory={name: (f"{__name__}:build_grpo", kw) for name, kw in builder_kwargs.items()},
            )
        )
    return out
