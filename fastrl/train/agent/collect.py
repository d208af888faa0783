"""Collection for agent runs (``fastrl train --env``): the next rows played as multi-turn
trajectories, into one step's ``AgentRollout`` -- the agent counterpart of ``collect.GroupCollector``,
with the same interface, so the loop does not ask which one it runs.

One step: the batcher's next rows (this rank's share), ``group_size`` trajectories per row
(``fastrl.agents.driver.run_episodes``: every active trajectory continued by the sampler
together each turn, their environment steps concurrent in the ``EnvRuntime`` workers), the
trajectories as the step's ``[R, T]`` tensors (``AgentBatch``), and from those the
``Experience`` (``Experience.from_agent_batch``: packed groups when the trajectories of
every group share the prompt and none was split, padded rows otherwise). Each trajectory's
reward is the ``TrajectoryScorer``'s (``agent.score``: ``env_reward_weight`` times the
environment's outcome plus the ``--rewards`` functions on the whole trajectory, scored in the
reward pool's workers); every sample of a trajectory carries it.

Samplers: the HF sampler continues each trajectory's own keys/values across turns
(``HFTokenSampler``: turn k prefills only the new environment tokens); vLLM and the server
get each turn as token ids (``GroupSamplerTokens``, with their prefix caching).

Seeds: row ``i`` of the whole (all-rank) batch of step ``s`` plays with environment seed
``seeds.prompt_seeds(rollout_seed(seed, s, 0), first, n)[i]``; its trajectories' sampling
seeds derive from it (``run_episodes``), so a resumed run plays the same trajectories.

The collector's other methods give the trainer what it logs: ``step_metrics`` (reward,
length and the ``agent/...`` metrics of issue 18 §5 -- the sampler-vs-trainer log-prob gap on
policy tokens is the trainer's ``rollout/logp_gap_*``, logged for every run; ``reward/mean`` ... of the combined
reward, ``reward/env/...`` and ``reward/<function>/...`` of its terms) and ``samples`` (the best
and worst whole trajectories by that reward, with their roles, for ``samples.txt``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

import torch

from fastrl.agents import metric_names as names
from fastrl.agents.batch import AgentBatch
from fastrl.agents.driver import AgentConfig, GroupSamplerTokens, run_episodes
from fastrl.agents.render import ChatRenderer
from fastrl.agents.trajectory import Trajectory, format_trajectory
from fastrl.rollout.base import SamplingConfig
from fastrl.train import seeds
from fastrl.train.agent.score import TrajectoryScorer, TrajectoryScores
from fastrl.train.collect import rollout_sampling
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience
from fastrl.train.run.metrics import histogram

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.agents.runtime import EnvRuntime
    from fastrl.rollout.base import GroupSampler
    from fastrl.train.data import PromptBatcher
    from fastrl.train.run.metrics import StageTimer
    from fastrl.train.ranks import Ranks


__all__ = ["AgentRollout", "AgentCollector", "play_episodes", "sampler_renderer", "token_sampler", "turn_sampling"]


def token_sampler(sampler: Any, sampling: SamplingConfig) -> Any:
    """The driver's ``TokenSampler`` over the run's sampler: KV-continuing sessions for the HF
    sampler, each turn's token ids for the others (``fastrl.rollout.token_sampler.token_sampler_for``)."""
    from fastrl.rollout.token_sampler import token_sampler_for

    return token_sampler_for(sampler, sampling)


def sampler_renderer(renderer: ChatRenderer, sampler: Any) -> ChatRenderer:
    """``renderer`` knowing every token ``sampler`` stops on as a stop token (its
    ``eos_token_ids``: the model's ``generation_config`` end tokens, ``fastrl.rollout.stop_tokens``),
    so that a turn the sampler ended on any of them is stripped and re-rendered the same way."""
    return renderer.with_stop_tokens(getattr(sampler, "eos_token_ids", ()) or ())


def turn_sampling(sampling: SamplingConfig, *, agent: AgentConfig, renderer: ChatRenderer) -> SamplingConfig:
    """``sampling`` for policy turns: at most ``max_turn_tokens``, ending on the renderer's stop tokens."""
    return replace(sampling, max_new_tokens=agent.max_turn_tokens, stop_token_ids=tuple(renderer.stop_token_ids))


def play_episodes(rows: Sequence[dict], *, group_size: int, sampler: Any, sampling: SamplingConfig, runtime: Any,
                  renderer: ChatRenderer, agent: AgentConfig, env_seeds: Sequence[int]) -> tuple[list[Trajectory], dict[str, float]]:
    """``run_episodes`` with the run's sampler (``token_sampler``), its session closed after."""
    renderer = sampler_renderer(renderer, sampler)
    tokens = token_sampler(sampler, turn_sampling(sampling, agent=agent, renderer=renderer))
    try:
        return run_episodes(rows, group_size=group_size, runtime=runtime, renderer=renderer, sampler=tokens, config=agent,
                            seeds=list(env_seeds))
    finally:
        close = getattr(tokens, "close", None)
        if callable(close):
            close()


@dataclass
class AgentRollout:
    """One step's trajectories and their tensors."""

    trajectories: list[Trajectory]
    batch: AgentBatch
    metrics: dict[str, float]
    """``run_episodes``' metrics (``agent/...``, ``tokenization/...``, ``time/env_seconds`` ...)."""
    scores: TrajectoryScores
    """Each trajectory's reward and its terms (``batch.rewards`` is ``scores.rewards`` per row)."""
    tree: Any = None
    """A branching rollout's ``fastrl.agents.branching.TurnTree`` (``agent.tree_collect``), else None."""


