"""Trajectories -> training tensors: rows, loss mask on policy tokens only, per-turn rewards
at each turn's last token, the RolloutBatch view, and a loss whose gradient at environment
tokens is exactly 0."""

import torch

from fastrl.agents.batch import AgentBatch
from fastrl.agents.driver import AgentConfig, run_episodes
from fastrl.agents.envs.calculator import CalculatorEnv, calculator_rows
from fastrl.agents.render import ChatRenderer
from fastrl.agents.runtime import InProcessRuntime
from fastrl.ops.policy_loss import policy_loss
from fastrl.train.task import char_tokenizer
from scripted import ScriptedSampler


def _batch(G=2):
    tokenizer = char_tokenizer()
    rows, _ = calculator_rows(num_train=2, num_heldout=0, seed=4)
    # trajectory j of a group: j = 0 answers right after one call, j = 1 calls twice and answers wrong
    def script(trajectory, turn):
        row = rows[trajectory // G]
        if trajectory % G == 0:
            return [f"calc({row['expression']})", row["answer"]][turn]
        return ["calc(1+1)", f"calc({row['expression']})", "7"][turn]
    with InProcessRuntime(CalculatorEnv) as runtime:
        trajectories, _ = run_episodes(rows, group_size=G, runtime=runtime, renderer=ChatRenderer(tokenizer),
                                       sampler=ScriptedSampler(tokenizer, script), config=AgentConfig(max_turns=4),
                                       seeds=[0, 1])
    return trajectories, AgentBatch.from_trajectories(trajectories, group_size=G, pad_token_id=tokenizer.pad_token_id)


def test_rows_masks_rewards_and_segments():
    trajectories, batch = _batch()
    assert batch.input_ids.shape[0] == len(trajectories) == 4
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and batch.group_ids.tolist() == [0, 0, 1, 1]
    for r, t in enumerate(trajectories):
        sample = t.samples[0]
        n = len(sample.token_ids)
        assert batch.input_ids[r, :n].tolist() == sample.token_ids and batch.attention_mask[r].sum() == n
        assert batch.loss_mask[r, :n].tolist() == sample.loss_mask and batch.loss_mask[r, n:].sum() == 0
        spans = batch.segments[batch.segments[:, 0] == r]
        assert spans[:, 3].tolist() == list(range(t.turns))
        # the final turn's reward sits on its last token, nothing else carries reward here
        assert batch.turn_rewards[r].nonzero().flatten().tolist() == ([int(spans[-1, 2]) - 1] if t.outcome_reward else [])
    assert len(batch.state_keys) == batch.segments.shape[0]


def test_rollout_batch_view_shares_the_prompt_per_group():
    _, batch = _batch()
    rollout = batch.as_rollout_batch()
    assert len(rollout.prompt_ids) == 2
    assert torch.equal(rollout.input_ids, batch.input_ids) and torch.equal(rollout.response_mask, batch.loss_mask)
    for r in range(4):
        prompt = rollout.prompt_ids[r // 2]
        assert rollout.input_ids[r, : len(prompt)].tolist() == prompt
        assert prompt + rollout.completion_ids[r] == batch.input_ids[r, : int(batch.attention_mask[r].sum())].tolist()


def test_loss_gradient_is_exactly_zero_at_environment_tokens():
    _, batch = _batch()
    mask = batch.loss_mask[:, 1:].float()  # column c scores token c + 1
    env = torch.zeros_like(batch.loss_mask, dtype=torch.bool)
    for r in range(batch.input_ids.shape[0]):
        env[r, batch.prompt_lengths[r]:] = batch.loss_mask[r, batch.prompt_lengths[r]:] == 0
    env = env[:, 1:] & batch.attention_mask[:, 1:].bool()
    assert env.any()
    logp = (batch.sampler_logp[:, 1:] + 0.1 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))).requires_grad_()
    advantages = batch.rewards - batch.rewards.mean()
    loss, _ = policy_loss(logp, batch.sampler_logp[:, 1:], advantages, mask, backend="torch")
    loss.backward()
    assert (logp.grad[env] == 0).all() and (logp.grad[mask == 0] == 0).all()
    assert (logp.grad[mask.bool()] != 0).any()


