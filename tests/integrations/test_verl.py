"""fastrl.integrations.verl against the installed verl: each function equals verl's own.

Random inputs with observation tokens (mask 0) in the middle of responses and trailing
padding, single-member groups, all-equal groups, every loss_agg_mode, global batch info
(dp_size > 1), rollout IS weights; values, gradients and metrics are compared.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]' && pip install --no-deps verl==0.9.1)")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl's core_algos does not import")

from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.workers.config.actor import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig  # noqa: E402

from fastrl.integrations import verl as fv  # noqa: E402

B, T = 9, 12
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _mask() -> torch.Tensor:
    lengths = [12, 9, 5, 1, 12, 7, 3, 10, 6]
    m = torch.zeros(B, T)
    for b, n in enumerate(lengths):
        m[b, :n] = 1
    m[0, 3:6] = 0  # observation tokens in the middle of a response
    m[4, 1] = 0
    m[7, 4:8] = 0
    return m


def _index() -> np.ndarray:
    # groups: a (4 members), b (3, all-equal rewards), c (1 member), d (1 member)
    return np.array(["a", "b", "a", "c", "b", "a", "b", "a", "d"], dtype=object)


def _outcome_rewards(g: torch.Generator, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.randn(B, generator=g)
    scores[[1, 4, 6]] = 0.5  # all-equal group "b" (exactly representable, so both means are exact)
    r = torch.zeros(B, T)
    last = (mask * torch.arange(T)).argmax(-1)
    r[torch.arange(B), last] = scores
    return r


def _assert_masked_close(got, ref, mask, **kw):
    m = mask.bool()
    torch.testing.assert_close(got[m], ref[m], **kw)
    assert torch.all(got[~m] == 0)


# ----------------------------------------------------------------------------- advantages
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_verl(gamma, lam):
    g = torch.Generator().manual_seed(0)
    mask = _mask()
    rewards = torch.randn(B, T, generator=g)  # dense rewards, also on observation tokens (verl skips them)
    values = torch.randn(B, T, generator=g)
    adv_ref, ret_ref = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    adv, ret = fv.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    _assert_masked_close(adv, adv_ref, mask, rtol=1e-5, atol=1e-5)
    _assert_masked_close(ret, ret_ref, mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_outcome_advantage_matches_verl(norm):
    g = torch.Generator().manual_seed(1)
    mask = _mask()
    rewards = _outcome_rewards(g, mask)
    ref = core_algos.compute_grpo_outcome_advantage(rewards, mask, _index(), norm_adv_by_std_in_grpo=norm)
    got = fv.compute_grpo_outcome_advantage(rewards, mask, _index(), norm_adv_by_std_in_grpo=norm)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)
    # single-member groups keep their (scaled) raw score; the all-equal group gets 0
    assert got[0][3].abs().sum() > 0 and got[0][[1, 4, 6]].abs().sum() == 0


def test_rloo_outcome_advantage_matches_verl():
    g = torch.Generator().manual_seed(2)
    mask = _mask()
    rewards = _outcome_rewards(g, mask)
    ref = core_algos.compute_rloo_outcome_advantage(rewards, mask, _index())
    got = fv.compute_rloo_outcome_advantage(rewards, mask, _index())
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_verl(gamma):
    g = torch.Generator().manual_seed(3)
    mask = _mask()
    rewards = torch.randn(B, T, generator=g) * (torch.rand(B, T, generator=g) < 0.3)
    config = AlgoConfig(gamma=gamma)
    ref = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=config)
    got = fv.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=config)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- losses
def _actor_config(loss_mode: str, agg: str, global_info: dict, clip_c: float = 3.0) -> ActorConfig:
    cfg = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=clip_c,
        loss_agg_mode=agg,
        policy_loss=VerlPolicyLossConfig(loss_mode=loss_mode),
    )
    cfg.global_batch_info.update(global_info)
    return cfg


def _policy_inputs(seed: int, token_level_adv: bool):
    g = torch.Generator().manual_seed(seed)
    mask = _mask()
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g)
    logp[2, 0] = old[2, 0] + 25.0  # beyond verl's +-20 log-ratio clamp
    adv = torch.randn(B, T, generator=g) if token_level_adv else torch.randn(B, 1, generator=g).expand(B, T)
    adv = adv * mask
    weights = torch.rand(B, T, generator=g) * 2
    weights[1, 2] = 0.0
    return old, logp, adv.contiguous(), mask, weights


def _run_loss(fn, old, logp, adv, mask, agg, config, weights):
    lp = logp.clone().requires_grad_(True)
    loss, metrics = fn(old, lp, adv, mask, loss_agg_mode=agg, config=config, rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), lp.grad, metrics


GLOBAL_INFOS = {
    "local": {},
    "dp2": {"dp_size": 2, "batch_num_tokens": 97, "global_batch_size": 17, "loss_scale_factor": 16},
}


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("info", list(GLOBAL_INFOS))
@pytest.mark.parametrize("loss", ["vanilla", "gspo"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_policy_losses_match_verl(agg, info, loss, with_weights):
    old, logp, adv, mask, weights = _policy_inputs(4, token_level_adv=(loss == "vanilla"))
    if loss == "gspo":  # keep every sequence ratio inside verl's log-clamp at 10 (see the docstring)
        logp = old + 0.05 * (logp - old).clamp(-3, 3)
    w = weights if with_weights else None
    config = _actor_config(loss, agg, GLOBAL_INFOS[info])
    ref_fn = core_algos.get_policy_loss_fn(loss)
    got_fn = {"vanilla": fv.compute_policy_loss_vanilla, "gspo": fv.compute_policy_loss_gspo}[loss]
    l_ref, g_ref, m_ref = _run_loss(ref_fn, old, logp, adv, mask, agg, config, w)
    l_got, g_got, m_got = _run_loss(got_fn, old, logp, adv, mask, agg, config, w)
    torch.testing.assert_close(l_got, l_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_got, g_ref, rtol=1e-5, atol=1e-7)
    assert m_got.keys() == m_ref.keys()
    for k in m_ref:
        assert m_got[k] == pytest.approx(m_ref[k], rel=1e-5, abs=1e-7), k


def test_gspo_with_per_token_advantages_matches_verl():
    old, logp, adv, mask, _ = _policy_inputs(5, token_level_adv=True)
    logp = old + 0.05 * (logp - old).clamp(-3, 3)
    config = _actor_config("gspo", "token-mean", {})
    ref = _run_loss(core_algos.compute_policy_loss_gspo, old, logp, adv, mask, "token-mean", config, None)
    got = _run_loss(fv.compute_policy_loss_gspo, old, logp, adv, mask, "token-mean", config, None)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"])
def test_kl_penalty_matches_verl(name):
    g = torch.Generator().manual_seed(6)
    logp = -torch.rand(B, T, generator=g) * 4
    ref = logp + 1.5 * torch.randn(B, T, generator=g)
    ref[0, 0] = logp[0, 0] + 30.0  # k3 beyond verl's clamps
    ref[0, 1] = logp[0, 1] - 30.0
    outs = []
    for fn in (core_algos.kl_penalty, fv.kl_penalty):
        a = logp.clone().requires_grad_(True)
        r = ref.clone().requires_grad_(True)
        k = fn(a, r, name)
        (k * torch.linspace(0.5, 1.5, T)).sum().backward()
        outs.append((k.detach(), a.grad, r.grad))
    for o, r_ in zip(outs[1], outs[0]):
        torch.testing.assert_close(o, r_, rtol=1e-5, atol=1e-6)
    with pytest.raises(NotImplementedError):
        fv.kl_penalty(logp, ref, "full")


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("info", list(GLOBAL_INFOS))
def test_value_loss_matches_verl(agg, info):
    g = torch.Generator().manual_seed(7)
    mask = _mask()
    values = torch.randn(B, T, generator=g)
    returns = torch.randn(B, T, generator=g)
    vpreds = values + 0.5 * torch.randn(B, T, generator=g)
    kw = dict(loss_agg_mode=agg, **GLOBAL_INFOS[info])
    outs = []
    for fn in (core_algos.compute_value_loss, fv.compute_value_loss):
        v = vpreds.clone().requires_grad_(True)
        loss, clipfrac = fn(v, returns, values, mask, 0.2, **kw)
        loss.backward()
        outs.append((loss.detach(), v.grad, torch.as_tensor(clipfrac, dtype=torch.float32)))
    for o, r in zip(outs[1], outs[0]):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("info", list(GLOBAL_INFOS))
def test_agg_loss_matches_verl(agg, info):
    g = torch.Generator().manual_seed(8)
    mask = _mask()
    mask[5] = 0  # a fully masked row
    loss_mat = torch.randn(B, T, generator=g)
    loss_mat[~mask.bool()] = 1e3  # never read (verl's seq-* modes would propagate NaN there; fastrl ignores it)
    ref = core_algos.agg_loss(loss_mat, mask, agg, **GLOBAL_INFOS[info])
    got = fv.agg_loss(loss_mat, mask, agg, **GLOBAL_INFOS[info])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)


def test_dp_without_global_counts_raises_like_verl():
    mask = _mask()
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fv.agg_loss(torch.zeros(B, T), mask, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="Invalid loss_agg_mode"):
        fv.agg_loss(torch.zeros(B, T), mask, "nope")


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_dp_needs_the_count_its_mode_uses(agg):
    # the count a mode uses is fastrl's aggregation rule; the other one does not stand in for it
    mask = _mask()
    with pytest.raises(ValueError, match="global_batch_size is required"):
        fv.agg_loss(torch.zeros(B, T), mask, agg, dp_size=2, batch_num_tokens=97, loss_scale_factor=16)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        fv.agg_loss(torch.zeros(B, T), mask, "token-mean", dp_size=2, global_batch_size=17)


def test_register_puts_fastrl_functions_into_verl_registries(monkeypatch):
    monkeypatch.setattr(core_algos, "compute_gae_advantage_return", core_algos.compute_gae_advantage_return)
    monkeypatch.setattr(core_algos, "compute_grpo_outcome_advantage", core_algos.compute_grpo_outcome_advantage)
    fv.register()
    fv.register()  # idempotent
    assert core_algos.get_policy_loss_fn("fastrl_vanilla") is fv.compute_policy_loss_vanilla
    assert core_algos.get_policy_loss_fn("fastrl_gspo") is fv.compute_policy_loss_gspo
    assert core_algos.get_policy_loss_fn("vanilla") is not fv.compute_policy_loss_vanilla
    for name in ("fastrl_grpo", "fastrl_rloo", "fastrl_reinforce_plus_plus", "fastrl_gigpo", "fastrl_turn_discounted"):
        assert core_algos.get_adv_estimator_fn(name) is fv.ADV_ESTIMATORS[name]
    fv.register(replace_builtin=True)
    assert core_algos.compute_gae_advantage_return is fv.compute_gae_advantage_return

    # the registered GRPO estimator called the way verl's trainer calls non-builtin estimators
    g = torch.Generator().manual_seed(9)
    mask = _mask()
    rewards = _outcome_rewards(g, mask)
    for norm in (True, False):
        algo = AlgoConfig(norm_adv_by_std_in_grpo=norm)
        got = core_algos.get_adv_estimator_fn("fastrl_grpo")(
            token_level_rewards=rewards, response_mask=mask, config=algo, index=_index()
        )
        ref = core_algos.get_adv_estimator_fn("grpo")(rewards, mask, _index(), norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- turn credit (issue 19)
def _multi_turn_rows():
    """verl agent-loop rows: 2 uids x 3 rows of [turn | observation | turn | observation | turn],
    observations drawn from two texts (so some turns of a uid act in the same state), a
    tool reward on some turns' last token and the score on the last response token."""
    g = torch.Generator().manual_seed(5)
    L = 16
    layouts = [[(0, 3), (5, 8), (10, 12)], [(0, 2), (4, 6)], [(0, 3), (5, 7), (9, 11)],
               [(0, 1)], [(0, 2), (4, 7), (9, 13)], [(0, 3), (5, 6)]]
    observations = [[7, 8], [9, 9]]
    responses = torch.randint(20, 40, (6, L), generator=g)
    mask = torch.zeros(6, L)
    rewards = torch.zeros(6, L)
    for b, spans in enumerate(layouts):
        for k, (s, e) in enumerate(spans):
            mask[b, s:e] = 1
            if k + 1 < len(spans):
                responses[b, e:spans[k + 1][0]] = torch.tensor(observations[(b + k) % 3 == 0])
                rewards[b, e - 1] = float(torch.rand((), generator=g) < 0.5) * 0.25
        rewards[b, spans[-1][1] - 1] += float(torch.randint(0, 2, (), generator=g))
    uid = np.array(["p", "p", "p", "q", "q", "q"], dtype=object)
    return responses, mask, rewards, uid, layouts


