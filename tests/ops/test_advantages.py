"""fastrl.ops.group_advantages / step_advantages (Triton kernels and torch path) vs the reference."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from csrc_triton.advantages import MODE_CODES, group_advantages_elementwise, segment_stats, step_advantages_tokens
import fastrl.ops.advantages as adv_ops
from fastrl.ops import group_advantages, step_advantages
from fastrl.ops._segments import dense_groups
from fastrl.reference.advantages import GROUP_MODES, group_advantages_reference, step_advantages_reference

BACKENDS = ["torch", "triton"]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # hypothesis tests cannot take fixtures
STAT_KEYS = ("frac_all_equal_groups", "effective_group_ratio", "reward_mean", "reward_std")


def _rewards_and_ids(n: int, device, *, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([-(2**40), -3, 0, 7, 11, 2**50, 123456789])
    ids = pool[torch.randint(0, len(pool), (n,), generator=g)]
    binary = torch.randint(0, 2, (n,), generator=g).to(torch.float64)
    rewards = binary + 0.3 * torch.rand(n, generator=g, dtype=torch.float64) * (torch.rand(n, generator=g) > 0.5)
    return rewards.to(dtype).to(device), ids.to(device)


def _check_group(adv, stats, rewards, ids, mode, eps=1e-6, rtol=1e-5, atol=1e-5):
    ref, ref_stats = group_advantages_reference(rewards.double().cpu(), ids.cpu(), mode=mode, eps=eps)
    assert adv.dtype == torch.float32 and adv.shape == rewards.shape
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=rtol, atol=atol)
    for k in STAT_KEYS:
        assert stats[k].dim() == 0 and stats[k].dtype == torch.float32
        torch.testing.assert_close(stats[k].cpu(), ref_stats[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", GROUP_MODES)
def test_group_matches_reference(backend, mode, device):
    rewards, ids = _rewards_and_ids(29, device)
    adv, stats = group_advantages(rewards, ids, mode=mode, backend=backend)
    _check_group(adv, stats, rewards, ids, mode)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_group_input_dtypes(backend, dtype, device):
    # Low-precision inputs are upcast on load: compared with the reference on the same
    # (already rounded) values, only fp32 arithmetic differs.
    rewards, ids = _rewards_and_ids(40, device, dtype=dtype, seed=1)
    adv, stats = group_advantages(rewards, ids, mode="grpo", backend=backend)
    _check_group(adv, stats, rewards, ids, "grpo")


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_all_equal_and_singletons(backend, device):
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.3, 2.0], device=device)
    ids = torch.tensor([4, 4, 4, 9, 9, -1, 8, 8], device=device)
    for mode in GROUP_MODES:
        adv, stats = group_advantages(rewards, ids, mode=mode, backend=backend)
        _check_group(adv, stats, rewards, ids, mode)
        if mode != "reinforce_pp":
            assert torch.equal(adv[:6].cpu(), torch.zeros(6))  # equal groups and the singleton
    # 4 groups: {4}, {9} all equal, {-1} singleton (counts as all-equal), {8} informative
    assert stats["frac_all_equal_groups"].item() == pytest.approx(0.75)
    assert stats["effective_group_ratio"].item() == pytest.approx(0.25)


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_all_singletons_and_n1(backend, device):
    for n in (1, 5):
        rewards = torch.arange(n, dtype=torch.float32, device=device)
        ids = torch.arange(n, device=device) * 7 - 3
        for mode in GROUP_MODES:
            adv, stats = group_advantages(rewards, ids, mode=mode, backend=backend)
            assert torch.equal(adv.cpu(), torch.zeros(n)), mode
            assert stats["frac_all_equal_groups"].item() == 1.0
            _check_group(adv, stats, rewards, ids, mode)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("id_dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_group_id_dtypes_and_relabelling(backend, id_dtype, device):
    rewards, ids = _rewards_and_ids(30, device, seed=2)
    small = torch.remainder(ids, 5).to(id_dtype)  # five groups, labels 0..4 in id_dtype
    adv, _ = group_advantages(rewards, small, backend=backend)
    # An injective relabelling (huge, negative ids) must not change anything.
    relabel = (small.to(torch.int64) * -(2**61) + 12345)
    adv2, _ = group_advantages(rewards, relabel, backend=backend)
    torch.testing.assert_close(adv, adv2, rtol=0, atol=0)
    ref, _ = group_advantages_reference(rewards.double().cpu(), small.cpu().to(torch.int64))
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [4, 16])
def test_segment_kernel_small_blocks(block, device):
    """Groups longer than the block (several loop iterations, ragged tails)."""
    sizes = [1, 3, 4, 5, 13, 17]
    ids = torch.cat([torch.full((s,), i * 10 - 20) for i, s in enumerate(sizes)])
    perm = torch.randperm(len(ids))
    ids = ids[perm].to(device)
    r = torch.randn(len(ids), dtype=torch.float64).to(device)
    g = dense_groups(ids)
    counts, starts = g.counts_starts()
    mean, std, count, distinct, mean_lo = segment_stats(r.float(), g.perm, starts, counts, block=block)
    for k, gid in enumerate(sorted(set(ids.tolist()))):
        vals = r[ids == gid].tolist()
        assert count[k].item() == len(vals)
        assert mean[k].item() == pytest.approx(sum(vals) / len(vals), rel=1e-5, abs=1e-6)
        assert std[k].item() == pytest.approx(statistics.stdev(vals) if len(vals) > 1 else 0.0, rel=1e-5, abs=1e-6)
        assert distinct[k].item() == float(len(vals) > 1)
    assert torch.equal(count[len(sizes):].cpu(), torch.zeros(len(ids) - len(sizes)))  # slots past the last group
    adv = group_advantages_elementwise(
        r.float(), g.rank(), mean, mean_lo, std, count, torch.ones((), device=device), mode=MODE_CODES["grpo"], eps=1e-6, floor=0.1, block=block
    )
    ref, _ = group_advantages_reference(r.cpu(), ids.cpu())
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=1e-5, atol=1e-5)


def _loop_grpo(rewards: list[float], ids: list[int], eps: float) -> list[float]:
    groups: dict[int, list[float]] = defaultdict(list)
    for r, i in zip(rewards, ids):
        groups[i].append(r)
    out = []
    for r, i in zip(rewards, ids):
        m = groups[i]
        out.append(0.0 if len(m) == 1 else (r - sum(m) / len(m)) / (statistics.stdev(m) + eps))
    return out


@settings(max_examples=40, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.integers(-(2**62), 2**62), st.sampled_from([0.0, 0.5, 1.0, -2.0, 3.25])), min_size=1, max_size=40
    ),
    n_groups=st.integers(1, 6),
)
def test_group_property_vs_loop(data, n_groups):
    # ids drawn from a few huge/negative labels so groups have several members
    labels = sorted({d[0] for d in data})[:n_groups]
    ids = [labels[d[0] % len(labels)] for d in data]
    rewards = [d[1] for d in data]
    adv, stats = group_advantages(torch.tensor(rewards), torch.tensor(ids), mode="grpo", backend="torch")
    torch.testing.assert_close(adv.double(), torch.tensor(_loop_grpo(rewards, ids, 1e-6), dtype=torch.float64), rtol=1e-5, atol=1e-5)
    # permuting the samples permutes the advantages
    perm = torch.randperm(len(ids))
    adv_p, _ = group_advantages(torch.tensor(rewards)[perm], torch.tensor(ids)[perm], mode="grpo", backend="torch")
    torch.testing.assert_close(adv_p, adv[perm], rtol=1e-6, atol=1e-6)  # summation order may differ
    # centred modes sum to zero within each group
    dr, _ = group_advantages(torch.tensor(rewards), torch.tensor(ids), mode="dr_grpo", backend="torch")
    for gid in set(ids):
        sel = torch.tensor(ids) == gid
        assert abs(dr[sel].sum().item()) < 1e-4
    assert 0.0 <= stats["frac_all_equal_groups"].item() <= 1.0


@settings(max_examples=5, deadline=None)
@given(
    rewards=st.lists(st.sampled_from([0.0, 1.0, 0.25]), min_size=1, max_size=24),
    seed=st.integers(0, 1000),
    mode=st.sampled_from(GROUP_MODES),
)
def test_group_property_triton_equals_torch(rewards, seed, mode):
    g = torch.Generator().manual_seed(seed)
    ids = (torch.randint(-3, 4, (len(rewards),), generator=g) * 1000003).to(DEVICE)
    r = torch.tensor(rewards, device=DEVICE)
    a_t, s_t = group_advantages(r, ids, mode=mode, backend="torch")
    a_k, s_k = group_advantages(r, ids, mode=mode, backend="triton")
    torch.testing.assert_close(a_k, a_t, rtol=1e-5, atol=1e-6)
    for k in STAT_KEYS:
        torch.testing.assert_close(s_k[k], s_t[k])


def test_group_bad_inputs():
    r = torch.rand(4)
    ids = torch.tensor([0, 0, 1, 1])
    with pytest.raises(TypeError, match="group_ids"):
        group_advantages(r, ids.float())
    with pytest.raises(TypeError, match="group_ids"):
        group_advantages(r, ids.bool())
    with pytest.raises(TypeError, match="rewards"):
        group_advantages(ids, ids)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(r, ids[:3])
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(r.reshape(2, 2), ids)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.rand(0), torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ValueError, match="eps"):
        group_advantages(r, ids, eps=float("nan"))
    with pytest.raises(ValueError, match="eps"):
        group_advantages(r, ids, eps=0.0)
    with pytest.raises(ValueError, match="mode"):
        group_advantages(r, ids, mode="ppo")
    with pytest.raises(ValueError, match="backend"):
        group_advantages(r, ids, backend="cuda")
    with pytest.raises(TypeError, match="rewards"):
        group_advantages([0.0, 1.0], ids)


# ---------------------------------------------------------------- step advantages


def _step_case(B, S, T, device, *, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    step_rewards = torch.randn(B, S, generator=g).to(dtype)
    end = torch.randint(-1, T, (B, S), generator=g)
    ids = torch.tensor([-5, 2**45, 3])[torch.randint(0, 3, (B,), generator=g)]
    mask = (torch.rand(B, T, generator=g) > 0.15).to(torch.int64)
    mask[0] = 0  # a fully masked row
    return step_rewards.to(device), end.to(device), ids.to(device), mask.to(device)


def _check_step(out, sr, end, ids, mask, rtol=1e-5, atol=1e-5):
    ref = step_advantages_reference(sr.double().cpu(), end.cpu(), ids.cpu(), mask.cpu())
    assert out.dtype == torch.float32 and out.shape == mask.shape
    torch.testing.assert_close(out.double().cpu(), ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_step_matches_reference(backend, dtype, device):
    sr, end, ids, mask = _step_case(7, 5, 37, device, dtype=dtype)
    _check_step(step_advantages(sr, end, ids, mask, backend=backend), sr, end, ids, mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_edges(backend, device):
    # length-1 sequences
    sr, end, ids, mask = _step_case(4, 3, 1, device, seed=1)
    _check_step(step_advantages(sr, end, ids, mask, backend=backend), sr, end, ids, mask)
    # no steps at all, absent-step rewards that are NaN must not leak
    sr = torch.full((3, 2), float("nan"), device=device)
    end = torch.full((3, 2), -1, device=device)
    out = step_advantages(sr, end, torch.tensor([0, 0, 1], device=device), torch.ones(3, 4, device=device), backend=backend)
    assert torch.equal(out.cpu(), torch.zeros(3, 4))
    # bool mask, duplicate end indices, one-step group
    sr = torch.tensor([[1.0, 2.0], [0.5, 0.0], [4.0, 0.0]], device=device)
    end = torch.tensor([[2, 2], [0, -1], [1, -1]], device=device)
    ids = torch.tensor([1, 1, 2], device=device)
    mask = torch.ones(3, 3, dtype=torch.bool, device=device)
    _check_step(step_advantages(sr, end, ids, mask, backend=backend), sr, end, ids, mask)


def test_step_kernel_small_blocks(device):
    sr, end, ids, mask = _step_case(5, 7, 45, device, seed=3)
    g = dense_groups(ids)
    B, S = sr.shape
    present = (end >= 0).view(torch.uint8).reshape(-1)
    order = (g.perm[:, None] * S + torch.arange(S, device=device)).reshape(-1)
    counts, starts = g.counts_starts()
    mean, std, _, _, mean_lo = segment_stats(sr.reshape(-1), order, starts * S, counts * S, valid=present, block=4)
    out = step_advantages_tokens(sr, end, g.rank(), mean, mean_lo, std, mask, eps=1e-6, block_t=16, block_s=2)
    _check_step(out, sr, end, ids, mask)


def test_step_bad_inputs():
    sr = torch.rand(2, 3)
    end = torch.tensor([[0, 1, -1], [2, -1, -1]])
    ids = torch.tensor([0, 0])
    mask = torch.ones(2, 4)
    with pytest.raises(ValueError, match="step_end_index"):
        step_advantages(sr, torch.tensor([[0, 4, -1], [2, -1, -1]]), ids, mask)  # 4 >= T
    with pytest.raises(ValueError, match="step_end_index"):
        step_advantages(sr, torch.tensor([[0, -2, -1], [2, -1, -1]]), ids, mask)
    with pytest.raises(TypeError, match="step_end_index"):
        step_advantages(sr, end.float(), ids, mask)
    with pytest.raises(ValueError, match="step_end_index"):
        step_advantages(sr, end[:, :2], ids, mask)
    with pytest.raises(ValueError, match="group_ids"):
        step_advantages(sr, end, torch.tensor([0, 0, 1]), mask)
    with pytest.raises(TypeError, match="group_ids"):
        step_advantages(sr, end, ids.double(), mask)
    with pytest.raises(ValueError, match="mask"):
        step_advantages(sr, end, ids, torch.ones(3, 4))
    with pytest.raises(ValueError, match="mask"):
        step_advantages(sr, end, ids, torch.ones(2, 0))
    with pytest.raises(ValueError, match="step_rewards"):
        step_advantages(torch.rand(2, 0), torch.zeros(2, 0, dtype=torch.int64), ids, mask)
    with pytest.raises(TypeError, match="step_rewards"):
        step_advantages(end, end, ids, mask)
    with pytest.raises(ValueError, match="eps"):
        step_advantages(sr, end, ids, mask, eps=float("inf"))


# ---------------------------------------------------------------- no host synchronisation


def _sync_free_calls(device, backend):
    from fastrl.ops import masked_whiten, value_loss

    r, ids = _rewards_and_ids(24, device)
    v = torch.randn(3, 9, device=device, requires_grad=True)
    mask = torch.rand(3, 9, device=device) > 0.3
    modes = GROUP_MODES if backend == "torch" else ("grpo", "reinforce_pp")  # the interpreter is slow
    # cpu_host_path=False: on CPU, the path CUDA runs (ignored on CUDA)
    calls = [lambda mode=mode: group_advantages(r, ids, mode=mode, backend=backend, cpu_host_path=False) for mode in modes]
    calls.append(lambda: value_loss(v, v.detach() + 0.1, torch.randn(3, 9, device=device), mask, clip=0.2,
                                    loss_agg="seq-mean-token-mean", backend=backend)[0].backward())
    calls.append(lambda: masked_whiten(v, mask, backend=backend).sum().backward())
    return calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync(backend, device, monkeypatch):
    """On CUDA: CUDA's sync debug mode turns any device->host sync into an error. On CPU:
    every Python-level way of reading a tensor value is made to raise during the calls."""
    calls = _sync_free_calls(device, backend)
    sr, end, sids, smask = _step_case(4, 3, 8, device)
    if device.type == "cuda":
        calls.append(lambda: step_advantages(sr, end, sids, smask, backend=backend))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for call in calls:
                call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return
    # (step_advantages is left out on CPU: there it deliberately reads the step indices
    # to validate the layout, which costs no device sync. Likewise group_advantages reads
    # the id range and checks the rewards on the host on CPU: here it runs the path CUDA
    # runs (cpu_host_path=False in _sync_free_calls), whose reward check is a device-side assert.)
    monkeypatch.setattr(adv_ops, "_check_finite_rewards", lambda *args: None)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value inside an op")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for call in calls:
        call()
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="host read"):  # the guard itself works
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", forbidden)
            torch.ones(1).item()


# ---------------------------------------------------------------- precision, NaN rewards, CPU paths


def test_group_of_a_million_rewards_with_an_offset_torch():
    """2^20 rewards near 100 in one group: the mean advantage is 0 and (grpo) the std 1, as in
    float64 -- an fp32 running sum into one slot loses the mean (gave -1.0 and 0.27)."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 20
    rewards = 100.0 + torch.randn(n, generator=g)
    ids = torch.full((n,), 5)
    ref, _ = group_advantages_reference(rewards.double(), ids, mode="grpo")
    for mode in ("grpo", "dr_grpo"):
        adv, stats = group_advantages(rewards, ids, mode=mode, backend="torch")
        assert abs(adv.double().mean().item()) < 1e-5
        if mode == "grpo":
            assert abs(adv.double().std().item() - 1.0) < 1e-5
            torch.testing.assert_close(adv.double(), ref, rtol=0, atol=1e-5)
        assert stats["reward_mean"].item() == pytest.approx(rewards.double().mean().item(), abs=1e-5)


