"""Issue 20 section 2: no wasted work in the step.

- the training forward computes the full-vocabulary entropy only when the loss has an
  entropy term; otherwise only the ``entropy/mean`` metric's subsample (every
  ``ENTROPY_METRIC_STRIDE``-th trained token), and the loss and gradients are those of a
  forward with the full entropy;
- the weight-sync probe scores a short fixed-size sequence and still catches a sampler
  whose weights differ from the trainer's in any one tensor.

Seams: the trainer's layout and the probe's sampler are wrapped (instance attributes and
arguments, no module global is patched).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from fastrl.rollout import HFGroupSampler
from fastrl.train import TrainConfig
from fastrl.train.task import char_tokenizer, tiny_model
from fastrl.train.trainer import ENTROPY_METRIC_STRIDE, Trainer
from fastrl.train.weights import PROBE_PROMPT_TOKENS, PROBE_TOKENS, WeightSyncError, check_gap, probe_gap


def _config(tmp_path, name: str, **changes) -> TrainConfig:
    base = dict(
        output_dir=str(tmp_path / name), steps=1, prompts_per_step=4, group_size=4, max_new_tokens=6,
        task_digits=1, task_train_size=40, task_eval_size=4, model_hidden_size=32, model_layers=1, sft_steps=0,
        eval_every=0, reward_workers=0, progress=False, tensorboard=False, seed=0, lr=1e-2,
    )
    base.update(changes)
    return TrainConfig(**base)


def _digit_share(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


class _RecordingLayout:
    """The trainer's layout, recording each ``logprobs`` call made with gradients (the
    training forward); ``full_entropy`` asks for every token's entropy instead."""

    def __init__(self, inner, full_entropy: bool = False):
        self.inner, self.full_entropy, self.calls = inner, full_entropy, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def logprobs(self, model, mb, *, entropy, entropy_rows=None):
        if self.full_entropy:
            entropy_rows = None
        logp, ent = self.inner.logprobs(model, mb, entropy=entropy, entropy_rows=entropy_rows)
        if torch.is_grad_enabled():
            call = {"entropy": entropy, "subsample": entropy_rows is not None, "rows": logp.numel()}
            if entropy_rows is not None:
                call["picked"] = int(entropy_rows.sum())
                call["nan_outside"] = bool((torch.isnan(ent[~entropy_rows]) | (ent[~entropy_rows] == 0)).all())
                call["finite_inside"] = bool(torch.isfinite(ent[entropy_rows]).all())
            self.calls.append(call)
        return logp, ent