def _turn_reference(mode, responses, mask, rewards, uid, layouts, *, gamma, step_coef=1.0, turn_coef=1.0,
                    outcome_coef=0.0, keys=None, norm="std", final_turn_coef=None):
    """fastrl's reference op on the rows' turns, found by Python loops (the anchor of turn k:
    the observation tokens before it as a tuple, or ``keys``)."""
    from fastrl.reference.turn_advantages import turn_advantages_reference

    Bm, L = mask.shape
    K = max(len(s) for s in layouts)
    ti = torch.full((Bm, L), -1, dtype=torch.int64)
    r = torch.zeros(Bm, K, dtype=torch.float64)
    anchors = torch.zeros(Bm, K, dtype=torch.int64)
    names: dict = {}
    for b, spans in enumerate(layouts):
        for k, (s, e) in enumerate(spans):
            ti[b, s:e] = k
            nxt = spans[k + 1][0] if k + 1 < len(spans) else L
            r[b, k] = float(rewards[b, s:nxt].double().sum())
            key = ("start",) if k == 0 else tuple(responses[b, spans[k - 1][1]:s].tolist())
            if keys is not None:
                key = keys[b][k]
            anchors[b, k] = names.setdefault(key, len(names))
    gid = torch.tensor([0 if u == "p" else 1 for u in uid])
    return turn_advantages_reference(ti, mask, r, torch.tensor([len(s) for s in layouts]),
                                     rewards.double().sum(-1), gid, mode=mode,
                                     state_keys=anchors if mode == "gigpo" else None, gamma=gamma,
                                     step_coef=step_coef, turn_coef=turn_coef, outcome_coef=outcome_coef, norm=norm,
                                     final_turn_coef=final_turn_coef)[0]