def test_a_split_sample_without_policy_tokens_is_left_out_and_trajectories_format():
    from fastrl.agents.trajectory import Trajectory, TrajectorySample, format_trajectory

    t = Trajectory(group=0, index=0, row={}, env_seed=0, turn_rewards=[0.5], state_keys=["s"], stop_reason="max_trajectory_tokens", turns=1)
    t.samples[0].append("prompt", -1, [1, 5, 9])
    t.samples[0].append("policy", 0, [10, 11], [-0.1, -0.2])
    t.samples[0].append("env", 0, [12])
    late = TrajectorySample()
    late.append("prompt", -1, [1, 5, 9, 10, 11, 12])
    t.samples.append(late)
    batch = AgentBatch.from_trajectories([t], group_size=1, pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 9, 10, 11, 12]] and batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0]]
    assert batch.turn_rewards.tolist() == [[0, 0, 0, 0, 0.5, 0]] and batch.segments.tolist() == [[0, 3, 5, 0]]
    text = format_trajectory(t, lambda ids: ",".join(map(str, ids)))
    assert text.splitlines()[1:] == ["-- sample 0", "[prompt] 1,5,9", "[policy 0] 10,11", "[env 0] 12", "-- sample 1", "[prompt] 1,5,9,10,11,12"]


def test_single_turn_demonstrations_collate_like_the_sft_warm_up():
    from fastrl.agents.batch import collate_samples
    from fastrl.agents.render import demonstration_sample
    from fastrl.train.sft import collate_sft, encode_sft_example

    tokenizer = char_tokenizer()
    renderer = ChatRenderer(tokenizer)
    rows = [("37+58=", "95"), ("1+2=", "3")]
    samples = [demonstration_sample(renderer, [{"role": "user", "content": p}], [{"role": "assistant", "content": a}]) for p, a in rows]
    ours = collate_samples(samples, pad_token_id=tokenizer.pad_token_id)
    theirs = collate_sft([encode_sft_example(tokenizer, p, a) for p, a in rows], pad_token_id=tokenizer.pad_token_id)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.float(), b.float())


def test_the_answer_turn_weighs_answer_weight_in_the_warm_up_mask_and_the_loss_is_its_weighted_mean():
    """``collate_samples(answer_weight=w)``: the last policy turn's tokens weigh w, earlier
    policy turns 1, prompt, environment and padding 0; ``sft_loss`` is then the weighted mean
    of minus the log-probs (checked by hand against a plain forward)."""
    import pytest

    from fastrl.agents.batch import collate_samples
    from fastrl.agents.trajectory import TrajectorySample
    from fastrl.train.sft import sft_loss
    from fastrl.train.task import tiny_model

    s = TrajectorySample()
    s.append("prompt", -1, [1, 5])
    s.append("policy", 0, [10, 11], [0.0, 0.0])
    s.append("env", 0, [12])
    s.append("policy", 1, [13, 14, 15], [0.0] * 3)
    short = TrajectorySample()
    short.append("prompt", -1, [1])
    short.append("policy", 0, [20], [0.0])
    ids, attention, mask = collate_samples([s, short], pad_token_id=0, answer_weight=4.0)
    # column c scores token c + 1
    assert mask.tolist() == [[0, 1, 1, 0, 4, 4, 4], [4, 0, 0, 0, 0, 0, 0]]
    plain = collate_samples([s, short], pad_token_id=0)[2]
    assert plain.tolist() == [[0, 1, 1, 0, 1, 1, 1], [1, 0, 0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="answer_weight"):
        collate_samples([s], pad_token_id=0, answer_weight=0.0)

    model = tiny_model(char_tokenizer(), hidden_size=32, layers=1, heads=2, arch="llama", max_position_embeddings=16, seed=0)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, :-1].float(), -1)
        logp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        expected = -(logp * mask).sum() / mask.sum()
        assert torch.allclose(sft_loss(model, ids, attention, mask), expected, atol=1e-6)
