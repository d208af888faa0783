"""The one place a run's ``contracts.Collector`` is chosen: single-turn, tree, asynchronous or agent.

=================================  =====================================================
run                                collector
=================================  =====================================================
single-turn                        ``collect.GroupCollector``
``rollout=tree``                   ``tree_collect.TreeCollector``
``async_steps=n`` (either above)   ``async_collect.AsyncCollector`` around it
``--env``                          ``agent.collect.AgentCollector``
``--env`` with ``rollout=tree``    ``agent.tree_collect.AgentTreeCollector``
=================================  =====================================================

A new kind of collection is a class implementing ``contracts.Collector`` and one branch here;
the loop does not change.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fastrl.train.config import TrainConfig
from fastrl.train.contracts import Collector
from fastrl.train.data import PromptBatcher
from fastrl.train.ranks import Ranks
from fastrl.train.score import GroupScorer

if TYPE_CHECKING:
    from fastrl.train.agent.build import AgentSetup
    from fastrl.train.agent.score import TrajectoryScorer

__all__ = ["make_collector"]


def make_collector(cfg: TrainConfig, *, batcher: PromptBatcher, ranks: Ranks, scorer: GroupScorer,
                   agent: AgentSetup | None, agent_scorer: TrajectoryScorer | None, weights: torch.nn.Module,
                   pad_token_id: int, device: torch.device, resume_dir: Path | None) -> Collector:
    """The step's collector (the module's table). ``agent``/``agent_scorer``: an env run's
    environment side and trajectory scorer (None single-turn); ``weights``: the module whose
    state is the trainer's current policy (its full copy under torchrun), which an
    ``AsyncCollector``'s sampler process is forked from now; ``resume_dir``: the checkpoint
    whose rollouts in flight an ``AsyncCollector`` restores."""
    if agent is not None:
        from fastrl.train.agent.collect import AgentCollector
        from fastrl.train.agent.tree_collect import AgentTreeCollector

        agent_class = AgentTreeCollector if cfg.rollout == "tree" else AgentCollector
        return agent_class(cfg=cfg, batcher=batcher, ranks=ranks, runtime=agent.runtime, renderer=agent.renderer,
                           pad_token_id=pad_token_id, scorer=agent_scorer)
    from fastrl.train.async_collect import drop_in_flight, start_async
    from fastrl.train.collect import GroupCollector
    from fastrl.train.tree_collect import TreeCollector

    inner = (TreeCollector if cfg.rollout == "tree" else GroupCollector)(cfg=cfg, batcher=batcher, ranks=ranks, scorer=scorer)
    if cfg.async_steps:
        return start_async(inner, cfg=cfg, ranks=ranks, weights=weights, pad_token_id=pad_token_id, device=device,
                           resume_dir=resume_dir)
    drop_in_flight(resume_dir, ranks=ranks)
    return inner