@pytest.mark.parametrize("norm", [True, False])
def test_turn_estimators_through_verls_registry_match_the_reference(norm):
    fv.register()
    responses, mask, rewards, uid, layouts = _multi_turn_rows()
    algo = AlgoConfig(gamma=0.9, norm_adv_by_std_in_grpo=norm)
    f_norm = "std" if norm else "none"
    gigpo = core_algos.get_adv_estimator_fn("fastrl_gigpo")
    got, returns = gigpo(token_level_rewards=rewards, response_mask=mask, index=uid, config=algo,
                         batch={"responses": responses})
    want = _turn_reference("gigpo", responses, mask, rewards, uid, layouts, gamma=0.9, norm=f_norm)
    _assert_masked_close(got.double(), want, mask, rtol=1e-5, atol=1e-6)
    assert torch.equal(got, returns)
    assert (got[mask.bool()] != got[mask.bool()][0]).any()  # per-token credit, not one value per row
    # the state keys the rollout names (non_tensor_batch["anchor_keys"]) replace the observation hash
    keys = [[f"s{(b * 7 + k) % 4}" for k in range(len(s))] for b, s in enumerate(layouts)]
    given = np.empty(len(keys), dtype=object)
    given[:] = keys
    got_k, _ = gigpo(token_level_rewards=rewards, response_mask=mask, index=uid, config=algo,
                     non_tensor_batch={"anchor_keys": given, "uid": uid})
    want_k = _turn_reference("gigpo", responses, mask, rewards, uid, layouts, gamma=0.9, keys=keys, norm=f_norm)
    _assert_masked_close(got_k.double(), want_k, mask, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="anchor_keys"):
        gigpo(token_level_rewards=rewards, response_mask=mask, index=uid, config=algo)
    # turn_discounted needs nothing more than verl passes every estimator
    td = core_algos.get_adv_estimator_fn("fastrl_turn_discounted")
    got_t, _ = td(token_level_rewards=rewards, response_mask=mask, index=uid,
                  config=AlgoConfig(gamma=0.0, norm_adv_by_std_in_grpo=norm), outcome_coef=1.0, turn_coef=0.5)
    want_t = _turn_reference("turn_discounted", responses, mask, rewards, uid, layouts, gamma=0.0, turn_coef=0.5,
                             outcome_coef=1.0, norm=f_norm)
    _assert_masked_close(got_t.double(), want_t, mask, rtol=1e-5, atol=1e-6)
    # MT-GRPO exactly: the final turn gets the outcome advantage alone
    got_m, _ = td(token_level_rewards=rewards, response_mask=mask, index=uid,
                  config=AlgoConfig(gamma=0.0, norm_adv_by_std_in_grpo=norm), outcome_coef=1.0, turn_coef=0.5,
                  final_turn_coef=0.0)
    want_m = _turn_reference("turn_discounted", responses, mask, rewards, uid, layouts, gamma=0.0, turn_coef=0.5,
                             outcome_coef=1.0, norm=f_norm, final_turn_coef=0.0)
    _assert_masked_close(got_m.double(), want_m, mask, rtol=1e-5, atol=1e-6)
    assert (got_m - got_t).abs().max() > 1e-3


