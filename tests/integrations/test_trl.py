"""fastrl.integrations.trl against the installed TRL: same loss, gradients, grad norm and updates.

Two levels:
- loss level: one generated batch (with synthetic stale old / reference / vLLM log-probs so
  that clipping, KL and IS weights are all active); TRL's own ``GRPOTrainer._compute_loss``
  and fastrl's on the same trainer, for every supported option; values and parameter
  gradients must agree, and the expected fastrl path must have run (fused op, two-stage
  ``linear_logprobs`` + ``policy_loss``; cispo/sapo/vespo are ``PolicyLossConfig.surrogate``
  entries on either path), never TRL's fallback. The entropy bonus (static and adaptive) likewise.
- end to end: two optimizer steps (gradient accumulation 2) of TRL's trainer and of fastrl's
  from the same seed, per loss type; logged losses, grad norms and the updated parameters
  must agree.
Everything runs on CPU in float32 with a tiny Llama built from a config (no downloads).
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'trl>=1.16,<1.17')")
sys.path.insert(0, os.path.dirname(__file__))

from trl import GRPOConfig  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer  # noqa: E402
from trl_tiny import build_tiny_llama, count_a_reward, prompt_dataset  # noqa: E402

import fastrl.ops as ops  # noqa: E402
from fastrl.integrations.trl import FastRLGRPOTrainer, GRPOTrainer, trl_loss_config  # noqa: E402


def _config(out: str, **overrides) -> GRPOConfig:
    kw = dict(
        output_dir=out,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        seed=0,
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        gradient_accumulation_steps=2,
        disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32},
    )
    kw.update(overrides)
    return GRPOConfig(**kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


# ---------------------------------------------------------------------------------- loss level
@pytest.fixture(scope="module")
def batch(model_dir, tmp_path_factory):
    """A trainer and one generated batch with stale old/ref/vLLM log-probs and mixed-sign advantages."""
    trainer = FastRLGRPOTrainer(
        model=model_dir,
        reward_funcs=count_a_reward,
        args=_config(str(tmp_path_factory.mktemp("out")), beta=0.0),
        train_dataset=prompt_dataset(8),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, att, inputs["completion_ids"].size(1)
        )
    g = torch.Generator().manual_seed(1)
    n, t = logp.shape
    noise = lambda s: s * torch.randn(n, t, generator=g)  # noqa: E731
    inputs["old_per_token_logps"] = logp + noise(0.3)
    inputs["ref_per_token_logps"] = logp + noise(0.3)
    inputs["sampling_per_token_logps"] = inputs["old_per_token_logps"] + noise(0.2)
    inputs["advantages"] = torch.randn(n, generator=g)
    tok_is = torch.exp(inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]).clamp(max=2.0)
    tok_is[0, 1] = 0.0  # a masked-out token (token_mask mode)
    # TRL builds the ratio from (old - sampling) * mask: exactly 1 at padding (VESPO sums its log over every position)
    tok_is = torch.where(inputs["completion_mask"] > 0, tok_is, 1.0)
    inputs["_is_token"] = tok_is
    inputs["_is_seq"] = torch.tensor([[1.3], [0.0], [0.7], [2.0]])[:n]
    return trainer, inputs


def _grads(fn, trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = fn(trainer, trainer.model, inputs)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(ref, got, rtol=2e-5):
    (l_ref, g_ref), (l_got, g_got) = ref, got
    torch.testing.assert_close(l_got, l_ref, rtol=rtol, atol=1e-7)
    assert g_ref.keys() == g_got.keys()
    for k in g_ref:
        scale = g_ref[k].abs().max().item()
        torch.testing.assert_close(g_got[k], g_ref[k], rtol=rtol, atol=rtol * max(scale, 1e-6), msg=k)


CASES = {
    # id: (trainer attributes, args fields, input edits, op expected to run)
    "grpo": ({"loss_type": "grpo"}, {}, {}, "fused"),
    "bnpo": ({"loss_type": "bnpo"}, {}, {}, "fused"),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {}, {}, "fused"),
    "dapo_clip_higher": ({"loss_type": "dapo", "epsilon_high": 0.28}, {}, {}, "fused"),
    "luspo_sequence": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, {}, {}, "fused"),
    "grpo_sequence_gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon_low": 0.05, "epsilon_high": 0.08},
        {},
        {},
        "fused",
    ),
    "grpo_delta": ({"loss_type": "grpo", "epsilon_low": 0.1, "epsilon_high": 0.1}, {"delta": 1.2}, {}, "fused"),
    "bnpo_kl": ({"loss_type": "bnpo", "beta": 0.04}, {"use_bias_correction_kl": False}, {}, "fused"),
    "grpo_kl_bias_corrected": ({"loss_type": "grpo", "beta": 0.04}, {"use_bias_correction_kl": True}, {}, "logp"),
    "dapo_kl_bias_corrected_seq": (
        {"loss_type": "dapo", "beta": 0.1, "importance_sampling_level": "sequence"},
        {"use_bias_correction_kl": True},
        {},
        "logp",
    ),
    "dapo_vllm_token_is": (
        {"loss_type": "dapo", "use_vllm": True, "vllm_importance_sampling_correction": True},
        {},
        {"importance_sampling_ratio": "_is_token"},
        "fused",
    ),
    "grpo_vllm_sequence_is_kl": (
        {"loss_type": "grpo", "beta": 0.02, "use_vllm": True, "vllm_importance_sampling_correction": True},
        {"use_bias_correction_kl": False},
        {"importance_sampling_ratio": "_is_seq"},
        "fused",
    ),
    "dr_grpo_on_policy": ({"loss_type": "dr_grpo"}, {}, {"old_per_token_logps": None}, "fused"),
    "bnpo_top_entropy": ({"loss_type": "bnpo", "top_entropy_quantile": 0.5}, {}, {}, "logp"),
    "grpo_off_policy_mask": ({"loss_type": "grpo", "off_policy_mask_threshold": 0.05}, {}, {}, "logp"),
    "dapo_tool_mask": ({"loss_type": "dapo"}, {}, {"tool_mask": "_tool_mask"}, "fused"),
    # cispo / sapo / vespo: PolicyLossConfig.surrogate; the fused op unless a setting needs the log-probs
    # (vespo always: its logged row weight)
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.1}, {}, {}, "fused"),
    "cispo_kl_vllm_token_is": (
        {"loss_type": "cispo", "epsilon_high": 1.1, "beta": 0.04, "use_vllm": True,
         "vllm_importance_sampling_correction": True},
        {"use_bias_correction_kl": False},
        {"importance_sampling_ratio": "_is_token"},
        "fused",
    ),
    "sapo": ({"loss_type": "sapo"}, {"sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}, {}, "fused"),
    "sapo_sequence_kl_bias_corrected": (
        {"loss_type": "sapo", "importance_sampling_level": "sequence", "beta": 0.1},
        {"sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5, "use_bias_correction_kl": True},
        {},
        "logp",
    ),
    "sapo_off_policy_mask_top_entropy": (
        {"loss_type": "sapo", "off_policy_mask_threshold": 0.05, "top_entropy_quantile": 0.5}, {}, {}, "logp",
    ),
    "vespo": ({"loss_type": "vespo"}, {}, {}, "logp"),
    "vespo_vllm_token_is_kl": (
        {"loss_type": "vespo", "beta": 0.04, "use_vllm": True, "vllm_importance_sampling_correction": True},
        {"use_bias_correction_kl": False, "vespo_k_pos": 1.5, "vespo_lambda_neg": 1.0},
        {"importance_sampling_ratio": "_is_token"},
        "logp",
    ),
    "vespo_on_policy": ({"loss_type": "vespo"}, {}, {"old_per_token_logps": None}, "logp"),
    # entropy bonus (TRL's entropy_coef): differentiable entropy from linear_logprobs
    "grpo_entropy_bonus": ({"loss_type": "grpo", "entropy_coef": 0.05, "_entropy_bonus_enabled": True}, {}, {}, "logp"),
    "dapo_entropy_bonus_top_entropy": (
        {"loss_type": "dapo", "entropy_coef": 0.05, "_entropy_bonus_enabled": True, "top_entropy_quantile": 0.5},
        {},
        {},
        "logp",
    ),
    "cispo_entropy_bonus": (
        {"loss_type": "cispo", "epsilon_high": 1.1, "entropy_coef": 0.05, "_entropy_bonus_enabled": True},
        {},
        {},
        "logp",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_grads_match_trl(batch, case, monkeypatch):
    trainer, base_inputs = batch
    attrs, args, edits, path = CASES[case]
    for k, v in attrs.items():
        monkeypatch.setattr(trainer, k, v)
    for k, v in args.items():
        monkeypatch.setattr(trainer.args, k, v)
    inputs = {k: v for k, v in base_inputs.items() if not k.startswith("_")}
    for k, v in edits.items():
        if v is None:
            inputs.pop(k)
        elif v == "_tool_mask":
            tm = torch.ones_like(inputs["completion_mask"])
            tm[:, 2:4] = 0  # observation tokens in the middle of the completions
            inputs[k] = tm
        else:
            inputs[k] = base_inputs[v]
    assert trainer.fastrl_fallback_reason is None

    calls = {"fused": 0, "logp": 0, "linear": 0}
    fused, plain, linear = ops.fused_linear_policy_loss, ops.policy_loss, ops.linear_logprobs

    def count_fused(*a, **k):
        calls["fused"] += 1
        return fused(*a, **k)

    def count_plain(*a, **k):
        calls["logp"] += 1
        return plain(*a, **k)

    def count_linear(*a, **k):
        if k.get("return_entropy"):  # the differentiable two-stage call (the fused path's no-grad one has none)
            calls["linear"] += 1
        return linear(*a, **k)

    monkeypatch.setattr(ops, "fused_linear_policy_loss", count_fused)
    monkeypatch.setattr(ops, "policy_loss", count_plain)
    monkeypatch.setattr(ops, "linear_logprobs", count_linear)

    ref = _grads(TRLGRPOTrainer._compute_loss, trainer, inputs)
    trl_metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    got = _grads(FastRLGRPOTrainer._compute_loss, trainer, inputs)
    expected = {"fused": {"fused": 1, "logp": 0, "linear": 0}, "logp": {"fused": 0, "logp": 1, "linear": 1}}[path]
    assert calls == expected, calls
    _assert_same(ref, got)
    # metrics fastrl logs are TRL's (token-level definitions)
    ours = trainer._metrics["train"]
    keys = ["entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    if trainer.loss_type in ("cispo", "sapo", "vespo"):
        keys = ["entropy", *{"cispo": ["cispo_clip_ratio"], "vespo": ["vespo/phi_seq_mean"]}.get(trainer.loss_type, [])]
    if trainer.beta != 0.0:
        keys.append("kl")
    if trainer.importance_sampling_level == "sequence":
        keys = ["entropy"] + (["kl"] if trainer.beta != 0.0 else [])  # TRL averages clip flags per sequence there
    if trainer._entropy_bonus_enabled:
        keys += ["policy_loss", "entropy_coef"]
    for k in keys:
        assert math.isclose(ours[k][-1], trl_metrics[k][-1], rel_tol=1e-4, abs_tol=1e-6), k


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "sapo"])
def test_eval_mode_normalisation_matches_trl(batch, monkeypatch, loss_type):
    trainer, base_inputs = batch
    inputs = {k: v for k, v in base_inputs.items() if not k.startswith("_")}
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "entropy_coef", 0.05)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", loss_type == "sapo")
    trainer.model.eval()
    try:
        with torch.no_grad():
            ref = TRLGRPOTrainer._compute_loss(trainer, trainer.model, inputs)
            got = FastRLGRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    finally:
        trainer.model.train()
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-7)


def test_bf16_autocast_stays_within_trl_bf16_error(batch, monkeypatch):
    """Under bf16 autocast TRL rounds the logits to bf16, fastrl keeps them in fp32: fastrl's
    gradients must be at least as close to the fp32 result as TRL's own bf16 gradients."""
    trainer, base_inputs = batch
    inputs = {k: v for k, v in base_inputs.items() if not k.startswith("_")}
    monkeypatch.setattr(trainer, "loss_type", "bnpo")
    _, g32 = _grads(TRLGRPOTrainer._compute_loss, trainer, inputs)
    monkeypatch.setattr(trainer.accelerator, "autocast", lambda *a, **k: torch.autocast("cpu", dtype=torch.bfloat16))
    _, g_trl = _grads(TRLGRPOTrainer._compute_loss, trainer, inputs)
    _, g_ours = _grads(FastRLGRPOTrainer._compute_loss, trainer, inputs)

    def rel_err(g):
        num = sum(((g[k] - g32[k]).double() ** 2).sum() for k in g32)
        return (num / sum((g32[k].double() ** 2).sum() for k in g32)).sqrt().item()

    assert 0 < rel_err(g_trl) < 0.05
    assert rel_err(g_ours) <= 1.5 * rel_err(g_trl)


