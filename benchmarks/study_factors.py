"""The conditions of the algorithm-choice study (``benchmarks/algorithm_study.py``): each factor
is named after the condition it tests, at two or three levels, and each level is set through
fastrl's public options only (``fastrl train`` flags, a reward wrapper given with ``--rewards
module:function``, a critic given with ``--critic_init``) -- no trainer change.

- ``baseline``            every algorithm on the task at ``fastrl compare``'s defaults.
- ``rollout_cost``        GRPO's G trajectories per prompt against PPO's one
                          (``--ppo_group_size 1``: as many trajectories a step, G times the prompts),
                          charged ``seconds + w x environment calls`` for a cost weight ``w`` per call
                          (``COST_WEIGHTS``): the same runs read at several prices of a rollout, so
                          "equal wall time" (w = 0) and "equal environment calls" (w large) are
                          both read off them without a sleep that a shared CPU would blur.
- ``reward_noise``        a share of the rewards flipped (``flip_rewards_*``): does group
                          normalisation amplify the noise?
- ``difficulty``          a share of the prompts made unsolvable (``unsolvable_*``: their reward is
                          0 whatever the policy does), so that share of GRPO's groups is all-equal
                          and gives no signal; the runs log the measured share
                          (``groups/frac_all_equal``).
- ``horizon``             turns per episode (frozenlake: ``--max_turns`` 6, the default, or 12 with
                          a start warmed up for the longer trajectories), where step credit
                          (GiGPO, PPO's per-token values) should matter.
- ``budget``              fastrl compare's steps budget, or four times it (frozenlake, where no arm
                          gains over its start within the shorter one): does the answer change once
                          RL has had time to gain?
- ``value_learnability``  PPO's critic from a random initialisation, from a copy of the policy
                          (fastrl's default), or from a GRPO checkpoint (``grpo_then_ppo``: GRPO
                          for half the budget, the critic initialised from its final policy).

The reward wrappers are deterministic (a hash of the prompt, the completion and how often this
process saw that pair), so a rerun of a cell flips the same rewards given the same samples.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["Level", "Factor", "FACTORS", "TASKS", "COST_WEIGHTS", "flip_rewards_10", "flip_rewards_30",
           "unsolvable_50", "noisy", "unsolvable", "CRITIC_SCRATCH"]

TASKS: tuple[str, ...] = ("calculator", "frozenlake", "sql", "default")
"""The default single-turn task (``default``: ``fastrl train`` with no task options) and the
three built-in environments."""
ENV_TASKS: tuple[str, ...] = ("calculator", "frozenlake", "sql")
COST_WEIGHTS: tuple[float, ...] = (0.0, 0.01, 0.1)
"""Seconds charged per environment call (reset or step) on top of the run's RL seconds, for
``rollout_cost``'s levels: 0 (the compute alone: equal wall time on this CPU), 10 ms (a fast
tool, a local sandbox) and 100 ms (a web call, a browser step: the environment's cost dominates,
so equal cost means equal environment calls)."""
CRITIC_SCRATCH = "critic_scratch"
"""``--critic_init`` placeholder: the start's randomly initialised model of the policy's shape
(``algorithm_study`` writes it beside the warmed-up model and substitutes its path)."""


# ============================================================================ reward wrappers
def _unit(*parts: Any) -> float:
    """A number in [0, 1) from a hash of ``parts`` (deterministic across processes and runs)."""
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


_SEEN: Counter = Counter()
"""(prompt, completion) pairs this process has scored: a repeated sample gets a fresh draw."""


def _base_scores(prompts: Sequence[Any], completions: Sequence[Any], kwargs: dict[str, Any]) -> list[float]:
    """The unwrapped reward: an agent run's environment outcome (``env_reward``, with
    ``--env_reward_weight 0`` so it is counted once), else the built-in ``exact_match``."""
    if "env_reward" in kwargs:
        return [float(r or 0.0) for r in kwargs["env_reward"]]
    from fastrl.train.rewards import exact_match_reward

    return [float(r or 0.0) for r in exact_match_reward(list(prompts), list(completions), **kwargs)]


def noisy(prompts: Sequence[Any], completions: Sequence[Any], *, rate: float, **kwargs: Any) -> list[float]:
    """The base reward with a share ``rate`` of the scores flipped (``1 - r`` for a reward in
    [0, 1]): each sample flips when a hash of (prompt, completion, its repeat count) falls
    below ``rate``."""
    scores = _base_scores(prompts, completions, kwargs)
    out = []
    for p, c, r in zip(prompts, completions, scores):
        key = json.dumps([p, c], sort_keys=True, default=str)
        _SEEN[key] += 1
        out.append(1.0 - r if _unit("flip", key, _SEEN[key]) < rate else r)
    return out


def unsolvable(prompts: Sequence[Any], completions: Sequence[Any], *, share: float, **kwargs: Any) -> list[float]:
    """The base reward, except 0 on the prompts (a fixed ``share`` of them, by a hash of the
    prompt) that are made unsolvable: every group of theirs is all-equal."""
    scores = _base_scores(prompts, completions, kwargs)
    return [0.0 if _unit("unsolvable", p) < share else r for p, r in zip(prompts, scores)]


def flip_rewards_10(prompts, completions, **kwargs):
    """``reward_noise`` level: 10% of the rewards flipped."""
    return noisy(prompts, completions, rate=0.10, **kwargs)


def flip_rewards_30(prompts, completions, **kwargs):
    """``reward_noise`` level: 30% of the rewards flipped."""
    return noisy(prompts, completions, rate=0.30, **kwargs)


def unsolvable_50(prompts, completions, **kwargs):
    """``difficulty`` level: half the prompts unsolvable."""
    return unsolvable(prompts, completions, share=0.50, **kwargs)


# ============================================================================ factors and levels
WRAPPERS = "benchmarks.study_factors"
"""The module ``--rewards`` names (``benchmarks`` is importable from the repository root)."""


@dataclass(frozen=True)
class Level:
    """One level of a factor: the arms compared at it and how each is run."""

    name: str
    condition: str
    """The condition in words (the page's column)."""
    algorithms: tuple[str, ...]
    """The arms compared at this level (algorithm names of ``fastrl compare``)."""
    args: tuple[str, ...] = ()
    """``fastrl train`` options of every arm at this level."""
    per_algorithm: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Extra options of one arm (e.g. PPO's critic)."""
    reward: str | None = None
    """A reward wrapper (function name in this module) given with ``--rewards``; with an
    environment also ``--env_reward_weight 0`` (the wrapper reads the outcome itself)."""
    start_args: tuple[str, ...] = ()
    """Options that shape the shared warm-up (a level with them has a start of its own)."""
    budget_scale: int = 1
    """The steps budget as a multiple of the task's (``fastrl compare``'s)."""
    cost_weight: float | None = None
    """``rollout_cost``: seconds charged per environment call when reading the cells."""
    arm_name: str | None = None
    """The name of this level's run options when several levels share them (default: the level's)."""
    folklore: str | None = None
    """The arm the usual advice expects to win at this level (None: it predicts no winner)."""

    def arm(self, algorithm: str) -> str:
        """The name of the run options of ``algorithm`` at this level (``base`` when none):
        levels that run an algorithm the same way share its cells."""
        if not (self.args or self.per_algorithm.get(algorithm) or self.reward or self.start_args or self.budget_scale != 1):
            return "base"
        return self.arm_name or self.name

    def run_args(self, task: str, algorithm: str) -> list[str]:
        out = [*self.args, *self.per_algorithm.get(algorithm, ())]
        if self.reward:
            out += ["--rewards", f"[{WRAPPERS}:{self.reward}]"]  # a list, as ``fastrl train`` parses it
            if task in ENV_TASKS:
                out += ["--env_reward_weight", "0"]
        return out


@dataclass(frozen=True)
class Factor:
    name: str
    question: str
    """What the factor asks (the page's heading)."""
    folklore: str
    """What the usual advice predicts."""
    tasks: tuple[str, ...]
    levels: tuple[Level, ...]
    how: str = ""
    """How the levels are set and read (the page's note under the heading)."""


GRPO_PPO = ("grpo", "ppo")
PPO_ONE = ("--ppo_group_size", "1")

FACTORS: dict[str, Factor] = {f.name: f for f in (
    Factor("baseline", "Which algorithm, with nothing changed?",
           "neither wins by default", TASKS,
           (Level("default", "the task at fastrl compare's defaults", ("grpo", "dr_grpo", "rloo", "ppo", "grpo_then_ppo")),
            Level("agents", "the environments' step-credit algorithm", ("grpo", "gigpo")))),
    Factor("rollout_cost", "When a rollout is expensive: G trajectories per prompt (GRPO) or one (PPO)?",
           "PPO when each rollout is expensive", ("calculator", "frozenlake"),
           tuple(Level(f"w{int(w * 1000)}ms", f"{w * 1000:g} ms charged per environment call", GRPO_PPO,
                       per_algorithm={"ppo": PPO_ONE}, cost_weight=w, arm_name="group1",
                       folklore={0.0: "grpo", 0.1: "ppo"}.get(w)) for w in COST_WEIGHTS),
           how="GRPO samples 8 trajectories of each prompt; PPO one of each of 8 times the prompts "
               "(`fastrl compare --ppo_group_size 1`), so both sample as many trajectories, and make about as many "
               "environment calls, per step. Every arm runs the task's steps budget; a level charges each run its CPU "
               "seconds (the shared warm-up excluded) plus the weight times its environment calls, and compares the "
               "arms at equal charged cost: the cheaper arm's whole run against the other arm at the steps the same "
               "charge buys it. So the comparison moves from equal compute (0 ms: equal wall time on this CPU, one "
               "thread each) towards equal environment calls (100 ms: a rollout's cost dominates). The same runs serve "
               "the three levels."),
    Factor("reward_noise", "When rewards are noisy: does group normalisation amplify the noise?",
           "GRPO's per-group normalisation amplifies noise in small groups; a critic averages it", ("calculator", "frozenlake", "default"),
           (Level("flip0", "no reward flipped", GRPO_PPO),
            Level("flip10", "10% of the rewards flipped", GRPO_PPO, reward="flip_rewards_10", folklore="ppo"),
            Level("flip30", "30% of the rewards flipped", GRPO_PPO, reward="flip_rewards_30", folklore="ppo")),
           how="`--rewards '[benchmarks.study_factors:flip_rewards_10]'` (or `_30`) scores each sample with the task's "
               "reward (an environment's outcome, with `--env_reward_weight 0`; the default task's exact match) and "
               "flips it (1 - r) for that share of the samples. Held-out success is measured on the true outcome."),
    Factor("difficulty", "When many groups are all-equal (no signal for GRPO)?",
           "GRPO wastes all-equal groups; PPO still learns from every sample", ("calculator", "frozenlake", "default"),
           (Level("unsolvable0", "every prompt solvable", GRPO_PPO),
            Level("unsolvable50", "half the prompts unsolvable: all-equal groups", GRPO_PPO, reward="unsolvable_50",
                  folklore="ppo")),
           how="`--rewards '[benchmarks.study_factors:unsolvable_50]'` scores half the prompts (chosen by a hash of the "
               "prompt, the same in every run) 0 whatever the policy does, so their groups are all-equal; the cells "
               "log the measured share of all-equal groups. Held-out success is measured on the true outcome."),
    Factor("horizon", "When episodes are long: does step credit pay?",
           "step credit (GiGPO, PPO's values) matters more as the horizon grows", ("frozenlake",),
           (Level("turns6", "up to 6 moves, the default", ("grpo", "gigpo", "ppo")),
            Level("turns12", "up to 12 moves, from a start warmed up for 640-token trajectories", ("grpo", "gigpo", "ppo"),
                  start_args=("--max_turns", "12", "--max_trajectory_tokens", "640"), folklore="gigpo")),
           how="The built-in model's context is its longest trajectory, fixed at the warm-up, so the 12-move level "
               "warms up a start of its own (same demonstrations, 640 positions); its arms are compared with each "
               "other, not with the 6-move level's."),
    Factor("budget", "When the budget lets RL gain: does the answer change?",
           "a critic needs time to learn, so PPO's value-based credit pays on a longer budget", ("frozenlake",),
           (Level("steps1x", "fastrl compare's budget (16 RL steps)", GRPO_PPO),
            Level("steps4x", "four times that budget (64 RL steps)", GRPO_PPO, budget_scale=4, folklore="ppo")),
           how="Every arm starts from the task's shared start and runs the task's steps budget times the level's "
               "multiple, with held-out evaluations at fastrl compare's interval for that budget. Frozenlake is the "
               "task where, at the shorter budget, no arm gained over its start (the section \"Did RL help at all\")."),
    Factor("value_learnability", "When can the critic be learnt: does a warm-started critic rescue PPO?",
           "PPO needs a value function it can learn; a critic warm-started from a GRPO checkpoint helps", ("calculator", "frozenlake", "sql"),
           (Level("critic_scratch", "PPO's critic randomly initialised", GRPO_PPO,
                  per_algorithm={"ppo": ("--critic_init", CRITIC_SCRATCH)}, folklore="grpo"),
            Level("critic_policy", "PPO's critic a copy of the policy, fastrl's default", GRPO_PPO),
            Level("critic_grpo", "critic from a GRPO checkpoint: grpo_then_ppo", ("grpo", "grpo_then_ppo"),
                  folklore="grpo_then_ppo")),
           how="`--critic_init`: a randomly initialised model of the policy's shape (written beside the start), "
               "none (fastrl's default: a copy of the policy), or GRPO's final policy after half the budget "
               "(`grpo_then_ppo`, whose PPO phase runs the other half). Each level is compared with GRPO over the "
               "whole budget."),
)}
"""Every factor of the study, in the order of the page."""


def applies(factor: Factor, level: Level, task: str) -> bool:
    """Whether ``level`` of ``factor`` runs on ``task`` (GiGPO needs an environment)."""
    if task not in factor.tasks:
        return False
    return not ("gigpo" in level.algorithms and task not in ENV_TASKS)