@pytest.mark.parametrize("backend", BACKENDS + ["torch-sync-free"])
def test_group_with_a_large_offset_small_spread(backend, device):
    """The large-offset case at a size the interpreter runs (the kernel launches one program
    per possible group, N of them): 96 rewards at 1000 + 0.001 z, 16 fp32 ulps of spread.
    A group mean rounded to fp32 is off by up to 1/32 of a std; the result must match the
    float64 reference on the same (fp32-rounded) rewards. (The 2^20-member case above runs
    on the torch path only.)"""
    g = torch.Generator().manual_seed(1)
    n = 96
    rewards = (1000.0 + 0.001 * torch.randn(n, generator=g)).to(device)
    ids = torch.randint(0, 2, (n,), generator=g).to(device)
    kw = {}
    if backend == "torch-sync-free":
        kw, backend = {"cpu_host_path": False}, "torch"
    adv, _ = group_advantages(rewards, ids, mode="grpo", backend=backend, **kw)
    ref, _ = group_advantages_reference(rewards.double().cpu(), ids.cpu(), mode="grpo")
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=0, atol=2e-4)
    assert abs(adv.double().mean().item()) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS + ["torch-sync-free"])
def test_group_float64_rewards_keep_their_precision(backend, device):
    """Rewards 1 and 1 + 1e-9 in float64 are a group with signal (fp32 would round both to 1)."""
    kw = {}
    if backend == "torch-sync-free":
        kw, backend = {"cpu_host_path": False}, "torch"
    rewards = torch.tensor([1.0, 1.0 + 1e-9, 2.0, 2.0, 5.0], dtype=torch.float64, device=device)
    ids = torch.tensor([0, 0, 1, 1, 2], device=device)
    adv, stats = group_advantages(rewards, ids, mode="grpo", eps=1e-12, backend=backend, **kw)
    ref, ref_stats = group_advantages_reference(rewards.cpu(), ids.cpu(), mode="grpo", eps=1e-12)
    assert adv.dtype == torch.float32
    assert adv[0] < 0 < adv[1]
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=1e-6, atol=1e-6)
    assert stats["frac_all_equal_groups"].item() == pytest.approx(2 / 3)
    torch.testing.assert_close(stats["frac_all_equal_groups"].cpu(), ref_stats["frac_all_equal_groups"])