@pytest.mark.parametrize("last_world_entropy", [float("inf"), 0.0])
def test_adaptive_entropy_bonus_matches_trl(batch, monkeypatch, last_world_entropy):
    """Adaptive entropy: the gate (previous step's entropy vs the target), the applied
    coefficient, and the controller state after the step are TRL's."""
    trainer, base_inputs = batch
    inputs = {k: v for k, v in base_inputs.items() if not k.startswith("_")}
    monkeypatch.setattr(trainer, "loss_type", "sapo")
    monkeypatch.setattr(trainer, "use_adaptive_entropy", True)
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", True)
    monkeypatch.setattr(trainer.args, "entropy_target", 1.0e3)
    monkeypatch.setattr(trainer.args, "entropy_coef_delta", 0.01)
    monkeypatch.setattr(trainer, "_entropy_window_stats", None)
    assert trainer.accelerator.sync_gradients  # the step boundary: the controller updates
    states = []
    results = []
    for fn in (TRLGRPOTrainer._compute_loss, FastRLGRPOTrainer._compute_loss):
        monkeypatch.setattr(trainer, "entropy_coef", 0.05)
        monkeypatch.setattr(trainer, "_last_world_entropy", last_world_entropy)
        results.append(_grads(fn, trainer, inputs))
        states.append((trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats))
        assert trainer._metrics["train"]["entropy_coef"][-1] == trainer.entropy_coef
    _assert_same(*results)
    (c_ref, w_ref, s_ref), (c_got, w_got, s_got) = states
    assert c_got == pytest.approx(c_ref) and c_ref == pytest.approx(0.06)
    assert w_got == pytest.approx(w_ref, rel=1e-5) and s_ref is None and s_got is None
    # the gate: with an infinite previous entropy no bonus is applied this step
    monkeypatch.setattr(trainer, "_entropy_bonus_enabled", False)
    no_bonus = _grads(FastRLGRPOTrainer._compute_loss, trainer, inputs)[0]  # (the fused path: equal up to rounding)
    same = math.isclose(results[1][0].item(), no_bonus.item(), rel_tol=1e-5, abs_tol=1e-7)
    assert same == math.isinf(last_world_entropy)