class AgentCollector:
    """``collect(sampler=, step=, timer=)``: one step's ``AgentRollout`` (see the module docstring)."""

    def checkpoint_extra(self) -> dict[str, Any]:
        """Nothing beyond the batcher's position: an agent step's rollout is not kept in flight."""
        return {}

    def close(self) -> None:
        """Nothing to release here (the environment runtime is the trainer's ``agent``, closed with it)."""

    def __init__(self, *, cfg: TrainConfig, batcher: PromptBatcher, ranks: Ranks, runtime: EnvRuntime, renderer: ChatRenderer,
                 pad_token_id: int, scorer: TrajectoryScorer):
        self.cfg, self.batcher, self.ranks, self.scorer = cfg, batcher, ranks, scorer
        self.runtime, self.renderer, self.pad_token_id = runtime, renderer, int(pad_token_id)
        self.agent = cfg.agent_config()

    def collect(self, *, sampler: GroupSampler, step: int, timer: StageTimer) -> tuple[AgentRollout, dict[str, float]]:
        prompt_batch, first = self.ranks.shard(next(self.batcher))
        rows = list(prompt_batch.rows)
        sampling = rollout_sampling(self.cfg, step=step, salt=0)
        env_seeds = seeds.prompt_seeds(sampling.seed, first, len(rows))
        with timer("generate"):  # generation and environment steps interleave: both are here (time/env_seconds splits them)
            trajectories, metrics, tree = self.play(rows, sampler=sampler, sampling=sampling, env_seeds=env_seeds)
        with timer("reward"):
            scores = self.scorer.score(trajectories)
        batch = AgentBatch.from_trajectories(trajectories, group_size=self.cfg.group_size, pad_token_id=self.pad_token_id)
        batch.rewards = scores.rewards[batch.trajectory_ids]  # each sample carries its trajectory's reward
        return AgentRollout(trajectories, batch, metrics, scores, tree), {}

    def play(self, rows: list[dict], *, sampler: GroupSampler, sampling: SamplingConfig,
             env_seeds: Sequence[int]) -> tuple[list[Trajectory], dict[str, float], Any]:
        """The step's trajectories and metrics (``play_episodes``), and no tree."""
        trajectories, metrics = play_episodes(rows, group_size=self.cfg.group_size, sampler=sampler, sampling=sampling,
                                              runtime=self.runtime, renderer=self.renderer, agent=self.agent, env_seeds=env_seeds)
        return trajectories, metrics, None

    def experience(self, rollout: AgentRollout, *, device: torch.device) -> Experience:
        return Experience.from_agent_batch(rollout.batch, device=device)

    def step_metrics(self, rollout: AgentRollout, exp: Experience) -> tuple[dict[str, float], dict[str, list[float]]]:
        """The step's reward, length and agent metrics, and the rewards' histogram."""
        trajectories = rollout.trajectories
        outcome = self.ranks.gather(rollout.scores.rewards.float())
        metrics: dict[str, float] = dict(rollout.metrics)
        metrics.update(self.ranks.pool_reward_metrics(rollout.scores.metrics))
        metrics["reward/mean"] = float(outcome.mean())
        metrics["reward/std"] = float(outcome.std()) if outcome.numel() > 1 else 0.0
        metrics["reward/min"], metrics["reward/max"] = float(outcome.min()), float(outcome.max())
        turn_rewards = [r for t in trajectories for r in t.turn_rewards]
        metrics["reward/turn_mean"] = sum(turn_rewards) / max(len(turn_rewards), 1)
        policy = torch.tensor([t.count("policy") for t in trajectories], dtype=torch.float32)
        lengths = torch.tensor([sum(len(s.token_ids) for s in t.samples) for t in trajectories], dtype=torch.float32)
        metrics["response/length_mean"] = float(policy.mean())
        metrics["response/length_max"] = float(policy.max())
        metrics[names.TRAJECTORY_TOKENS_MEAN] = float(lengths.mean())
        metrics["response/truncated_frac"] = float(sum(t.stop_reason in ("turn_length", "max_trajectory_tokens")
                                                       for t in trajectories) / max(len(trajectories), 1))
        metrics["rollout/samples"] = float(len(trajectories))
        metrics[names.GENERATED_TOKENS] = float(self.ranks.sum(policy.sum()))
        env_s, gen_s = metrics.get(names.ENV_SECONDS, 0.0), metrics.get(names.GENERATION_SECONDS, 0.0)
        metrics[names.ENV_TIME_SHARE] = env_s / (env_s + gen_s) if env_s + gen_s > 0 else 0.0
        return metrics, histogram(outcome)

    def samples(self, rollout: AgentRollout, tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[str, str, float], tuple[str,
                str, float]]:
        """``("", whole trajectory with its roles, reward)`` of the step's best and worst trajectory
        (by the combined reward; the header shows the environment's outcome)."""
        rewards = rollout.scores.rewards

        def text(k: int) -> tuple[str, str, float]:
            t = rollout.trajectories[k]
            return "", format_trajectory(t, lambda ids: tokenizer.decode(ids, skip_special_tokens=False)), float(rewards[k])

        return text(int(rewards.argmax())), text(int(rewards.argmin()))