def test_the_wrapped_compute_advantage_hands_the_batch_to_the_turn_estimators():
    """verl's trainer gives registered estimators only token rewards, mask, uid and config;
    the wrapper ``register`` installs passes the DataProto's batch for fastrl_gigpo and leaves
    every other estimator to verl's function."""
    from verl import DataProto

    responses, mask, rewards, uid, layouts = _multi_turn_rows()
    data = DataProto.from_dict(tensors={"responses": responses, "response_mask": mask, "token_level_rewards": rewards},
                               non_tensors={"uid": uid})
    seen = []

    def verls(data, adv_estimator, *args, **kwargs):  # the function being wrapped (a seam: verl's needs torchdata)
        seen.append(adv_estimator)
        return data

    wrapped = fv._wrap_compute_advantage(verls)
    assert fv._wrap_compute_advantage(wrapped) is wrapped  # idempotent
    out = wrapped(data, "fastrl_gigpo", gamma=1.0, lam=1.0, config=AlgoConfig(gamma=0.9))
    want = _turn_reference("gigpo", responses, mask, rewards, uid, layouts, gamma=0.9)
    _assert_masked_close(out.batch["advantages"].double(), want, mask, rtol=1e-5, atol=1e-6)
    assert seen == []
    wrapped(data, "grpo", config=AlgoConfig())
    assert seen == ["grpo"]


