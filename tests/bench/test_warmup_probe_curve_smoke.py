"""``benchmarks/warmup_probe_curve.py``: its replay of the two probe schedules on a curve
(hand-made curves), and, on a tiny calculator run, that probing leaves the warm-up's steps
as they are (the curve it reports is the run's own)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("warmup_probe_curve_smoke", os.path.join(ROOT, "benchmarks/warmup_probe_curve.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_stops_on_a_curve(bench):
    # flat, then crossing 0.5 at step 19 and jumping at 20
    curve = [(s, 0.1 if s <= 12 else 0.3 if s <= 17 else 0.48 if s == 18 else 0.55 if s == 19 else 0.9) for s in range(1, 31)]
    stops = bench.stops_on_curve(curve, check_every=10, target=0.5)
    # fixed: 10 (0.1), 20 (0.9); sooner near the target: 10 (0.1) -> +8 -> 18 (0.48) -> +1 -> 19 (0.55)
    assert stops == {"fixed_interval": (20, 0.9), "sooner_near_target": (19, 0.55)}
    assert bench.stops_on_curve(curve, check_every=10, target=0.95) == {"fixed_interval": None, "sooner_near_target": None}
    # a range that starts after the schedule's first probe: its replay cannot start
    assert bench.stops_on_curve(curve[14:], check_every=10, target=0.5) == {"fixed_interval": (20, 0.9), "sooner_near_target": None}
    grid = bench.Grid(start=4, stop=9, every=2)
    assert [n for n in range(1, 12) if grid.due(n)] == [4, 6, 8, 10] and grid.reached(9, 0.0) and not grid.reached(8, 1.0)


def test_probing_leaves_the_warm_up_as_it_is(bench, tmp_path):
    from fastrl.train.config import TrainConfig

    def run(grid, name):
        cfg = TrainConfig(env="calculator", seed=3, output_dir=str(tmp_path / name), progress=False, tensorboard=False,
                          model_hidden_size=16, model_layers=1, task_train_size=16, task_eval_size=2, sft_steps=3,
                          sft_batch_size=8, sft_probe_rows=4, env_workers=1, reward_workers=0, threads=1)
        return bench.probe_curve(cfg, grid)

    probed, policy_a = run(bench.Grid(start=1, stop=3), "probed")
    quiet, policy_b = run(bench.Grid(start=10, stop=10), "quiet")  # never due: no probe
    assert [s for s, _ in probed.probes] == [1, 2, 3] and all(0 <= a <= 1 for _, a in probed.probes)
    assert quiet.probes == () and probed.metrics["sft/steps"] == quiet.metrics["sft/steps"] == 3
    for (name, a), (_, b) in zip(policy_a.state_dict().items(), policy_b.state_dict().items()):
        assert torch.equal(a, b), name
