"""Every collector and evaluator holds to its contract (``fastrl/train/contracts.py``), and the
one place that chooses a run's collector (``fastrl/train/collectors.py``) picks the table's."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastrl.agents.driver import AgentConfig
from fastrl.train.agent.collect import AgentCollector
from fastrl.train.agent.evaluate import AgentEvaluator
from fastrl.train.agent.tree_collect import AgentTreeCollector
from fastrl.train.async_collect import AsyncCollector
from fastrl.train.run.checkpoint import extra_file
from fastrl.train.collect import GroupCollector
from fastrl.train.collectors import make_collector
from fastrl.train.config import TrainConfig
from fastrl.train.contracts import Collector, Evaluator
from fastrl.train.evaluate import HeldOutEvaluator
from fastrl.train.ranks import Ranks
from fastrl.train.tree_collect import TreeCollector

COLLECTORS = [GroupCollector, TreeCollector, AsyncCollector, AgentCollector, AgentTreeCollector]
EVALUATORS = [HeldOutEvaluator, AgentEvaluator]
CPU = torch.device("cpu")


def contract_breaches(cls: type, protocol: type) -> list[str]:
    """What ``cls`` lacks of ``protocol``'s methods: a method, or a parameter of one (by name and
    kind), or a required parameter the contract does not pass."""
    breaches = []
    for name, member in vars(protocol).items():
        if not callable(member) or (name.startswith("_") and name != "__call__"):
            continue
        impl = getattr(cls, name, None)
        if impl is None or not callable(impl):
            breaches.append(f"{name}: missing")
            continue
        want = dict(list(inspect.signature(member).parameters.items())[1:])
        have = dict(list(inspect.signature(impl).parameters.items())[1:])
        for p in want.values():
            if p.name not in have or have[p.name].kind != p.kind:
                breaches.append(f"{name}: parameter {p.name} ({p.kind.description})")
        for p in have.values():
            if p.name not in want and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                breaches.append(f"{name}: requires {p.name}, which the loop does not pass")
    return breaches


@pytest.mark.parametrize("cls", COLLECTORS, ids=lambda c: c.__name__)
def test_every_collector_has_the_collector_contract(cls):
    assert contract_breaches(cls, Collector) == []


@pytest.mark.parametrize("cls", EVALUATORS, ids=lambda c: c.__name__)
def test_every_evaluator_has_the_evaluator_contract(cls):
    assert contract_breaches(cls, Evaluator) == []


def test_the_check_sees_a_missing_method_and_a_renamed_parameter():
    class NoClose(GroupCollector):
        close = None

    class OtherTimer(GroupCollector):
        def collect(self, *, sampler, step, clock):  # noqa: ARG002
            return None, {}

    assert contract_breaches(NoClose, Collector) == ["close: missing"]
    assert contract_breaches(OtherTimer, Collector) == ["collect: parameter timer (keyword-only)",
                                                        "collect: requires clock, which the loop does not pass"]


def test_built_evaluators_are_evaluators_at_run_time():
    ranks = Ranks(None, CPU)
    held_out = HeldOutEvaluator(sampler=None, scorer=None, ranks=ranks, rows=[], prompt_ids=[], max_new_tokens=4, pass_k=1,
                                temperature=1.0, top_p=1.0, top_k=0, seed=0, prompt_seeds=lambda s, f, n: None)
    agent = AgentEvaluator(sampler=None, ranks=ranks, rows=[], runtime=None, renderer=None, agent=AgentConfig(), seed=0)
    assert isinstance(held_out, Evaluator) and isinstance(agent, Evaluator)
    assert held_out() == {}  # no held-out rows: no metrics
    assert not isinstance(object(), Evaluator)


@pytest.mark.parametrize("overrides,expected", [
    ({}, GroupCollector),
    ({"rollout": "tree"}, TreeCollector),
    ({"env": "calculator"}, AgentCollector),
    ({"env": "calculator", "rollout": "tree"}, AgentTreeCollector),
])
def test_make_collector_chooses_one_collector_per_kind_of_run(overrides, expected, tmp_path: Path):
    cfg = TrainConfig(**overrides).resolved()
    agent = SimpleNamespace(runtime=None, renderer=None) if cfg.env is not None else None  # only what the choice hands on
    collector = make_collector(cfg, batcher=None, ranks=Ranks(None, CPU), scorer=None, agent=agent, agent_scorer=None,
                               weights=torch.nn.Linear(1, 1), pad_token_id=0, device=CPU, resume_dir=None)
    assert type(collector) is expected
    assert isinstance(collector, Collector)


def test_a_resume_without_async_steps_drops_the_rollouts_in_flight_and_says_so(tmp_path: Path, caplog):
    torch.save([{"step": 3}], tmp_path / extra_file("in_flight", 0))
    cfg = TrainConfig().resolved()
    with caplog.at_level("WARNING"):
        collector = make_collector(cfg, batcher=None, ranks=Ranks(None, CPU), scorer=None, agent=None, agent_scorer=None,
                                   weights=torch.nn.Linear(1, 1), pad_token_id=0, device=CPU, resume_dir=tmp_path)
    assert type(collector) is GroupCollector
    assert "rollouts in flight are dropped" in caplog.text


def test_async_steps_off_the_cpu_is_refused_before_a_process_starts():
    from fastrl.errors import InputError

    cfg = TrainConfig(async_steps=1, rollout_correction="decoupled").resolved()
    with pytest.raises(InputError, match="sampler process runs on the CPU"):
        make_collector(cfg, batcher=None, ranks=Ranks(None, CPU), scorer=None, agent=None, agent_scorer=None,
                       weights=torch.nn.Linear(1, 1), pad_token_id=0, device=torch.device("meta"), resume_dir=None)
