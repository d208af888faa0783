"""fastrl.ops.turn_advantages / turn_gae (torch path and Triton kernels) vs the reference."""

from __future__ import annotations

import pytest
import torch

from csrc_triton.turn_advantages import expand_turn_advantages
from fastrl.ops import gae, group_advantages
from fastrl.ops.turn_advantages import place_turn_rewards, turn_advantages, turn_gae, turn_index_from_spans
from fastrl.reference.turn_advantages import (
    NORMS,
    TURN_ADVANTAGE_MODES,
    place_turn_rewards_reference,
    turn_index_from_spans_reference,
    turn_advantages_reference,
    turn_gae_reference,
)

BACKENDS = ["torch", "triton"]
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
OFF = -7  # turn_index off the policy tokens (any value)


def _batch(device, *, seed=0, B=7, K=4, env=2, dtype=torch.float32, garbage=False):
    """Random agent trajectories: row b = [turn 0 tokens][env][turn 1 tokens][env]... padded.

    Returns a dict of the op's inputs (group ids non-contiguous, one singleton group, one row
    with no turns, one with one turn) and the values for GAE."""
    g = torch.Generator().manual_seed(seed)
    num_turns = torch.randint(1, K + 1, (B,), generator=g)
    num_turns[0], num_turns[1] = 0, 1
    lengths = [[int(torch.randint(1, 4, (1,), generator=g)) for _ in range(int(n))] for n in num_turns]
    T = max(sum(ls) + env * len(ls) for ls in lengths) + 1
    ti = torch.full((B, T), OFF, dtype=torch.int64)
    lm = torch.zeros(B, T, dtype=torch.bool)
    for b, ls in enumerate(lengths):
        t = 0
        for k, n in enumerate(ls):
            ti[b, t:t + n] = k
            lm[b, t:t + n] = True
            t += n + env
    present = torch.arange(K)[None] < num_turns[:, None]
    rewards = torch.randint(0, 3, (B, K), generator=g).to(torch.float64) * 0.5
    keys = torch.randint(0, 3, (B, K), generator=g) * 1_000_000_007 - 2**40
    outcome = torch.randint(0, 2, (B,), generator=g).to(torch.float64)
    outcome = outcome + 0.25 * torch.rand(B, generator=g, dtype=torch.float64)
    ids = torch.tensor([10**12, 5, -3, 5, -3, 10**12, 42][:B])  # 42: a singleton group
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    if garbage:
        rewards = torch.where(present, rewards, float("nan"))
        keys = torch.where(present, keys, torch.randint(-(2**62), 2**62, (B, K), generator=g))
        ti = torch.where(lm, ti, torch.randint(-(2**40), 2**40, (B, T), generator=g))
        values = torch.where(lm, values, float("nan"))
    return dict(turn_index=ti.to(device), loss_mask=lm.to(device), turn_rewards=rewards.to(dtype).to(device),
                num_turns=num_turns.to(device), outcome_rewards=outcome.to(dtype).to(device), group_ids=ids.to(device),
                state_keys=keys.to(device), values=values.to(dtype).to(device))


def _mode_kwargs(mode, x):
    kw = dict(mode=mode, gamma=0.8, step_coef=0.6, turn_coef=0.7, outcome_coef=0.4)
    if mode == "gigpo":
        kw["state_keys"] = x["state_keys"]
    return kw


def _op_args(x):
    return (x["turn_index"], x["loss_mask"], x["turn_rewards"], x["num_turns"], x["outcome_rewards"], x["group_ids"])