_NON_FINITE_ON_CUDA = """
import sys, torch
from fastrl.ops import group_advantages
rewards = torch.tensor([1.0, 0.0, float(sys.argv[2]), 1.0], device="cuda")
group_advantages(rewards, torch.tensor([0, 0, 1, 1], device="cuda"), mode="batch_std", backend=sys.argv[1])
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_group_non_finite_reward_is_an_error(backend, bad, device):
    """A ValueError on CPU; on CUDA a device-side assert (a host check would need a sync). The
    assert ends the process's CUDA context, so on CUDA the call runs in a fresh process."""
    if device.type == "cpu":
        rewards = torch.tensor([1.0, 0.0, bad, 1.0], device=device)
        ids = torch.tensor([0, 0, 1, 1], device=device)
        with pytest.raises(ValueError, match="rewards must be finite"):
            group_advantages(rewards, ids, mode="batch_std", backend=backend)
        return
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", _NON_FINITE_ON_CUDA, backend, str(bad)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "device-side assert triggered" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.parametrize("mode", GROUP_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("ids_kind", ["dense", "sparse"])
def test_group_cpu_paths_match_reference(mode, dtype, ids_kind):
    """The CPU host path (id range -> bincount, or torch.unique for sparse ids) and the
    sync-free sort path (what CUDA runs without Triton) both match the reference."""
    rewards, ids = _rewards_and_ids(57, torch.device("cpu"), dtype=dtype, seed=3)
    if ids_kind == "dense":
        ids = torch.remainder(ids, 11) - 4
    for host in (True, False):
        adv, stats = group_advantages(rewards, ids, mode=mode, backend="torch", cpu_host_path=host)
        _check_group(adv, stats, rewards, ids, mode)


def test_sync_free_torch_path_reads_no_tensor_value(monkeypatch):
    """The torch path CUDA uses never reads a tensor value on the host (checked on CPU)."""
    rewards, ids = _rewards_and_ids(40, torch.device("cpu"), seed=4)
    monkeypatch.setattr(adv_ops, "_check_finite_rewards", lambda *args: None)  # the CUDA check is a device assert

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a tensor value inside an op")

    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for mode in GROUP_MODES:
        group_advantages(rewards, ids, mode=mode, backend="torch", cpu_host_path=False)