@pytest.mark.parametrize(
    "attrs, args, reason",
    [
        ({"loss_type": "grpo", "epsilon_high": 0.3}, {"delta": 1.2}, "delta=1.2"),
        ({"loss_type": "sapo", "aux_loss_enabled": True}, {}, "aux loss"),
    ],
)
def test_unsupported_settings_fall_back_to_trl(batch, monkeypatch, attrs, args, reason):
    trainer, base_inputs = batch
    for k, v in attrs.items():
        monkeypatch.setattr(trainer, k, v)
    for k, v in args.items():
        monkeypatch.setattr(trainer.args, k, v)
    assert reason in trainer.fastrl_fallback_reason
    if "delta" not in args:
        return
    inputs = {k: v for k, v in base_inputs.items() if not k.startswith("_")}
    for name in ("fused_linear_policy_loss", "policy_loss", "linear_logprobs"):
        monkeypatch.setattr(ops, name, None)  # must not be reached
    ref = _grads(TRLGRPOTrainer._compute_loss, trainer, inputs)
    got = _grads(FastRLGRPOTrainer._compute_loss, trainer, inputs)
    _assert_same(ref, got, rtol=1e-6)


def test_loss_config_mapping():
    cfg = trl_loss_config(
        loss_type="dr_grpo", epsilon_low=0.2, epsilon_high=0.28, delta=1.5,
        importance_sampling_level="token", beta=0.04, max_completion_length=256,
    )
    assert (cfg.loss_agg, cfg.norm_length, cfg.dual_clip, cfg.kl_coef, cfg.clip_high) == (
        "seq-mean-token-sum-norm", 256.0, 1.5, 0.04, 0.28,
    )
    cispo = trl_loss_config(
        loss_type="cispo", epsilon_low=0.2, epsilon_high=5.0, delta=None,
        importance_sampling_level="token", beta=0.0, max_completion_length=8,
    )
    assert (cispo.surrogate, cispo.cispo_max, cispo.loss_agg) == ("cispo", 5.0, "token-mean")
    with pytest.raises(ValueError, match="no PolicyLossConfig equivalent"):
        trl_loss_config(
            loss_type="ppo_kl", epsilon_low=0.2, epsilon_high=0.2, delta=None,
            importance_sampling_level="token", beta=0.0, max_completion_length=8,
        )
    assert GRPOTrainer is FastRLGRPOTrainer