def _ref_args(x):
    c = lambda t: t.cpu()  # noqa: E731
    f = lambda t: t.cpu().double()  # noqa: E731  (the reference sees the values the op saw)
    return (c(x["turn_index"]), c(x["loss_mask"]), f(x["turn_rewards"]), c(x["num_turns"]),
            f(x["outcome_rewards"]), c(x["group_ids"]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", TURN_ADVANTAGE_MODES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(backend, mode, norm, dtype, device):
    x = _batch(device, dtype=dtype, seed=1)
    kw = _mode_kwargs(mode, x)
    adv, stats = turn_advantages(*_op_args(x), norm=norm, backend=backend, **kw)
    kw_ref = dict(kw, state_keys=kw["state_keys"].cpu()) if mode == "gigpo" else kw
    ref, ref_stats = turn_advantages_reference(*_ref_args(x), norm=norm, **kw_ref)
    assert adv.dtype == torch.float32 and adv.shape == x["loss_mask"].shape and adv.device == device
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    assert set(stats) == set(ref_stats)
    for k, v in stats.items():
        assert v.dim() == 0 and v.dtype == torch.float32, k
        torch.testing.assert_close(v.cpu(), ref_stats[k].float(), rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(adv[x["loss_mask"] == 0]) == 0
    assert torch.all(adv[0] == 0)  # the row without turns


@pytest.mark.parametrize("backend", BACKENDS)
def test_final_turn_coef_matches_reference(backend, device, dtype=torch.float32):
    """MT-GRPO's final turn (final_turn_coef 0: the outcome term alone) and a general weight."""
    x = _batch(device, dtype=dtype, seed=6)
    for final in (0.0, -1.3):
        kw = dict(mode="turn_discounted", gamma=0.0, turn_coef=0.7, outcome_coef=1.0, final_turn_coef=final)
        adv, _ = turn_advantages(*_op_args(x), backend=backend, **kw)
        ref, _ = turn_advantages_reference(*_ref_args(x), **kw)
        torch.testing.assert_close(adv.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    same, _ = turn_advantages(*_op_args(x), backend=backend, mode="turn_discounted", turn_coef=0.7, final_turn_coef=0.7)
    plain, _ = turn_advantages(*_op_args(x), backend=backend, mode="turn_discounted", turn_coef=0.7)
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    with pytest.raises(ValueError, match="final_turn_coef"):
        turn_advantages(*_op_args(x), backend=backend, mode="gigpo", state_keys=x["state_keys"], final_turn_coef=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_equals_group_advantages_broadcast(backend, device):
    x = _batch(device, seed=2)
    for norm, gmode in (("std", "grpo"), ("none", "dr_grpo")):
        adv, stats = turn_advantages(*_op_args(x), mode="broadcast", norm=norm, backend=backend)
        ga, gstats = group_advantages(x["outcome_rewards"], x["group_ids"], mode=gmode, backend=backend)
        torch.testing.assert_close(adv, torch.where(x["loss_mask"], ga[:, None], 0.0), rtol=0, atol=0)
        for k in ("frac_all_equal_groups", "reward_mean", "reward_std"):
            torch.testing.assert_close(stats[k], gstats[k], rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", TURN_ADVANTAGE_MODES)
def test_garbage_at_masked_positions_changes_nothing(backend, mode, device):
    clean, dirty = _batch(device, seed=3), _batch(device, seed=3, garbage=True)
    a, s = turn_advantages(*_op_args(clean), backend=backend, **_mode_kwargs(mode, clean))
    b, t = turn_advantages(*_op_args(dirty), backend=backend, **_mode_kwargs(mode, dirty))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for k in s:
        torch.testing.assert_close(s[k], t[k], rtol=0, atol=0)
    assert torch.isfinite(b).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_turn_gae_garbage_at_masked_positions_changes_nothing(backend, device):
    clean, dirty = _batch(device, seed=4), _batch(device, seed=4, garbage=True)
    outs = [turn_gae(*_op_args(x)[:4], x["values"], gamma=0.9, lam=0.95, outcome_rewards=x["outcome_rewards"],
                     backend=backend) for x in (clean, dirty)]
    for u, v in zip(*outs):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
        assert torch.isfinite(v).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["gigpo", "turn_discounted"])
def test_all_equal_returns_give_exactly_the_episode_part(backend, mode, device):
    x = _batch(device, seed=5)
    x["turn_rewards"] = torch.full_like(x["turn_rewards"], 0.3)
    x["state_keys"] = torch.zeros_like(x["state_keys"])  # gigpo: one step group per (prompt group, return)
    kw = _mode_kwargs(mode, x)
    kw["gamma"] = 0.0  # every return equals 0.3
    adv, stats = turn_advantages(*_op_args(x), backend=backend, **kw)
    ae, _ = group_advantages(x["outcome_rewards"], x["group_ids"], backend=backend)
    c = 1.0 if mode == "gigpo" else kw["outcome_coef"]
    expect = torch.where(x["loss_mask"], (c * ae.double())[:, None], 0.0).float()
    torch.testing.assert_close(adv, expect, rtol=1e-6, atol=1e-7)
    assert float(stats["frac_all_equal_turn_groups"]) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", TURN_ADVANTAGE_MODES)
def test_singleton_groups_and_one_turn_rows(backend, mode, device):
    # every trajectory alone in its group, one turn each: no baseline anywhere -> 0
    x = _batch(device, seed=6, B=4)
    x["group_ids"] = torch.tensor([3, 1, 4, 15], device=device)
    x["num_turns"] = torch.ones_like(x["num_turns"])
    x["loss_mask"] = x["loss_mask"] & (x["turn_index"] == 0)
    adv, stats = turn_advantages(*_op_args(x), backend=backend, **_mode_kwargs(mode, x))
    assert torch.count_nonzero(adv) == 0
    if mode != "broadcast":
        assert float(stats["frac_singleton_turn_groups"]) == 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_policy_tokens(backend, device):
    x = _batch(device, seed=7)
    x["loss_mask"] = torch.zeros_like(x["loss_mask"])
    for mode in TURN_ADVANTAGE_MODES:
        adv, stats = turn_advantages(*_op_args(x), backend=backend, **_mode_kwargs(mode, x))
        assert torch.count_nonzero(adv) == 0 and all(torch.isfinite(v) for v in stats.values())
    a, r = turn_gae(*_op_args(x)[:4], x["values"], gamma=1.0, lam=1.0, outcome_rewards=x["outcome_rewards"],
                    backend=backend)
    assert torch.count_nonzero(a) == 0 and torch.count_nonzero(r) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_turn_gae_matches_reference(backend, dtype, device):
    x = _batch(device, seed=8, dtype=dtype)
    tok = torch.randn(x["loss_mask"].shape, dtype=torch.float64).to(dtype).to(device)  # e.g. a KL penalty
    adv, ret = turn_gae(*_op_args(x)[:4], x["values"], gamma=0.9, lam=0.8, outcome_rewards=x["outcome_rewards"],
                        token_rewards=tok, backend=backend)
    c = lambda t: t.cpu()  # noqa: E731
    ra, rr = turn_gae_reference(c(x["turn_index"]), c(x["loss_mask"]), c(x["turn_rewards"]).double(),
                                c(x["num_turns"]), c(x["values"]).double(), gamma=0.9, lam=0.8,
                                outcome_rewards=c(x["outcome_rewards"]).double(), token_rewards=c(tok).double())
    assert adv.dtype == ret.dtype == torch.float32
    torch.testing.assert_close(adv.double().cpu(), ra, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double().cpu(), rr, rtol=1e-5, atol=1e-5)


def test_place_turn_rewards_matches_reference(device):
    x = _batch(device, seed=9)
    x["num_turns"][2] = 3  # a row whose last turns may lack policy tokens: drop turn 1's tokens
    x["loss_mask"][2] &= x["turn_index"][2] != 1
    r = place_turn_rewards(*_op_args(x)[:4], outcome_rewards=x["outcome_rewards"])
    c = lambda t: t.cpu()  # noqa: E731
    ref = place_turn_rewards_reference(c(x["turn_index"]), c(x["loss_mask"]), c(x["turn_rewards"]),
                                       c(x["num_turns"]), outcome_rewards=c(x["outcome_rewards"]))
    torch.testing.assert_close(r.double().cpu(), ref.double(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_turn_gae_is_gae_on_placed_rewards_whiten(backend, device):
    x = _batch(device, seed=10)
    a, r = turn_gae(*_op_args(x)[:4], x["values"], gamma=0.95, lam=0.9, whiten=True, backend=backend)
    placed = place_turn_rewards(*_op_args(x)[:4])
    b, s = gae(placed, x["values"], x["loss_mask"], gamma=0.95, lam=0.9, whiten=True, backend=backend)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(r, s, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_autograd_graph(backend, device):
    x = _batch(device, seed=11)
    for k in ("turn_rewards", "outcome_rewards", "values"):
        x[k] = x[k].clone().requires_grad_()
    for mode in TURN_ADVANTAGE_MODES:
        adv, stats = turn_advantages(*_op_args(x), backend=backend, **_mode_kwargs(mode, x))
        assert not adv.requires_grad and adv.grad_fn is None
        assert not any(v.requires_grad for v in stats.values())
    a, r = turn_gae(*_op_args(x)[:4], x["values"], gamma=0.9, lam=0.9, outcome_rewards=x["outcome_rewards"],
                    backend=backend)
    assert not a.requires_grad and not r.requires_grad


def test_expand_kernel_reads_only_present_turns(device):
    # the Triton gather directly: indices outside [0, n_b) and masked tokens give 0
    A = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], device=device)
    ti = torch.tensor([[0, 1, 2, 3, -1], [2, 1, 0, 0, 9]], device=device)
    m = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]], dtype=torch.uint8, device=device)
    out = expand_turn_advantages(A, ti, m, torch.tensor([2, 3], device=device), use_turn=True)
    torch.testing.assert_close(out.cpu(), torch.tensor([[1.0, 2.0, 0, 0, 0], [6.0, 5.0, 4.0, 0, 0]]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_equals_padded(backend, device):
    x = _batch(device, seed=13)
    lm, ti = x["loss_mask"], x["turn_index"]
    lengths = [lm.shape[1]] * lm.shape[0]  # full rows ...
    lengths = [max(1, n - b % 3) for b, n in enumerate(lengths)]  # ... trimmed to different lengths
    T = lm.shape[1]
    keep = torch.arange(T, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
    lm = lm & keep
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    pack = lambda t: torch.cat([t[b, :n] for b, n in enumerate(lengths)])[None]  # noqa: E731  [1, N]
    for mode in TURN_ADVANTAGE_MODES:
        kw = _mode_kwargs(mode, x)
        rows, s1 = turn_advantages(ti, lm, *_op_args(x)[2:], backend=backend, **kw)
        packed, s2 = turn_advantages(pack(ti), pack(lm), *_op_args(x)[2:], backend=backend, cu_seqlens=cu, **kw)
        torch.testing.assert_close(packed, pack(rows), rtol=0, atol=0)
        for k in s1:
            torch.testing.assert_close(s1[k], s2[k], rtol=0, atol=0)
    args = (x["turn_rewards"], x["num_turns"])
    a1, r1 = turn_gae(ti, lm, *args, x["values"], gamma=0.9, lam=0.9, outcome_rewards=x["outcome_rewards"],
                      backend=backend)
    a2, r2 = turn_gae(pack(ti), pack(lm), *args, pack(x["values"]), gamma=0.9, lam=0.9,
                      outcome_rewards=x["outcome_rewards"], backend=backend, cu_seqlens=cu)
    torch.testing.assert_close(a2, pack(a1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r2, pack(r1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["gigpo", "turn_discounted"])
def test_float64_returns_keep_float64_precision(backend, mode, device):
    # two trajectories whose only turn returns differ by 1e-9 (lost in float32)
    ti = torch.tensor([[0, 0, -1], [0, -1, -1]], device=device)
    lm = ti >= 0
    r = torch.tensor([[1.0], [1.0 + 1e-9]], dtype=torch.float64, device=device)
    n, out, ids = torch.tensor([1, 1], device=device), torch.zeros(2, dtype=torch.float64, device=device), \
        torch.tensor([0, 0], device=device)
    kw = dict(mode=mode, eps=1e-15, state_keys=torch.zeros(2, 1, dtype=torch.int64, device=device) if mode == "gigpo"
              else None)
    adv, stats = turn_advantages(ti, lm, r, n, out, ids, backend=backend, **kw)
    keys = None if kw["state_keys"] is None else kw["state_keys"].cpu()
    ref, _ = turn_advantages_reference(ti.cpu(), lm.cpu(), r.cpu(), n.cpu(), out.cpu(), ids.cpu(),
                                       **dict(kw, state_keys=keys))
    assert abs(float(ref[1, 0])) > 0.5
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=1e-5, atol=1e-6)
    assert float(stats["frac_all_equal_turn_groups"]) == 0.0


def test_input_errors():
    x = _batch(torch.device("cpu"), seed=12)
    args = _op_args(x)
    with pytest.raises(ValueError, match="state_keys"):
        turn_advantages(*args, mode="gigpo")
    with pytest.raises(ValueError, match="only read by mode='gigpo'"):
        turn_advantages(*args, mode="broadcast", state_keys=x["state_keys"])
    with pytest.raises(ValueError, match="mode must be one of"):
        turn_advantages(*args, mode="ppo")
    with pytest.raises(ValueError, match="norm must be one of"):
        turn_advantages(*args, norm="mad")
    with pytest.raises(ValueError, match="episode_over must be one of"):
        turn_advantages(*args, episode_over="steps")
    with pytest.raises(ValueError, match="gamma"):
        turn_advantages(*args, mode="turn_discounted", gamma=1.5)
    bad = dict(x)
    bad["turn_index"] = x["turn_index"].clone()
    bad["turn_index"][3, x["loss_mask"][3].nonzero()[0, 0]] = int(x["num_turns"][3])  # past the row's turns
    with pytest.raises(ValueError, match=r"turn_index\[3, "):
        turn_advantages(*_op_args(bad), mode="turn_discounted")
    bad = dict(x, num_turns=x["num_turns"].clone())
    bad["num_turns"][1] = 99
    with pytest.raises(ValueError, match="num_turns must be in"):
        turn_advantages(*_op_args(bad))
    bad = dict(x, turn_rewards=x["turn_rewards"].clone())
    bad["turn_rewards"][2, 0] = float("nan")  # a present turn
    with pytest.raises(ValueError, match="turn_rewards must be finite"):
        turn_advantages(*_op_args(bad), mode="turn_discounted")
    with pytest.raises(ValueError, match="outcome_rewards must have shape"):
        turn_advantages(*args[:4], x["outcome_rewards"][:3], args[5])
    with pytest.raises(TypeError, match="turn_index must be an integer tensor"):
        turn_advantages(x["turn_index"].float(), *args[1:])
    with pytest.raises(ValueError, match="values must have shape"):
        turn_gae(*args[:4], x["values"][:, :2], gamma=0.9, lam=0.9)


def test_bench_loop_baseline_equals_the_op():
    # the benchmark's Python-loop baseline computes what the op computes
    from fastrl.bench.cases_turn_advantages import _trajectories, turn_loop_gigpo

    T, ti, lm, r, keys, out, ids, spans = _trajectories(16, 3, 2, 1, group=4)
    loop = turn_loop_gigpo(spans, r.tolist(), keys.tolist(), out.tolist(), ids.tolist(), gamma=0.9, omega=0.5, T=T)
    op, _ = turn_advantages(ti, lm, r, torch.full((16,), 3), out, ids, mode="gigpo", state_keys=keys, gamma=0.9,
                            step_coef=0.5, backend="torch")
    torch.testing.assert_close(op, loop, rtol=1e-5, atol=1e-5)
    assert op.abs().sum() > 0


def test_turn_index_from_spans(device):
    # hand case: row 0 = [P0 P0 E P1 . .], row 1 has an empty turn 1 and a turn 2 at the end
    start = torch.tensor([[0, 3, 99], [1, 2, 4]], device=device)  # 99: absent turn (ignored)
    end = torch.tensor([[2, 4, -5], [2, 2, 6]], device=device)
    ti, on = turn_index_from_spans(start, end, torch.tensor([2, 3], device=device), seq_len=6)
    assert ti.cpu().tolist() == [[0, 0, -1, 1, -1, -1], [-1, 0, -1, -1, 2, 2]]
    assert torch.equal(on, ti >= 0)
    # random tables vs the reference loop; the index drives turn_advantages like the batch's own
    x = _batch(device, seed=14)
    lm, tix = x["loss_mask"].cpu(), x["turn_index"].cpu()
    B, K = x["turn_rewards"].shape
    st = torch.zeros(B, K, dtype=torch.int64)
    en = torch.zeros(B, K, dtype=torch.int64)
    for b in range(B):
        for k in range(int(x["num_turns"][b])):
            pos = ((tix[b] == k) & lm[b]).nonzero()[:, 0]
            st[b, k], en[b, k] = int(pos[0]), int(pos[-1]) + 1
    T = lm.shape[1]
    got, on = turn_index_from_spans(st.to(device), en.to(device), x["num_turns"], seq_len=T)
    ref, ref_on = turn_index_from_spans_reference(st, en, x["num_turns"].cpu(), T)
    assert torch.equal(got.cpu(), ref) and torch.equal(on.cpu(), ref_on)
    assert torch.equal(on.cpu(), lm)
    kw = _mode_kwargs("gigpo", x)
    a, _ = turn_advantages(got, on, *_op_args(x)[2:], **kw)
    b, _ = turn_advantages(*_op_args(x), **kw)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_turn_index_from_spans_errors():
    n = torch.tensor([2])
    with pytest.raises(ValueError, match="turn span 1 of row 0"):
        turn_index_from_spans(torch.tensor([[0, 1]]), torch.tensor([[2, 3]]), n, seq_len=4)  # overlap
    with pytest.raises(ValueError, match="turn span 1 of row 0"):
        turn_index_from_spans(torch.tensor([[0, 2]]), torch.tensor([[1, 9]]), n, seq_len=4)  # past T
    with pytest.raises(ValueError, match="seq_len"):
        turn_index_from_spans(torch.tensor([[0, 2]]), torch.tensor([[1, 3]]), n, seq_len=0)


def _step_sample_gigpo(rows, gamma, omega):
    """GiGPO in the step-sample formulation of verl-agent / ROLL, mean-only normalisation
    (their ``mean_norm`` / ``mean`` method), written independently: one sample per (trajectory,
    turn) carrying its trajectory's outcome; the episode mean is over the samples of the
    prompt group, the step mean over the samples of a (prompt group, state) cluster; a
    singleton cluster's mean is its own return (advantage 0)."""
    samples = []
    for b, (gid, outcome, rewards, keys) in enumerate(rows):
        run, rets = 0.0, []
        for r in reversed(rewards):
            run = r + gamma * run
            rets.append(run)
        for k, (ret, key) in enumerate(zip(reversed(rets), keys)):
            samples.append(dict(b=b, k=k, gid=gid, outcome=outcome, ret=ret, key=(gid, key)))
    out = {}
    for s_ in samples:
        ep = [o["outcome"] for o in samples if o["gid"] == s_["gid"]]
        st = [o["ret"] for o in samples if o["key"] == s_["key"]]
        ep_adv = 0.0 if len(ep) == 1 else s_["outcome"] - sum(ep) / len(ep)
        out[(s_["b"], s_["k"])] = ep_adv + omega * (s_["ret"] - sum(st) / len(st))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_gigpo_equals_the_step_sample_formulation_with_mean_norm(backend, device):
    g = torch.Generator().manual_seed(15)
    B, K = 8, 3  # equal turn counts: the cross-step episode mean is the per-trajectory mean
    ti = (torch.arange(K * 3) // 3).expand(B, K * 3).contiguous()
    lm = (torch.arange(K * 3) % 3 < 2).expand(B, K * 3).contiguous()
    r = torch.randint(0, 3, (B, K), generator=g).double()
    keys = torch.randint(0, 2, (B, K), generator=g)
    out = torch.randint(0, 2, (B,), generator=g).double()
    ids = torch.tensor([2, 2, 2, 9, 9, 9, 9, 4])
    adv, _ = turn_advantages(ti.to(device), lm.to(device), r.to(device), torch.full((B,), K, device=device),
                             out.to(device), ids.to(device), mode="gigpo", state_keys=keys.to(device), gamma=0.9,
                             step_coef=0.5, norm="none", backend=backend)
    rows = [(int(ids[b]), float(out[b]), r[b].tolist(), keys[b].tolist()) for b in range(B)]
    expect = _step_sample_gigpo(rows, 0.9, 0.5)
    for (b, k), v in expect.items():
        sel = (ti[b] == k) & lm[b]
        torch.testing.assert_close(adv[b].cpu()[sel], torch.full((int(sel.sum()),), v, dtype=torch.float32))


def _verl_agent_style_gigpo(rows, gamma, omega, norm, eps):
    """GiGPO as verl-agent computes it (``compute_gigpo_outcome_advantage`` with its defaults:
    episode statistics across step samples), our own code in its structure: one sample per
    (trajectory, turn); a one-sample group has mean 0 / std 1 at the episode level, mean =
    its own value / std 1 at the step level; std unbiased, eps added to it."""
    samples = []
    for b, (gid, outcome, rewards, keys) in enumerate(rows):
        run, rets = 0.0, []
        for r in reversed(rewards):
            run = r + gamma * run
            rets.append(run)
        for k, (ret, key) in enumerate(zip(reversed(rets), keys)):
            samples.append(dict(b=b, k=k, gid=gid, outcome=outcome, ret=ret, key=(gid, key)))

    def stats(vals, single_mean):
        t = torch.tensor(vals, dtype=torch.float64)
        return (single_mean, 1.0) if len(vals) == 1 else (float(t.mean()), float(t.std()))

    def normed(x, mean, std):
        return (x - mean) / (std + eps) if norm == "std" else x - mean

    out = {}
    for s_ in samples:
        ep = [o["outcome"] for o in samples if o["gid"] == s_["gid"]]
        st = [o["ret"] for o in samples if o["key"] == s_["key"]]
        a_e = normed(s_["outcome"], *stats(ep, 0.0))
        a_s = normed(s_["ret"], *stats(st, s_["ret"]))
        out[(s_["b"], s_["k"])] = a_e + omega * a_s
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", NORMS)
def test_episode_over_turns_reproduces_verl_agent(backend, norm, device):
    x = _batch(device, seed=16)  # unequal turn counts, a row without turns, a singleton group
    x["num_turns"][6] = 1  # the singleton group's trajectory has one turn: verl-agent's mean 0 / std 1 case
    x["loss_mask"][6] &= x["turn_index"][6] == 0
    kw = dict(mode="gigpo", state_keys=x["state_keys"], gamma=0.9, step_coef=0.5, norm=norm, eps=1e-6,
              episode_over="turns")
    adv, _ = turn_advantages(*_op_args(x), backend=backend, **kw)
    ref, _ = turn_advantages_reference(*_ref_args(x), **dict(kw, state_keys=x["state_keys"].cpu()))
    torch.testing.assert_close(adv.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    c = {k: v.cpu() for k, v in x.items()}
    rows = []
    for b in range(len(c["group_ids"])):
        n = int(c["num_turns"][b])
        rows.append((int(c["group_ids"][b]), float(c["outcome_rewards"][b]), c["turn_rewards"][b, :n].tolist(),
                     c["state_keys"][b, :n].tolist()))
    expect = _verl_agent_style_gigpo(rows, 0.9, 0.5, norm, 1e-6)
    assert abs(expect[(6, 0)] - float(c["outcome_rewards"][6]) / (1 + 1e-6 if norm == "std" else 1.0)) < 1e-9
    for (b, k), v in expect.items():
        sel = (c["turn_index"][b] == k) & c["loss_mask"][b]
        torch.testing.assert_close(adv[b].cpu()[sel], torch.full((int(sel.sum()),), v, dtype=torch.float32),
                                   rtol=1e-5, atol=1e-5)