# ----------------------------------------------------------------------------- the README's route, fresh process
# Run in a fresh interpreter with the README block's environment: verl's own import of
# VERL_USE_EXTERNAL_MODULES registers fastrl; verl's ppo_trainer config is composed with the
# block's overrides (hydra rejects a key verl does not have); the functions verl's registries
# return for those settings are called the way verl's trainer calls them and compared with
# fastrl's ops and with verl's built-in functions.
FRESH_PROCESS_CHECK = r"""
import json, os, sys
import numpy as np
import torch
import verl  # imports the modules named in VERL_USE_EXTERNAL_MODULES
from hydra import compose, initialize_config_dir
from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass
import fastrl.integrations.verl as fv
from fastrl.config import PolicyLossConfig
from fastrl.ops import gae, group_advantages, masked_whiten, policy_loss

overrides = json.loads(sys.argv[1])
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
    # the micro-batch size stands in for the README's "...": verl's actor config requires one
    cfg = compose(config_name="ppo_trainer", overrides=overrides + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
algo = omega_conf_to_dataclass(cfg.algorithm)
actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
g = torch.Generator().manual_seed(0)
B, T = 8, 7
mask = torch.zeros(B, T)
for b, n in enumerate([7, 5, 3, 7, 1, 6, 4, 2]):
    mask[b, :n] = 1
uid = np.array(["a", "a", "a", "b", "b", "b", "c", "c"], dtype=object)
gid = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
scores = torch.randn(B, generator=g)
last = (mask * torch.arange(T)).argmax(-1)
rewards = torch.zeros(B, T)
rewards[torch.arange(B), last] = scores
report = {"adv_estimator": algo.adv_estimator, "loss_mode": actor.policy_loss.loss_mode}
for name, fn in {**fv.ADV_ESTIMATORS, **fv.POLICY_LOSSES}.items():  # every fastrl_* name is registered
    lookup = core_algos.get_adv_estimator_fn if name in fv.ADV_ESTIMATORS else core_algos.get_policy_loss_fn
    assert lookup(name) is fn, name

# advantages, as verl's trainer (ray_trainer.compute_advantage) calls them
if algo.adv_estimator == "gae":
    values = torch.randn(B, T, generator=g) * mask
    fn = core_algos.compute_gae_advantage_return  # the module attribute the trainer calls
    assert fn is fv.compute_gae_advantage_return, "FASTRL_VERL_REPLACE_BUILTIN=1 did not route gae to fastrl"
    adv, ret = fn(token_level_rewards=rewards, values=values, response_mask=mask, gamma=algo.gamma, lam=algo.lam)
    ref_adv, ref_ret = gae(rewards, values, mask, gamma=algo.gamma, lam=algo.lam)
    ref_adv = masked_whiten(ref_adv, mask, shift_mean=True, eps=1e-8)
    builtin = core_algos.get_adv_estimator_fn("gae")(rewards, values, mask, gamma=algo.gamma, lam=algo.lam)[0]
else:
    fn = core_algos.get_adv_estimator_fn(algo.adv_estimator)
    assert fn is fv.ADV_ESTIMATORS[algo.adv_estimator], fn
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, config=algo, index=uid)
    mode = "grpo" if algo.norm_adv_by_std_in_grpo else "dr_grpo"
    ref_adv = group_advantages(scores, gid, mode=mode, eps=1e-6)[0][:, None] * mask
    builtin = core_algos.get_adv_estimator_fn("grpo")(rewards, mask, uid, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)[0]
m = mask.bool()
torch.testing.assert_close(adv[m], ref_adv[m], rtol=1e-5, atol=1e-6)
torch.testing.assert_close(adv[m], builtin[m], rtol=1e-5, atol=1e-5)
report["adv_max_diff_vs_fastrl_ops"] = float((adv - ref_adv)[m].abs().max())
report["adv_max_diff_vs_verl_builtin"] = float((adv - builtin)[m].abs().max())

# policy loss, as verl's worker (verl.workers.utils.losses.ppo_loss) calls it
loss_fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
assert loss_fn is fv.POLICY_LOSSES[actor.policy_loss.loss_mode], loss_fn
old = -torch.rand(B, T, generator=g) * 3
logp = (old + 0.5 * torch.randn(B, T, generator=g)).requires_grad_(True)
loss, metrics = loss_fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask.bool(),
                        loss_agg_mode=actor.loss_agg_mode, config=actor, rollout_is_weights=None)
(grad,) = torch.autograd.grad(loss, logp)
lp = logp.detach().clone().requires_grad_(True)
op_cfg = PolicyLossConfig(clip_low=actor.clip_ratio_low, clip_high=actor.clip_ratio_high, dual_clip=actor.clip_ratio_c,
                          log_ratio_clamp=20.0, loss_agg=actor.loss_agg_mode)
ref_loss = policy_loss(lp, old, adv, mask, config=op_cfg)[0]
(ref_grad,) = torch.autograd.grad(ref_loss, lp)
lp2 = logp.detach().clone().requires_grad_(True)
verl_loss = core_algos.get_policy_loss_fn("vanilla")(old_log_prob=old, log_prob=lp2, advantages=adv, response_mask=mask.bool(),
                                                     loss_agg_mode=actor.loss_agg_mode, config=actor, rollout_is_weights=None)[0]
(verl_grad,) = torch.autograd.grad(verl_loss, lp2)
torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
torch.testing.assert_close(loss, verl_loss, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(grad, verl_grad, rtol=1e-5, atol=1e-7)
report.update(loss=float(loss), loss_vs_fastrl_op=float((loss - ref_loss).abs()), loss_vs_verl_vanilla=float((loss - verl_loss).abs()),
              grad_max_diff_vs_fastrl_op=float((grad - ref_grad).abs().max()))
print("RESULT " + json.dumps(report))
"""


