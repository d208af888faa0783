"""The multi-turn driver with a real tiny HF model and the real HFGroupSampler: greedy turns
equal HF ``generate`` on the full concatenated history, sampled log-probs equal a plain
forward over the final trajectory at policy positions, the loss mask is exactly the policy tokens."""

import pytest
import torch

from fastrl.agents import metric_names as names
from fastrl.agents.driver import AgentConfig, GroupSamplerTokens, run_episodes
from fastrl.agents.envs.frozenlake import frozenlake_rows, FrozenLakeEnv
from fastrl.agents.render import ChatRenderer
from fastrl.agents.runtime import EnvRuntime
from fastrl.rollout.base import SamplingConfig
from fastrl.rollout.hf import HFGroupSampler
from fastrl.train.task import char_tokenizer, tiny_model

# A random tiny model rarely samples <eos>; ending a turn on any of these tokens makes the
# episodes multi-turn (the environment reads whatever the turn says).
STOPS = tuple(range(7, 104, 3))


@pytest.fixture(scope="module")
def setup():
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, max_position_embeddings=512, seed=1).eval()
    rows, _ = frozenlake_rows(num_train=2, num_heldout=0, seed=0, size=3)
    return tokenizer, model, rows


def _episodes(setup, sampling, *, group_size=3):
    tokenizer, model, rows = setup
    sampling = SamplingConfig(**{**sampling, "stop_token_ids": STOPS})
    sampler = GroupSamplerTokens(HFGroupSampler(model, backend="torch"), sampling)
    renderer = ChatRenderer(tokenizer, stop_token_ids=(tokenizer.eos_token_id, *STOPS))
    config = AgentConfig(max_turns=4, max_turn_tokens=6, max_trajectory_tokens=400, split_on_mismatch=False)
    with EnvRuntime(FrozenLakeEnv, num_workers=2) as runtime:
        return run_episodes(rows, group_size=group_size, runtime=runtime, renderer=renderer, sampler=sampler,
                            config=config, seeds=[5, 6])


def test_greedy_turns_equal_generate_on_the_full_history(setup):
    tokenizer, model, _ = setup
    trajectories, metrics = _episodes(setup, {"greedy": True})
    assert metrics[names.TURNS_MAX] >= 3 and metrics[names.ENV_TOKEN_SHARE] > 0
    checked = 0
    for t in trajectories:
        (sample,) = t.samples
        for segment in sample.segments:
            if segment.role != "policy":
                continue
            history = torch.tensor([sample.token_ids[: segment.start]])
            out = model.generate(history, attention_mask=torch.ones_like(history), do_sample=False,
                                 max_new_tokens=segment.end - segment.start, eos_token_id=[tokenizer.eos_token_id, *STOPS],
                                 pad_token_id=tokenizer.pad_token_id)
            assert out[0, history.shape[1]:].tolist() == sample.token_ids[segment.start:segment.end]
            checked += 1
    assert checked >= 2 * len(trajectories)


def test_sampled_logprobs_equal_a_forward_over_the_final_trajectory_and_the_mask_is_the_policy(setup):
    tokenizer, model, rows = setup
    trajectories, _ = _episodes(setup, {"temperature": 1.0})
    groups = {}
    for t in trajectories:
        (sample,) = t.samples
        sample.check()
        tensors = sample.tensors()
        mask = tensors["loss_mask"].bool()
        policy = sorted(i for s in sample.segments if s.role == "policy" for i in range(s.start, s.end))
        env = [i for s in sample.segments if s.role == "env" for i in range(s.start, s.end)]
        assert mask.nonzero().flatten().tolist() == policy and policy and env
        assert not mask[env].any() and not mask[: sample.prompt_length].any()
        with torch.no_grad():
            logits = model(tensors["input_ids"][None]).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, tensors["input_ids"][1:, None])[:, 0]
        positions = torch.tensor(policy)
        torch.testing.assert_close(tensors["sampler_logp"][positions], logp[positions - 1], atol=2e-5, rtol=1e-5)
        assert (tensors["sampler_logp"][~mask] == 0).all()
        groups.setdefault(t.group, []).append(sample.token_ids[: sample.prompt_length])
    # a group's trajectories share the prompt (the row's environment seed), and differ after it
    assert all(len({tuple(p) for p in prompts}) == 1 for prompts in groups.values()) and len(groups) == len(rows)
    assert len({tuple(t.samples[0].token_ids) for t in trajectories}) > len(rows)


def test_sampling_is_reproducible(setup):
    first, _ = _episodes(setup, {"temperature": 1.0})
    second, _ = _episodes(setup, {"temperature": 1.0})
    assert [t.samples[0].token_ids for t in first] == [t.samples[0].token_ids for t in second]
