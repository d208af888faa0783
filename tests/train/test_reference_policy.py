"""The frozen reference policy kept on disk between its passes (``reference_offload``):
the same log-probs and the same run as in memory, no weights held outside its pass."""

from __future__ import annotations

import json

import pytest
import torch

from fastrl.ops.hf import causal_lm_logprobs
from fastrl.train import TrainConfig
from fastrl.train.reference_policy import OFFLOAD_FILE, ReferenceOffloadError, ReferencePolicy, offload_reference
from fastrl.train.task import char_tokenizer, tiny_model
from fastrl.train.trainer import Trainer


def digit_share(prompts, completions, **kwargs):
    """A dense reward (every group has signal from the first step): share of digit characters."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def test_offloaded_reference_scores_like_the_module_and_holds_no_weights_between_passes(tmp_path):
    model = tiny_model(char_tokenizer(), hidden_size=32, layers=1, seed=0).eval()
    ids = torch.randint(3, 40, (2, 9))
    expected = causal_lm_logprobs(model, ids)
    copy = tiny_model(char_tokenizer(), hidden_size=32, layers=1, seed=0)
    ref = ReferencePolicy(copy, offload_path=tmp_path / "ref" / OFFLOAD_FILE)
    assert ref.offloaded and (tmp_path / "ref" / OFFLOAD_FILE).exists()
    assert all(p.numel() == 0 for p in copy.parameters())  # released after writing the file
    for _ in range(2):  # mapped again for every pass
        with ref.resident() as module:
            assert module is copy and not any(p.requires_grad for p in module.parameters())
            got = causal_lm_logprobs(module, ids)
        assert torch.equal(got, expected)
        assert all(p.numel() == 0 for p in copy.parameters())
    in_memory = ReferencePolicy(model, offload_path=None)
    with in_memory.resident() as module:
        assert module is model and torch.equal(causal_lm_logprobs(module, ids), expected)


def test_offload_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert offload_reference("auto", device=cpu, sharded=False)
    assert not offload_reference("auto", device=cuda, sharded=False)
    assert offload_reference("disk", device=cuda, sharded=False)
    assert not offload_reference("off", device=cpu, sharded=False)
    assert not offload_reference("disk", device=cpu, sharded=True)  # every rank would need the file


def test_a_run_with_the_reference_on_disk_equals_the_run_with_it_in_memory(tmp_path):
    finals, metrics = [], []
    for mode in ("off", "disk"):
        cfg = TrainConfig(output_dir=str(tmp_path / mode), steps=2, prompts_per_step=4, group_size=4, max_new_tokens=3,
                          task_digits=1, task_train_size=60, task_eval_size=8, model_hidden_size=32, model_layers=1, sft_steps=0,
                          eval_every=0, reward_workers=0, progress=False, tensorboard=False, seed=0, lr=1e-3, kl_coef=0.05,
                          reference_offload=mode)
        with Trainer(cfg, reward_functions=[digit_share]) as trainer:
            assert trainer.reference.offloaded == (mode == "disk")
            trainer.train()
            finals.append({k: v.detach().clone() for k, v in trainer.policy.state_dict().items()})
            if mode == "disk":
                assert all(p.numel() == 0 for p in trainer.reference.module.parameters())
                assert (tmp_path / mode / "reference" / OFFLOAD_FILE).exists()
        rows = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        metrics.append([m["kl/ref"] for m in rows if "kl/ref" in m])
    assert len(metrics[0]) == 2 and metrics[0] == metrics[1]
    assert any(k != 0 for k in metrics[0][1:])  # the policy moved away from the reference: the KL is not trivially 0
    for k in finals[0]:
        assert torch.equal(finals[0][k], finals[1][k]), k


def _damage_by_truncation(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damage_by_deletion(path):
    path.unlink()


def _damage_by_other_weights(path):  # same names, other values, written later: a second run in the same directory
    state = torch.load(path, weights_only=True)
    torch.save({k: torch.randn_like(v) for k, v in state.items()}, path)


def _damage_by_wrong_shapes(path):
    state = torch.load(path, weights_only=True)
    torch.save({k: v[:1].clone() for k, v in state.items()}, path)


DAMAGES = (_damage_by_truncation, _damage_by_deletion, _damage_by_other_weights, _damage_by_wrong_shapes)


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.removeprefix("_damage_by_"))
def test_a_damaged_offload_file_is_rewritten_from_the_saved_reference(tmp_path, damage):
    from fastrl.train.reference_policy import load_reference

    policy = tiny_model(char_tokenizer(), hidden_size=32, layers=1, seed=0).eval()
    ids = torch.randint(3, 40, (2, 9))
    expected = causal_lm_logprobs(policy, ids)
    ref = load_reference(policy, path=tmp_path / "reference", resume=False, save=True, device=torch.device("cpu"),
                         offload=True)
    damage(tmp_path / "reference" / OFFLOAD_FILE)
    with pytest.warns(RuntimeWarning, match=OFFLOAD_FILE):
        with ref.resident() as module:
            got = causal_lm_logprobs(module, ids)
    assert torch.equal(got, expected) and ref.restored == 1
    with ref.resident() as module:  # the rewritten file is trusted again: no second restore
        assert torch.equal(causal_lm_logprobs(module, ids), expected)
    assert ref.restored == 1
    assert all(p.numel() == 0 for p in ref.module.parameters())


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.removeprefix("_damage_by_"))
def test_a_damaged_offload_file_with_nothing_to_restore_from_is_a_named_error(tmp_path, damage):
    model = tiny_model(char_tokenizer(), hidden_size=32, layers=1, seed=0)
    ref = ReferencePolicy(model, offload_path=tmp_path / OFFLOAD_FILE)
    damage(tmp_path / OFFLOAD_FILE)
    with pytest.raises(ReferenceOffloadError, match=f"{OFFLOAD_FILE}.*--reference_offload off"):
        with ref.resident():
            pass
    assert all(p.numel() == 0 for p in model.parameters())  # nothing half-loaded is left behind