def _one_step(cfg, full_entropy=False):
    with Trainer(cfg, reward_functions=[_digit_share]) as trainer:
        layout = trainer.layout = _RecordingLayout(trainer.layout, full_entropy)
        metrics = trainer.train_step()
        return metrics, layout.calls, {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def test_the_training_forward_computes_entropy_only_for_the_loss_or_the_metrics_subsample(tmp_path):
    # no entropy term: every training forward asks for the metric's subsample only
    metrics, calls, after = _one_step(_config(tmp_path, "sub"))
    assert calls and all(c["entropy"] and c["subsample"] for c in calls), calls
    assert all(1 <= c["picked"] <= math.ceil(c["rows"] / ENTROPY_METRIC_STRIDE) for c in calls), calls
    assert all(c["nan_outside"] and c["finite_inside"] for c in calls), calls
    vocab = len(char_tokenizer())
    assert 0.0 < metrics["entropy/mean"] <= math.log(vocab)
    assert "loss/entropy" not in metrics

    # the same step with the full entropy in the training forward: the same loss, gradients and update
    full_metrics, full_calls, full_after = _one_step(_config(tmp_path, "full"), full_entropy=True)
    assert full_calls and not any(c["subsample"] for c in full_calls)
    for key in ("loss/total", "loss/policy", "grad_norm"):
        if key in metrics:
            assert metrics[key] == full_metrics[key], key
    assert metrics["grad_norm"] == full_metrics["grad_norm"] > 0
    for k in after:
        assert torch.equal(after[k], full_after[k]), k
    # the metric: a subsample of the full mean's tokens, close to it
    assert metrics["entropy/mean"] == pytest.approx(full_metrics["entropy/mean"], rel=0.2)

    # the padded layout ([B, T] rows) picks its subsample the same way
    padded_metrics, padded_calls, _ = _one_step(_config(tmp_path, "padded", shared_prefix=False))
    assert padded_calls and all(c["subsample"] and c["picked"] >= 1 and c["nan_outside"] and c["finite_inside"]
                                for c in padded_calls), padded_calls
    assert 0.0 < padded_metrics["entropy/mean"] <= math.log(vocab)

    # an entropy term: the full, differentiable entropy, and its loss share is reported
    bonus_metrics, bonus_calls, _ = _one_step(_config(tmp_path, "bonus", entropy_coef=0.01))
    assert bonus_calls and not any(c["subsample"] for c in bonus_calls)
    assert "loss/entropy" in bonus_metrics and math.isfinite(bonus_metrics["entropy/mean"])


class _RecordingSampler:
    def __init__(self, inner):
        self.inner, self.requests = inner, []

    def generate(self, prompts, *, group_size, sampling=None, **kw):
        self.requests.append({"prompt_lengths": [len(p) for p in prompts], "max_new_tokens": sampling.max_new_tokens})
        return self.inner.generate(prompts, group_size=group_size, sampling=sampling, **kw)


def test_the_probe_is_short_and_catches_any_one_changed_weight_tensor():
    tokenizer = char_tokenizer()
    policy = tiny_model(tokenizer, hidden_size=32, layers=2, max_position_embeddings=128, seed=0).eval()
    prompt = tokenizer("12+34=46; 5+6=11; 7+8=15; 9+9=18; 1+2=")["input_ids"]
    assert len(prompt) > PROBE_PROMPT_TOKENS
    cpu = torch.device("cpu")

    same = _RecordingSampler(HFGroupSampler(copy.deepcopy(policy), pad_token_id=tokenizer.pad_token_id))
    gap = probe_gap(same, policy, prompt, max_new_tokens=32, device=cpu)
    assert gap < 1e-4
    check_gap(gap, tolerance=1e-3, step=1)
    assert same.requests == [{"prompt_lengths": [PROBE_PROMPT_TOKENS], "max_new_tokens": PROBE_TOKENS}]

    # every tensor: the short probe flags a perturbed copy whenever the full-length probe of
    # before (the whole prompt, 8 greedy tokens) does, and raises then
    tolerance, flagged = 1e-3, []
    g = torch.Generator().manual_seed(0)
    for name, _ in policy.named_parameters():
        stale = copy.deepcopy(policy)
        with torch.no_grad():
            p = dict(stale.named_parameters())[name]
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=g))
        sampler = HFGroupSampler(stale, pad_token_id=tokenizer.pad_token_id)
        short = probe_gap(sampler, policy, prompt, max_new_tokens=32, device=cpu)
        long = _full_length_gap(sampler, policy, prompt, tokens=8)
        if long > tolerance:
            assert short > tolerance, (name, short, long)
            flagged.append(name)
            with pytest.raises(WeightSyncError, match="not running the trained weights"):
                check_gap(short, tolerance=tolerance, step=1)
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"} <= set(flagged)


def _full_length_gap(sampler, policy, prompt, *, tokens):
    """The probe as it was: a greedy continuation of the whole prompt, scored by both sides."""
    from fastrl.ops.hf import causal_lm_logprobs
    from fastrl.rollout.base import SamplingConfig

    out = sampler.generate([prompt], group_size=1, sampling=SamplingConfig(greedy=True, temperature=1.0, max_new_tokens=tokens))
    with torch.no_grad():
        lp = causal_lm_logprobs(policy, out.input_ids, out.attention_mask, logits_to_keep=len(out.completion_ids[0]))
    return float((lp[0] - out.completion_logp[0].float()).abs().max())


class _ShiftedSampler:
    """The trainer's sampler, reporting its log-probs ``shift`` nats too high (a stale or
    mismatched engine as the trainer sees it); the sampled tokens are the sampler's own."""

    def __init__(self, inner, shift: float):
        self.inner, self.shift = inner, shift

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, *args, **kw):
        out = self.inner.generate(*args, **kw)
        out.sampler_logp = out.sampler_logp + self.shift
        return out


@pytest.mark.parametrize("correction", ["none", "is", "bypass"])
def test_the_sampler_gap_is_measured_on_trained_tokens_without_an_extra_pass(tmp_path, correction):
    # "none" and "bypass" on an on-policy update make no trainer pass of the rollout: the gap is read
    # from the update's forwards; "is" recomputes the trainer's log-probs, and the gap is read from that pass
    for shift in (0.0, 0.5):
        with Trainer(_config(tmp_path, f"{correction}-{shift}", rollout_correction=correction),
                     reward_functions=[_digit_share]) as trainer:
            layout = trainer.layout = _RecordingLayout(trainer.layout)
            trainer.sampler = _ShiftedSampler(trainer.sampler, shift)
            metrics = trainer.train_step()
        assert ("time/old_logp" in metrics) == (correction == "is")
        assert len(layout.calls) == 1  # the one training forward (the recorder sees forwards with grad)
        assert metrics["rollout/logp_gap_mean"] == pytest.approx(shift, abs=1e-4)
        assert metrics["rollout/logp_gap_max"] == pytest.approx(shift, abs=1e-4)
