"""The ``fastrl compare`` command line and its plan: the parser, and every check made before
any run (algorithms, budget, seeds, the train options a comparison sets itself, each
algorithm's resolved configuration), giving a ``ComparePlan``."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fastrl.commands.compare.budget import Budget, check_budget_fits, parse_budget
from fastrl.commands.compare.defaults import (
    BUILTIN_MODEL_THREADS,
    COMPARE_ALGORITHMS,
    DEFAULT_ALGORITHMS,
    DEFAULT_BUDGET,
    DEFAULT_EVALUATIONS,
    DEFAULT_JOBS,
    DEFAULT_SEEDS,
    ENV_COMPARE_DEFAULTS,
    HYBRID,
    CompareError,
)
from fastrl.train.config import TrainConfig
from fastrl.train.run.threads import available_cores

FORBIDDEN_TRAIN_OPTIONS = {
    "algorithm": "--algorithms",
    "seed": "--seeds",
    "output_dir": "compare's own --output_dir",
    "resume": "nothing (a comparison starts every run fresh)",
    "critic_init": f"the {HYBRID} algorithm (GRPO's final policy initialises the critic)",
    "max_seconds": "--budget (e.g. 10m)",
    "max_generated_tokens": "--budget (e.g. 50k-tokens)",
}
"""Train options a comparison sets itself, with what to use instead."""


def ppo_fields(of: TrainConfig, group_size: int) -> dict[str, Any]:
    """The fields that give a PPO run ``group_size`` samples per prompt and as many samples per
    step as ``of`` (the resolved run configuration without them): ``prompts_per_step`` scaled
    by ``of.group_size / group_size`` (a ``prompt_token_budget`` batcher already packs by
    samples). CompareError when the group sizes do not divide."""
    fields: dict[str, Any] = {"group_size": group_size}
    if of.prompt_token_budget is None:
        samples = of.prompts_per_step * of.group_size
        if samples % group_size:
            raise CompareError(f"--ppo_group_size {group_size} does not divide the {samples} samples a step "
                               f"(prompts_per_step {of.prompts_per_step} x group_size {of.group_size})")
        fields["prompts_per_step"] = samples // group_size
    return fields


@dataclass
class ComparePlan:
    algorithms: list[str]
    seeds: list[int]
    budget: Budget
    output_dir: Path
    user_fields: dict[str, Any]
    """TrainConfig fields the user set (values that differ from the defaults)."""
    base: TrainConfig
    """The user's options resolved for the first algorithm: the values every run gets spelled out."""
    warmup: bool
    """The configuration has a supervised warm-up: run it once, start every run from its model."""
    hybrid_split: float
    ppo_group_size: int | None
    """Trajectories per prompt of PPO runs (and the PPO phase of ``grpo_then_ppo``); None: the
    runs' ``group_size``. PPO needs no group: with fewer per prompt it gets proportionally more
    prompts per step (``ppo_fields``), so every algorithm samples as many trajectories a step."""
    ppo_overrides: dict[str, Any]
    """The ``TrainConfig`` fields ``ppo_group_size`` sets on PPO runs (empty without it)."""
    warmup_seed: int
    steps_cap: int | None
    eval_every: int
    overwrite: bool
    argv: list[str]
    jobs: int = DEFAULT_JOBS
    """Runs at once (``--jobs``); results do not depend on it."""


