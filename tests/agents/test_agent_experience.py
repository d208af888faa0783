"""Agent trajectories as the trainer's ``Experience``: the packed group layout's update equals
the padded per-trajectory reference (gradients of a real tiny model), the loss's gradient with
respect to the log-probs at environment tokens is exactly 0 in both layouts, split trajectories
take the padded rows with baselines by group id, and excluded trajectories leave the loss and
the baselines."""

import pytest
import torch

from fastrl.agents.batch import AgentBatch
from fastrl.agents.driver import AgentConfig, run_episodes
from fastrl.agents.envs.calculator import CalculatorEnv, calculator_rows
from fastrl.agents.render import ChatRenderer
from fastrl.agents.runtime import InProcessRuntime
from fastrl.ops import group_advantages
from fastrl.ops.policy_loss import policy_loss
from fastrl.train.experience import Experience
from fastrl.train.batching import GroupPackedBatching, PaddedBatching
from fastrl.train.task import char_tokenizer, tiny_model
from scripted import ScriptedSampler

G = 2
# Like templates that rewrite earlier turns: the appended ids differ from the template's rendering -> split samples.
REWRITING = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>"
             "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'] | replace('calc', 'CALC') }}"
             "{% else %}{{ m['content'] }}{% endif %}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _agent_batch(tokenizer, *, excluded=()):
    rows, _ = calculator_rows(num_train=2, num_heldout=0, seed=4)

    def script(trajectory, turn):  # j = 0: one call then the right answer; j = 1: two calls, a wrong answer
        row = rows[trajectory // G]
        if trajectory % G == 0:
            return [f"calc({row['expression']})", row["answer"]][turn]
        return ["calc(1+1)", f"calc({row['expression']})", "7"][turn]

    with InProcessRuntime(CalculatorEnv) as runtime:
        trajectories, _ = run_episodes(rows, group_size=G, runtime=runtime, renderer=ChatRenderer(tokenizer),
                                       sampler=ScriptedSampler(tokenizer, script), config=AgentConfig(max_turns=4),
                                       seeds=[0, 1])
    for index in excluded:
        trajectories[index].excluded = True
    return AgentBatch.from_trajectories(trajectories, group_size=G, pad_token_id=tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def setup():
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, max_position_embeddings=256, seed=3)
    return tokenizer, model


def _update(layout, exp, model, *, probe_logp_grad=False):
    """One loss + backward over every micro-batch (as Trainer._micro_batch_loss does); the
    parameter gradients, and the gradients w.r.t. the log-probs in loss form with their mask."""
    model.zero_grad(set_to_none=True)
    counts = exp.counts(exp.rows())
    seen = []
    for mb in layout.micro_batches(exp):
        with layout.attention(mb, [model]):
            logp, _ = layout.logprobs(model, mb, entropy=False)
            if probe_logp_grad:
                logp = logp.detach().requires_grad_()
            mask = layout.gather(mb, exp.loss_mask)
            loss, _ = policy_loss(logp, logp.detach() + 0.05, layout.gather(mb, exp.advantages), mask, global_counts=counts,
                                  cu_seqlens=layout.cu_seqlens(mb), backend="torch")
            loss.backward()
        if probe_logp_grad:
            seen.append((logp.grad, mask))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, seen


def test_packed_group_update_equals_the_padded_reference_and_env_tokens_get_no_gradient(setup):
    tokenizer, model = setup
    batch = _agent_batch(tokenizer)
    exp = Experience.from_agent_batch(batch, device=torch.device("cpu"))
    assert exp.packable and exp.segment_turns.tolist() == batch.segments[:, 3].tolist()
    assert exp.loss_mask.sum() == batch.loss_mask.sum()  # policy tokens only
    exp.advantages = group_advantages(exp.rewards, exp.group_ids, mode="grpo")[0]
    kwargs = dict(token_budget=10_000, device=torch.device("cpu"), temperature=1.0)
    packed, _ = _update(GroupPackedBatching(**kwargs), exp, model)
    padded, _ = _update(PaddedBatching(**kwargs), exp, model)
    assert packed.keys() == padded.keys() and any(g.abs().sum() > 0 for g in packed.values())
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], rtol=1e-4, atol=1e-6, msg=name)
    for layout in (GroupPackedBatching(**kwargs), PaddedBatching(**kwargs)):
        _, seen = _update(layout, exp, model, probe_logp_grad=True)
        env_positions = 0
        for grad, mask in seen:
            env_positions += int((mask == 0).sum())
            assert (grad[mask == 0] == 0).all() and (grad[mask > 0] != 0).any()
        assert env_positions > 0


def test_split_trajectories_take_padded_rows_with_baselines_by_group_and_excluded_rows_leave_both():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = REWRITING
    batch = _agent_batch(tokenizer, excluded=(3,))
    exp = Experience.from_agent_batch(batch, device=torch.device("cpu"))
    sizes = [exp.group(g).stop - exp.group(g).start for g in range(exp.num_groups)]
    assert sum(sizes) == exp.num_samples > exp.num_groups * G and not exp.packable  # trajectories split into samples
    assert exp.rows().tolist() == list(range(exp.num_samples))
    trajectory = batch.trajectory_ids
    left_out = trajectory == 3
    assert left_out.any() and (exp.loss_mask[left_out] == 0).all() and (exp.loss_mask[~left_out].sum(1) > 0).all()
    # the excluded trajectory's rows have groups of their own; every other row keeps its prompt's
    assert set(exp.group_ids[left_out].tolist()).isdisjoint(exp.group_ids[~left_out].tolist())
    assert exp.group_ids[~left_out].tolist() == batch.group_ids[~left_out].tolist()
    advantages = group_advantages(exp.rewards, exp.group_ids, mode="grpo")[0]
    assert (advantages[left_out] == 0).all() and (advantages[~left_out] != 0).any()
    # the padded layout covers every row once, with each row's own loss mask
    layout = GroupPackedBatching(token_budget=10_000, device=torch.device("cpu"), temperature=1.0)
    micro = layout.micro_batches(exp)
    assert sorted(r for mb in micro for r in mb.rows.tolist()) == list(range(exp.num_samples))
    assert sum(float(layout.gather(mb, exp.loss_mask).sum()) for mb in micro) == float(exp.loss_mask.sum())
