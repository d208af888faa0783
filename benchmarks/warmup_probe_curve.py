"""A built-in environment's warm-up probed at every step of a range: how fast greedy success
climbs near the warm-up's target, and so how far a probe interval overshoots it.

    python benchmarks/warmup_probe_curve.py --env sql --seed 0 --start 200 --stop 260 \
        --out benchmarks/results/warmup_probe_curve_sql_seed0_cpu.json

Runs the stages of ``fastrl train --env ENV --seed S`` up to its warm-up (the same config, model
and seeded batches) and replaces the run's probe schedule by a grid: a probe after every
``--every`` steps from ``--start`` to ``--stop``, where the warm-up stops. Probing draws no random
numbers, so the curve is the one the run itself climbs (tests/bench/test_warmup_probe_curve_smoke.py).
Reports each probe and, on this curve, where the warm-up stops under ``ProbeSchedule``'s two
rules: every ``sft_check_every`` steps (the default) and sooner near the target
(``--sft_probe_sooner``), when the range holds every probe of the rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.env_train_seeds import code_version  # noqa: E402
from fastrl.bench.harness import environment, write_payload  # noqa: E402


@dataclasses.dataclass
class Grid:
    """A probe schedule (``ProbeSchedule``'s ``due`` / ``reached``): every ``every`` steps from
    ``start``; the warm-up stops at the probe at or after ``stop``, whatever the accuracy."""

    start: int
    stop: int
    every: int = 1

    def due(self, steps_done: int) -> bool:
        return steps_done >= self.start and (steps_done - self.start) % self.every == 0

    def reached(self, steps_done: int, accuracy: float) -> bool:
        return steps_done >= self.stop


def probe_curve(cfg, grid: Grid):
    """The warm-up of ``cfg`` (a ``TrainConfig`` of a built-in environment) probed on ``grid``:
    ``(WarmupResult, the warmed-up policy module)``."""
    from fastrl.train import assemble
    from fastrl.train.agent import build as agent_build
    from fastrl.train.trainer import RUN_FILES

    cfg = cfg.resolved(model_given=False)
    site = assemble.open_run(cfg, run_files=RUN_FILES)
    task = None
    try:
        loaded = assemble.load_policy(cfg, site, model=None, tokenizer=None)
        task = assemble.build_inputs(cfg, site, loaded, train_rows=None, eval_rows=None)
        result = agent_build.warm_up_on_transcripts(cfg, loaded.module, loaded.tokenizer, task.agent, ranks=site.ranks,
                                           progress=False, schedule=grid)
        return result, loaded.module
    finally:
        if task is not None and task.agent is not None:
            task.agent.close()
        if site.run_lock is not None:
            site.run_lock.release()
        site.ranks.close()


def stops_on_curve(probes: list[tuple[int, float]], *, check_every: int, target: float) -> dict:
    """Where a warm-up to ``target`` stops on ``probes`` (every step of a range) under
    ``ProbeSchedule`` every ``check_every`` steps (``fixed_interval``, whose probes before the range
    are taken to be short of the target) and sooner near the target (``sooner_near_target``,
    replayed from step ``check_every``: ``None`` when it wants a probe before the range): the first
    probe at or past the target, ``None`` when the range has none."""
    from fastrl.train.sft import ProbeSchedule

    curve = dict(probes)

    def fixed() -> tuple[int, float] | None:
        for step in sorted(curve):
            if step % check_every == 0 and curve[step] >= target:
                return step, curve[step]
        return None

    def adaptive() -> tuple[int, float] | None:
        schedule = ProbeSchedule(check_every, target, sooner_near_target=True)
        step = schedule.next_at
        while step <= max(curve):
            if step not in curve:  # before the range: its accuracy is not known here
                return None
            if schedule.reached(step, curve[step]):
                return step, curve[step]
            step = schedule.next_at
        return None

    return {"fixed_interval": fixed(), "sooner_near_target": adaptive()}


def main(argv: list[str] | None = None) -> int:
    from fastrl.train.config import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="sql", help="a built-in environment")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, required=True, help="the first step probed")
    parser.add_argument("--stop", type=int, required=True, help="the last step (the warm-up stops there)")
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(env=args.env, seed=args.seed, output_dir=tmp, overwrite=True, progress=False, tensorboard=False,
                          sft_steps=args.stop)
        t0 = time.perf_counter()
        result, _ = probe_curve(cfg, Grid(args.start, args.stop, args.every))
        seconds = time.perf_counter() - t0
        resolved = cfg.resolved(model_given=False)
    probes = [(int(s), float(a)) for s, a in result.probes]
    stops = stops_on_curve(probes, check_every=resolved.sft_check_every, target=resolved.sft_target_accuracy)
    payload = {
        "what": f"the warm-up of `fastrl train --env {args.env} --seed {args.seed}` probed every {args.every} step(s) "
                f"from {args.start} to {args.stop} (greedy success on its {resolved.sft_probe_rows} probe rows)",
        "command": "python benchmarks/warmup_probe_curve.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "env": args.env, "seed": args.seed, "check_every": resolved.sft_check_every,
        "target": resolved.sft_target_accuracy, "probes": probes, "stops": stops,
        "seconds": round(seconds, 1), "sft": result.metrics, "date": time.strftime("%Y-%m-%d"),
        "commit": code_version(results=args.out), "environment": environment(torch.device("cpu")),
    }
    write_payload(payload, args.out, stem="warmup_probe_curve")
    for step, acc in probes:
        print(f"{step:4d} {acc:.2f}")
    print(f"stops (step, probe): {stops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