def default_jobs(*, threads: int | None, cores: int) -> int:
    """``--jobs`` when not given: ``cores // threads`` for runs of a fixed thread count (a
    built-in ``--env``: ``--threads`` 1 unless given), at least 1; ``DEFAULT_JOBS`` for runs
    whose threads are torch's default (``threads`` None)."""
    if threads is None or threads < 1:
        return DEFAULT_JOBS
    return max(1, cores // threads)


def build_compare_parser() -> argparse.ArgumentParser:
    from fastrl.cli_style import ArgumentParser

    parser = ArgumentParser(
        prog="fastrl compare",
        allow_abbrev=False,  # `--seed` must not abbreviate `--seeds`: unknown options go to `fastrl train`
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run RL algorithms side by side on one model, task and budget (a fresh `fastrl train` process per\n"
                    "algorithm x seed) and report success, stability and cost with a verdict per axis.\n"
                    "Any other option is a `fastrl train` option (fastrl train --help) given to every run.",
        epilog=f"algorithms: {', '.join(COMPARE_ALGORITHMS)}\n"
               f"  {HYBRID}: GRPO for --hybrid_split of the budget, then PPO from its final policy (critic initialised from it)\n"
               "budgets: N-steps (200-steps), generated tokens (50k-tokens, 1.5M-tokens), wall time of the RL steps\n"
               "  (10m, 90s, 1h30m; evaluation not counted)\n"
               "outputs (under --output_dir): compare.json, compare.png, compare.txt, runs/<algorithm>-seed<k>/ (each run's\n"
               "  metrics.jsonl, config.yaml, train.log), start/ (the shared rows and warmed-up model)\n"
               "example:\n  fastrl compare --algorithms ppo grpo dr_grpo --seeds 3 --budget 5m --prompts_per_step 8",
    )
    parser.add_argument("--algorithms", nargs="+", default=list(DEFAULT_ALGORITHMS), metavar="NAME",
                        help=f"algorithms to compare (default: {' '.join(DEFAULT_ALGORITHMS)})")
    env_seeds = ", ".join(f"--env {n}: {d.seeds}" for n, d in ENV_COMPARE_DEFAULTS.items())
    env_budgets = ", ".join(f"--env {n}: {d.budget}" for n, d in ENV_COMPARE_DEFAULTS.items())
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help=f"seeds per algorithm: 0..N-1 (default {DEFAULT_SEEDS}; {env_seeds})")
    parser.add_argument("--budget", default=None,
                        help=f"per run: N-steps, N-tokens or a wall time (default {DEFAULT_BUDGET}; {env_budgets}: "
                             "sized so four algorithms x 3 seeds fit 15 min on a 2-core CPU; a built-in --env also "
                             "defaults --threads to 1)")
    parser.add_argument("--output_dir", default="runs/compare", help="where runs and the report go (default runs/compare)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in --output_dir")
    parser.add_argument("--hybrid_split", type=float, default=0.5,
                        help=f"share of the budget {HYBRID} spends on GRPO before PPO (default 0.5)")
    parser.add_argument("--ppo_group_size", type=int, default=None, metavar="K",
                        help="samples (trajectories) per prompt of PPO and of the PPO phase of grpo_then_ppo, with "
                             "prompts_per_step scaled by group_size / K so each step samples as many as the others "
                             "(1: one trajectory per prompt; with --env, GRPO then pays group_size trajectories' "
                             "environment calls per prompt and PPO one). Default: the runs' group_size")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="runs at once after the shared warm-up, each a `fastrl train` process of its own (a "
                             f"{HYBRID} run's PPO phase still waits for its GRPO phase). Runs are seeded, so results "
                             "do not depend on N. Default: the cores this process may use divided by --threads, which is 1 "
                             "with a built-in --env and on the built-in model; 1 for a user's model without --threads, "
                             "whose runs take the free cores (fastrl train's thread rule) and would contend for them")
    parser.add_argument("--warmup_seed", type=int, default=1,
                        help="seed of the shared warm-up (model init and SFT data order; default 1, which reaches the built-in "
                             "task's probe target in fewer SFT steps than seed 0)")
    return parser


def _explicit_train_options(argv: Sequence[str]) -> set[str]:
    names = set()
    for token in argv:
        if token.startswith("--"):
            names.add(token[2:].split("=", 1)[0].replace("-", "_"))
    return names