def _readme_verl_blocks() -> list[tuple[dict[str, str], list[str]]]:
    """(environment, overrides) of each ```bash block in the docs' verl section (docs/integrations.md)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = page.split("## verl", 1)[1].split("\n## ", 1)[0]
    blocks = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        env = dict(re.findall(r"^export (\w+)=(\S+)", block, flags=re.M))
        command = block.split("python -m verl.trainer.main_ppo", 1)[1]
        overrides = [t for t in command.replace("\\\n", " ").split() if "=" in t]
        blocks.append((env, overrides))
    return blocks


README_VERL_BLOCKS = _readme_verl_blocks()


def test_the_readme_documents_a_grpo_and_a_ppo_route():
    estimators = [dict(o.split("=", 1) for o in overrides)["algorithm.adv_estimator"] for _, overrides in README_VERL_BLOCKS]
    assert estimators == ["fastrl_grpo", "gae"]
    for env, overrides in README_VERL_BLOCKS:
        assert env["VERL_USE_EXTERNAL_MODULES"] == "fastrl.integrations.verl_plugin"
        assert "actor_rollout_ref.actor.policy_loss.loss_mode=fastrl_vanilla" in overrides


@pytest.mark.parametrize("block", range(len(README_VERL_BLOCKS)), ids=["grpo", "ppo"][: len(README_VERL_BLOCKS)])
def test_the_readme_config_lines_run_fastrl_through_verls_registries_in_a_fresh_process(block):
    import json
    import os
    import subprocess
    import sys

    env_vars, overrides = README_VERL_BLOCKS[block]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "FASTRL_VERL_REPLACE_BUILTIN")}
    env.update(env_vars, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS_CHECK, json.dumps(overrides)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    expected = dict(o.split("=", 1) for o in overrides)
    assert result["adv_estimator"] == expected["algorithm.adv_estimator"]
    assert result["loss_mode"] == expected["actor_rollout_ref.actor.policy_loss.loss_mode"]


def test_without_the_plugin_verl_has_no_fastrl_names():
    """The control: the same fresh process without VERL_USE_EXTERNAL_MODULES fails to find fastrl_grpo."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "FASTRL_VERL_REPLACE_BUILTIN")}
    code = ("import verl\nfrom verl.trainer.ppo import core_algos\n"
            "try:\n    core_algos.get_adv_estimator_fn('fastrl_grpo')\nexcept ValueError:\n    print('unknown')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "unknown", (out.stdout, out.stderr[-2000:])