# ---------------------------------------------------------------------------------- end to end
def _train(cls, model_dir, out, loss_type, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=model_dir,
            reward_funcs=count_a_reward,
            args=_config(out, loss_type=loss_type, **overrides),
            train_dataset=prompt_dataset(8),
        )
        trainer.train()
    assert getattr(trainer, "fastrl_fallback_reason", None) is None
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    params = {k: p.detach().clone() for k, p in trainer.model.named_parameters()}
    return logs, params


@pytest.mark.parametrize(
    "loss_type, overrides",
    [
        ("grpo", {}),
        ("bnpo", {"beta": 0.04}),
        ("dr_grpo", {"num_iterations": 2}),
        ("dapo", {"epsilon_high": 0.28}),
        ("cispo", {"epsilon_high": 1.1, "num_iterations": 2, "entropy_coef": 0.01}),
        ("sapo", {"use_adaptive_entropy": True, "entropy_target": 100.0, "entropy_coef": 0.02}),
        ("vespo", {"num_iterations": 2, "beta": 0.04}),
    ],
)
def test_two_training_steps_match_trl(model_dir, tmp_path, loss_type, overrides):
    ref_logs, ref_params = _train(TRLGRPOTrainer, model_dir, str(tmp_path / "trl"), loss_type, **overrides)
    got_logs, got_params = _train(FastRLGRPOTrainer, model_dir, str(tmp_path / "fastrl"), loss_type, **overrides)
    assert len(ref_logs) == len(got_logs) == 2
    for r, g in zip(ref_logs, got_logs):
        assert math.isclose(g["loss"], r["loss"], rel_tol=1e-4, abs_tol=1e-6), (r["loss"], g["loss"])
        assert math.isclose(g["grad_norm"], r["grad_norm"], rel_tol=1e-4), (r["grad_norm"], g["grad_norm"])
    for k in ref_params:
        torch.testing.assert_close(got_params[k], ref_params[k], rtol=1e-4, atol=1e-5, msg=k)
    changed = sum((got_params[k] - p0).abs().max().item() > 0 for k, p0 in _initial_params(model_dir).items())
    assert changed > 0


def _initial_params(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: p.detach() for k, p in model.named_parameters()}