def plan_compare(argv: Sequence[str]) -> ComparePlan:
    """Parse and check everything before any run: unknown algorithms, a budget that does not
    parse or cannot hold one step, seeds < 1, train options that do not parse or that a
    comparison sets itself, and every algorithm's resolved configuration."""
    from fastrl.train.cli import build_train_parser, expand_sampler_url

    parser = build_compare_parser()
    args, rest = parser.parse_known_args(list(argv))
    rest = expand_sampler_url(rest)  # --sampler vllm-server URL
    unknown = [a for a in args.algorithms if a not in COMPARE_ALGORITHMS]
    if unknown:
        raise CompareError(f"--algorithms: unknown algorithm(s) {', '.join(map(repr, unknown))}; "
                           f"choose from {', '.join(COMPARE_ALGORITHMS)}")
    if len(set(args.algorithms)) != len(args.algorithms):
        raise CompareError(f"--algorithms: {args.algorithms} names an algorithm twice")
    if args.seeds is not None and args.seeds < 1:
        raise CompareError(f"--seeds must be >= 1, got {args.seeds}")
    if not 0.0 < args.hybrid_split < 1.0:
        raise CompareError(f"--hybrid_split must be in (0, 1), got {args.hybrid_split}")
    ppo_runs = "ppo" in args.algorithms or HYBRID in args.algorithms
    if args.ppo_group_size is not None and (args.ppo_group_size < 1 or not ppo_runs):
        raise CompareError(f"--ppo_group_size must be >= 1 and needs ppo or {HYBRID} in --algorithms, "
                           f"got {args.ppo_group_size} with {' '.join(args.algorithms)}")
    explicit = _explicit_train_options(rest)
    for name, instead in FORBIDDEN_TRAIN_OPTIONS.items():
        if name in explicit:
            raise CompareError(f"--{name} is set by the comparison itself; use {instead}")

    train_parser = build_train_parser()
    try:
        ns = train_parser.parse_args(list(rest))
    except SystemExit as e:  # jsonargparse printed what is wrong
        raise CompareError(f"the train options {' '.join(rest)!r} do not parse (see above)") from e
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc]
                for f in dataclasses.fields(TrainConfig)}
    user_fields = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)
                   if getattr(ns, f.name) != defaults[f.name]}
    for name in FORBIDDEN_TRAIN_OPTIONS:  # also from a --config YAML file
        if name in user_fields:
            raise CompareError(f"{name} (set in the --config file) is set by the comparison itself; "
                               f"use {FORBIDDEN_TRAIN_OPTIONS[name]}")
    env_defaults = ENV_COMPARE_DEFAULTS.get(user_fields.get("env"))  # a built-in environment's sizes
    budget = parse_budget(args.budget if args.budget is not None
                          else env_defaults.budget if env_defaults is not None else DEFAULT_BUDGET)
    seeds = args.seeds if args.seeds is not None else env_defaults.seeds if env_defaults is not None else DEFAULT_SEEDS
    if budget.kind == "steps" and "steps" in explicit:
        raise CompareError(f"--steps and --budget {budget.text!r} both set the number of steps; give one")
    if env_defaults is not None and "threads" not in user_fields:
        user_fields["threads"] = env_defaults.threads
    elif "threads" not in user_fields and "model" not in user_fields:
        user_fields["threads"] = BUILTIN_MODEL_THREADS  # runs side by side, each seed one run whatever the load
    if args.jobs is not None and args.jobs < 1:
        raise CompareError(f"--jobs must be >= 1, got {args.jobs}")
    jobs = args.jobs if args.jobs is not None else default_jobs(threads=user_fields.get("threads"), cores=available_cores())

    def resolve(algorithm: str, overrides: dict[str, Any] | None = None) -> TrainConfig:
        try:
            return TrainConfig(**{**defaults, **user_fields, "algorithm": algorithm,
                                  **budget.train_fields(steps_cap=user_fields.get("steps")), **(overrides or {})}).resolved()
        except ValueError as e:
            raise CompareError(f"{algorithm}: {e}") from None

    ppo_overrides = ppo_fields(resolve("ppo"), args.ppo_group_size) if args.ppo_group_size is not None else {}

    if budget.kind != "tokens":  # needs no configuration: checked before any other option
        check_budget_fits(budget, None, phases=2 if HYBRID in args.algorithms else 1)
    resolved = {}
    for algo in args.algorithms:
        for phase in (("grpo", "ppo") if algo == HYBRID else (algo,)):
            resolved[phase] = resolve(phase, ppo_overrides if phase == "ppo" else None)
            check_budget_fits(budget, resolved[phase], phases=2 if algo == HYBRID else 1)
    base = resolve(args.algorithms[0] if args.algorithms[0] != HYBRID else "grpo")
    eval_every = user_fields.get("eval_every", None)
    if eval_every is None:
        # about six evaluations along a steps budget (a built-in environment: its own count); every 10 steps otherwise
        evaluations = env_defaults.evaluations if env_defaults is not None else DEFAULT_EVALUATIONS
        eval_every = max(1, math.ceil(budget.amount / evaluations)) if budget.kind == "steps" else 10
    if eval_every == 0:
        raise CompareError("--eval_every 0 turns held-out evaluation off, and success is measured by it")
    return ComparePlan(
        algorithms=list(args.algorithms), seeds=list(range(seeds)), budget=budget, output_dir=Path(args.output_dir),
        user_fields=user_fields, base=base, warmup=base.sft_steps > 0, hybrid_split=args.hybrid_split,
        ppo_group_size=args.ppo_group_size, ppo_overrides=ppo_overrides, warmup_seed=args.warmup_seed,
        steps_cap=user_fields.get("steps"), eval_every=eval_every, overwrite=args.overwrite, argv=list(argv), jobs=jobs,
    )
