"""The contracts of the loop's stages that have more than one implementation.

The loop (``Trainer.train_step``) drives two objects it does not look inside: each step's
``Collector`` and the held-out ``Evaluator``. Single-turn, tree, asynchronous and agent
runs differ only in which implementation ``collectors.make_collector`` and
``assemble.build_loop`` choose; the loop's lines are the same for all of them.

- ``Collector``: ``collect.Collector``, ``tree_collect.TreeCollector``,
  ``async_collect.AsyncCollector``, ``agent.collect.AgentCollector``,
  ``agent.tree_collect.AgentTreeCollector``.
- ``Evaluator``: ``evaluate.HeldOutEvaluator``, ``agent.evaluate.AgentEvaluator``.

A stage with one implementation is typed with its class (``StageTimer``, ``Ranks``,
``PromptBatcher``, ``GroupScorer``, ``RewardPool``); the sampler's contract is
``fastrl.rollout.base.GroupSampler``. The protocols are ``runtime_checkable``, so
``tests/train/test_contracts.py`` holds every implementation to its contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.rollout.base import GroupSampler
    from fastrl.train.experience import Experience
    from fastrl.train.run.metrics import StageTimer

__all__ = ["Collector", "Evaluator", "Samples", "StepMetrics"]

RolloutT = TypeVar("RolloutT")
"""What a collector's ``collect`` returns and its other methods take back (``GroupRollout``,
``AgentRollout``): the loop only hands it on."""

StepMetrics = tuple[dict[str, float], dict[str, list[float]]]
"""A step's scalar metrics and its histograms (``reward/...``)."""

Samples = tuple[tuple[str, str, float], tuple[str, str, float]]
"""``(prompt, completion, reward)`` of a step's best and worst sample (``samples.txt``)."""


@runtime_checkable
class Collector(Protocol[RolloutT]):
    """One step's rollouts, and what the loop reads of them."""

    def collect(self, *, sampler: GroupSampler, step: int, timer: StageTimer) -> tuple[RolloutT, dict[str, float]]:
        """Step ``step``'s rollout (this rank's share) and its collection metrics (``dynamic/...``,
        ``async/...``); ``timer`` times its ``generate`` and ``reward`` stages."""
        ...

    def experience(self, rollout: RolloutT, *, device: torch.device) -> Experience:
        """The step's ``Experience`` (the update's tensors) of ``rollout``."""
        ...

    def step_metrics(self, rollout: RolloutT, exp: Experience) -> StepMetrics:
        """The step's reward, length and rollout metrics, and its histograms."""
        ...

    def samples(self, rollout: RolloutT, tokenizer: PreTrainedTokenizerBase) -> Samples:
        """The step's best and worst sample as text."""
        ...

    def checkpoint_extra(self) -> dict[str, Any]:
        """This rank's objects a checkpoint must hold beyond the batcher's position (rollouts in flight)."""
        ...

    def close(self) -> None:
        """Release what the collector started (a sampler process); called once, with the run."""
        ...


@runtime_checkable
class Evaluator(Protocol):
    """The held-out evaluation, called with no argument at the steps ``eval_every`` names."""

    sampler: GroupSampler
    """The run's sampler of the moment (the trainer sets it before each call)."""
    last_row_success: list[int] | None
    """The last evaluation's success (0/1) per held-out row, in row order (``fastrl.commands.paired``)."""

    def __call__(self) -> dict[str, float]:
        """The ``eval/...`` metrics (empty without held-out rows)."""
        ...
