"""No op synchronises with the host: forward and backward of every op, every backend.

On CUDA (benchmarks/gpu/run.sh runs this file on the device) two guards are on at once:
``torch.cuda.set_sync_debug_mode("error")`` turns any device->host synchronisation into an
error, and the dispatch guard below.

On CPU there is no device to wait for, so the check is a proxy: ``HostSyncGuard``, a
``TorchDispatchMode``, raises on every ATen op that would block the host on a GPU -- a
scalar read (``.item()``, ``bool()``, ``int()``, ``float()`` all reach
``aten._local_scalar_dense``; ``tolist``/``numpy``, which read CPU memory directly, are
patched to raise), data-dependent output sizes (``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, boolean-mask
indexing), ``is_nonzero``/``equal``, and copies to the CPU. Inside a Triton launch the guard
is paused: there the CPU interpreter itself copies tensors around, which a GPU launch does
not. Four validations read values only on CPU and say so in their docstrings (the global
count check among them); they are paused too (``CPU_ONLY_READS``). Paths an op takes only for CPU tensors with
``backend="torch"`` (the compacting log-prob path, the CPU eager fused loss) are not the GPU
path and are not checked here; the ``triton`` backend runs the GPU code path on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastrl.ops.advantages as adv_mod
import fastrl.ops.logprobs as lp_mod
from fastrl.config import PolicyLossConfig
from fastrl.ops import (
    discounted_returns,
    fused_linear_policy_loss,
    gae,
    group_advantages,
    kl_penalty,
    linear_logprobs,
    masked_whiten,
    policy_loss,
    shared_prefix_decode_attention,
    step_advantages,
    turn_advantages,
    turn_gae,
    turn_index_from_spans,
    value_loss,
)

aten = torch.ops.aten
turn_mod = importlib.import_module("fastrl.ops.turn_advantages")  # (the package exports a function of that name)

# Ops that block the host on a GPU whatever their arguments.
SYNCING_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(), int(), float() of a tensor
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.nonzero.out,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.allclose.default,
}
# (module, function): validations documented to read values only for CPU tensors.
CPU_ONLY_READS = [(lp_mod, "_check_target_range"), (adv_mod, "_check_step_layout"),
                  (adv_mod, "_check_finite_rewards"), (turn_mod, "_check_layout"), (turn_mod, "_check_finite"),
                  (turn_mod, "_check_spans")] + [
    # a global count given as a CPU tensor is range-checked on the host (fastrl._checks.check_global_count)
    (importlib.import_module(f"fastrl.ops.{name}"), "check_global_count")
    for name in ("policy_loss", "value_loss", "logprobs", "fused_policy_loss", "aggregation")
    if hasattr(importlib.import_module(f"fastrl.ops.{name}"), "check_global_count")
]


class HostSyncGuard(TorchDispatchMode):
    """Raise on every ATen op that synchronises with the host on a GPU (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = 0
        self.ops_seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            self.ops_seen += 1
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs) -> None:
        if func in SYNCING_OPS:
            raise AssertionError(f"host sync inside an op: {func}")
        name = func.overloadpacket.__name__
        if name == "repeat_interleave" and kwargs.get("output_size") is None and func != aten.repeat_interleave.self_int:
            raise AssertionError("host sync inside an op: repeat_interleave without output_size")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                raise AssertionError(f"host sync inside an op: boolean-mask {name}")
        if name in ("_to_copy", "copy_", "to"):
            src = args[1] if name == "copy_" else args[0]
            dst_device = args[0].device if name == "copy_" else kwargs.get("device")
            if (isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta")
                    and dst_device is not None and torch.device(dst_device).type == "cpu"):
                raise AssertionError(f"host sync inside an op: copy to the CPU ({func})")

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _paused(guard: HostSyncGuard, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with guard.pause():
            return fn(*args, **kwargs)

    return run


def _python_read(guard: HostSyncGuard, name: str, fn):
    """``Tensor.tolist``/``numpy`` read CPU memory without an ATen op: catch them in Python."""

    @functools.wraps(fn)
    def read(self, *args, **kwargs):
        if not guard.paused:
            raise AssertionError(f"host sync inside an op: Tensor.{name}")
        return fn(self, *args, **kwargs)

    return read


@contextlib.contextmanager
def no_host_sync(monkeypatch, device: torch.device):
    """Everything in the block runs under the guard(s) for ``device``."""
    guard = HostSyncGuard()
    for name in ("tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, _python_read(guard, name, getattr(torch.Tensor, name)))
    for module, name in CPU_ONLY_READS:
        monkeypatch.setattr(module, name, _paused(guard, getattr(module, name)))
    if device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        monkeypatch.setattr(InterpretedFunction, "run", _paused(guard, InterpretedFunction.run))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with guard:
            yield guard
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        monkeypatch.undo()


# ----------------------------------------------------------------------------- the calls

B, T, H, V = 3, 7, 16, 40


def _tokens(device, *, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(B, T, generator=g) * 3).to(device).requires_grad_(requires_grad)
    old = (logp.detach() + 0.1 * torch.randn(B, T, generator=g).to(device))
    mask = (torch.rand(B, T, generator=g) > 0.3).to(device)
    mask[0] = False  # a fully masked row
    return logp, old, mask


def _calls(device, backend):
    """name -> a call doing forward and backward of one op (small shapes: the interpreter is slow)."""
    logp, old, mask = _tokens(device)
    adv = torch.randn(B, T, device=device)
    ref = logp.detach() - 0.05
    ent = torch.rand(B, T, device=device, requires_grad=True)
    rewards, values = torch.randn(B, T, device=device), torch.randn(B, T, device=device)
    hidden = torch.randn(B, T, H, device=device, requires_grad=True)
    weight = (torch.randn(V, H, device=device) / H**0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T), device=device)
    targets[mask.logical_not()] = -100  # prepared outside the guard (a boolean-mask write)
    seq_count = torch.tensor(4.0, device=device)  # a global count on the device, as in data parallelism
    ppo = PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01, dual_clip=3.0, loss_agg="seq-mean-token-mean")
    gspo = PolicyLossConfig(ratio_level="sequence", loss_agg="seq-mean-token-mean")
    sr = torch.randn(B, 4, device=device)
    end = torch.tensor([[1, 3, 6, -1], [0, 2, -1, -1], [6, -1, -1, -1]], device=device)
    ids = torch.tensor([5, -2, 5], device=device)
    # agent trajectories: 4 turns, policy tokens of turn t * 4 // T (every token index < num_turns)
    nt = torch.tensor([4, 3, 4], device=device)
    spans = torch.tensor([[0, 3], [1, 5], [2, 4]], device=device)  # a segment table: [start, start + 2)
    ti = torch.minimum(torch.arange(T, device=device) * 4 // T, nt[:, None] - 1).expand(B, T).contiguous()
    Hq, Hkv, D, G = 4, 2, 16, 3
    att = dict(q=torch.randn(G, Hq, D, device=device), prefix_k=torch.randn(Hkv, 9, D, device=device),
               prefix_v=torch.randn(Hkv, 9, D, device=device),
               prefix_start=torch.tensor([0], dtype=torch.int32, device=device),
               prefix_len=torch.tensor([9], dtype=torch.int32, device=device),
               suffix_k=torch.randn(G, Hkv, 4, D, device=device), suffix_v=torch.randn(G, Hkv, 4, D, device=device),
               suffix_len=torch.tensor([4, 2, 1], dtype=torch.int32, device=device))

    def loss_backward(out):
        loss, metrics = out
        loss.backward()
        return metrics

    calls = {
        "policy_loss ppo": lambda: loss_backward(policy_loss(logp, old, adv, mask, ref_logp=ref, entropy=ent,
                                                             config=ppo, backend=backend)),
        "policy_loss gspo": lambda: loss_backward(policy_loss(logp, old, adv[:, 0], mask, config=gspo,
                                                              global_seq_count=seq_count, backend=backend)),
        "kl_penalty": lambda: kl_penalty(logp, ref, estimator="k3", clamp=10.0, backend=backend).sum().backward(),
        "gae": lambda: gae(rewards, values, mask, gamma=0.99, lam=0.95, backend=backend),
        "gae whiten": lambda: gae(rewards, values, mask, gamma=0.99, lam=0.95, whiten=True, backend=backend),
        "discounted_returns": lambda: discounted_returns(rewards, mask, gamma=0.9, backend=backend),
        "value_loss": lambda: loss_backward(value_loss(values.requires_grad_(), values.detach() + 0.1, rewards, mask,
                                                       clip=0.2, loss_agg="seq-mean-token-mean", backend=backend)),
        "masked_whiten": lambda: masked_whiten(logp, mask, backend=backend).sum().backward(),
        # cpu_host_path=False: group_advantages' CPU fast path reads the id range on the host by
        # design; the sync-free path (the one CUDA runs) is what must not sync
        "group_advantages": lambda: group_advantages(rewards[:, 0], ids, mode="grpo", backend=backend,
                                                     cpu_host_path=False),
        "group_advantages rloo": lambda: group_advantages(rewards[:, 0], ids, mode="rloo", backend=backend,
                                                          cpu_host_path=False),
        "step_advantages": lambda: step_advantages(sr, end, ids, mask, backend=backend),
        "turn_advantages gigpo": lambda: turn_advantages(ti, mask, sr, nt, rewards[:, 1], ids, mode="gigpo",
                                                         state_keys=end, gamma=0.9, backend=backend,
                                                         cpu_host_path=False),
        "turn_advantages gigpo verl-agent": lambda: turn_advantages(ti, mask, sr, nt, rewards[:, 1], ids, mode="gigpo",
                                                                    state_keys=end, episode_over="turns",
                                                                    norm="none", backend=backend,
                                                                    cpu_host_path=False),
        "turn_advantages turn_discounted": lambda: turn_advantages(ti, mask, sr, nt, rewards[:, 1], ids,
                                                                   mode="turn_discounted", backend=backend,
                                                                   cpu_host_path=False),
        "turn_advantages broadcast": lambda: turn_advantages(ti, mask, sr, nt, rewards[:, 1], ids, backend=backend,
                                                             cpu_host_path=False),
        "turn_index_from_spans": lambda: turn_index_from_spans(spans, spans + 2, nt - 2, seq_len=T),
        "turn_gae": lambda: turn_gae(ti, mask, sr, nt, values, gamma=0.99, lam=0.95, outcome_rewards=rewards[:, 1],
                                     backend=backend),
    }
    if backend == "triton" or device.type == "cuda":
        # on CPU the torch backend of these takes paths made for the CPU (see the module doc)
        calls.update({
            "linear_logprobs": lambda: sum(t.sum() for t in linear_logprobs(
                hidden, weight, targets, return_entropy=True, backend=backend)).backward(),
            "fused_linear_policy_loss": lambda: loss_backward(fused_linear_policy_loss(
                hidden, weight, targets, old, adv, mask, ref_logp=ref, config=ppo, entropy=True, backend=backend)),
        })
    if backend == "triton":
        # the torch path of decode attention is the CPU sampler's: it reads the lengths to the host
        calls["decode_attention"] = lambda: shared_prefix_decode_attention(**att, group_size=G, scale=0.25,
                                                                           backend=backend)
    return calls


BACKENDS = ["torch", "triton"]
ALL_OPS = ["policy_loss", "kl_penalty", "gae", "discounted_returns", "value_loss", "masked_whiten",
           "group_advantages", "step_advantages", "turn_advantages", "turn_gae", "turn_index_from_spans",
           "linear_logprobs",
           "fused_linear_policy_loss", "decode_attention"]


def test_every_op_is_covered(device):
    names = {n.split()[0] for n in _calls(device, "triton")}
    assert names == set(ALL_OPS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync(backend, device, monkeypatch):
    calls = _calls(device, backend)
    for name, call in calls.items():
        with no_host_sync(monkeypatch, device) as guard:
            try:
                call()
            except AssertionError as exc:
                raise AssertionError(f"{name} ({backend}): {exc}") from None
        assert guard.ops_seen > 0, name  # the guard saw the op's work


@pytest.mark.parametrize("culprit", ["item", "bool", "nonzero", "mask_index", "unique", "tolist", "numpy"])
def test_guard_catches_host_syncs(culprit, monkeypatch):
    x = torch.tensor([0.5, -1.0, 2.0])
    do = {
        "item": lambda: x.sum().item(),
        "bool": lambda: bool(x.max() > 0),
        "nonzero": lambda: (x > 0).nonzero(),
        "mask_index": lambda: x[x > 0],
        "unique": lambda: torch.unique(x),
        "tolist": lambda: x.tolist(),
        "numpy": lambda: x.numpy(),
    }[culprit]
    with pytest.raises(AssertionError, match="host sync"):
        with no_host_sync(monkeypatch, torch.device("cpu")):
            do()
    do()  # and nothing is left patched
