"""Why `fastrl train --env sql` episodes fail: a saved policy (a run's `final/`, or its
`reference/`, the policy after the warm-up = step 0) plays the run's held-out rows (or its first
100 training rows), greedy or sampled, and each episode is classified per question kind: `ok`,
`copy_fail` (the query returned the answer, the model then answered something else),
`wrong_query` (the query ran and returned another value), `sql_error`, `no_call`. Sampled runs
also count the groups whose episodes all scored alike (no GRPO signal).

    OMP_NUM_THREADS=1 python benchmarks/sql_failures.py --model RUN/reference --seed 1 \
        [--temperature 1.0 --group_size 8] [--rows train] [--out results.json]

The rows, renderer, environment and limits are the run's (`fastrl train --env sql --seed S`'s
defaults); the tokenizer is the built-in character tokenizer (a run's `reference/` holds none).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

CATEGORIES = ("ok", "copy_fail", "wrong_query", "sql_error", "no_call")
HELDOUT_ROWS, TRAIN_ROWS = "heldout", "train"
SAMPLING_SEED = 0
"""torch's seed before the episodes (sampled runs repeat)."""
PROBE_ROWS = 100
"""Training rows played with ``--rows train`` (the warm-up's probe rows)."""


def question_kind(prompt: str, questions) -> int:
    """Index of the ``QUESTIONS`` template the prompt was made from."""
    for index, (question, _) in enumerate(questions):
        pattern = re.escape(question).replace(r"\{product\}", r"\w+").replace(r"\{name\}", r"\w+")
        if re.search(pattern, prompt):
            return index
    raise ValueError(f"no question template matches {prompt!r}")


def classify(trajectory) -> str:
    """One episode's outcome (module docstring): the first tool result's last line is the query's value."""
    if trajectory.outcome_reward >= 1:
        return "ok"
    results = [m["content"] for m in trajectory.messages if m.get("role") == "tool"]
    if not results:
        return "no_call"
    if results[0].startswith("error"):
        return "sql_error"
    lines = results[0].strip().splitlines()
    return "copy_fail" if lines and lines[-1] == trajectory.row["answer"] else "wrong_query"


def main() -> int:
    from transformers import AutoModelForCausalLM

    from fastrl.agents.envs.sql import QUESTIONS
    from fastrl.rollout import HFGroupSampler
    from fastrl.rollout.base import SamplingConfig
    from fastrl.train.agent.build import build_agent
    from fastrl.train.agent.collect import play_episodes
    from fastrl.train.config import apply_env_defaults
    from fastrl.train.config import TrainConfig
    from fastrl.train.task import char_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a saved policy directory (a run's final/ or reference/)")
    parser.add_argument("--seed", type=int, required=True, help="the run's --seed (its rows)")
    parser.add_argument("--rows", choices=[HELDOUT_ROWS, TRAIN_ROWS], default=HELDOUT_ROWS)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy, one episode per row")
    parser.add_argument("--group_size", type=int, default=8, help="episodes per row when sampling")
    parser.add_argument("--out", type=Path, default=None, help="append the figures as one JSON line")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SAMPLING_SEED)
    tokenizer = char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    cfg = TrainConfig(env="sql", seed=args.seed)
    apply_env_defaults(cfg, builtin_model=True)
    setup = build_agent(cfg, tokenizer)
    try:
        rows = setup.train_rows[:PROBE_ROWS] if args.rows == TRAIN_ROWS else setup.eval_rows
        greedy = args.temperature == 0
        group = 1 if greedy else args.group_size
        sampling = SamplingConfig(greedy=True) if greedy else SamplingConfig(temperature=args.temperature)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        started = time.process_time()
        with torch.no_grad():
            trajectories, _ = play_episodes(rows, group_size=group, sampler=HFGroupSampler(model, pad_token_id=pad),
                                            sampling=sampling, runtime=setup.runtime, renderer=setup.renderer,
                                            agent=setup.agent, env_seeds=list(range(len(rows))))
        cpu = time.process_time() - started
    finally:
        setup.close()
    counts = collections.Counter((question_kind(t.row["prompt"], QUESTIONS), classify(t)) for t in trajectories)
    groups = collections.defaultdict(set)
    for k, t in enumerate(trajectories):
        groups[k // group].add(t.outcome_reward)
    per_kind = {QUESTIONS[i][0]: {c: counts[(i, c)] for c in CATEGORIES} for i in range(len(QUESTIONS))}
    result = {"model": str(args.model), "seed": args.seed, "rows": args.rows, "temperature": args.temperature,
              "episodes": len(trajectories), "success": sum(t.outcome_reward >= 1 for t in trajectories) / len(trajectories),
              "total": {c: sum(counts[(i, c)] for i in range(len(QUESTIONS))) for c in CATEGORIES}, "per_kind": per_kind,
              "groups_all_equal": None if greedy else sum(len(v) == 1 for v in groups.values()), "groups": len(groups),
              "cpu_seconds": round(cpu, 1), "load_average": round(os.getloadavg()[0], 2)}
    print(json.dumps(result))
    if args.out is not None:
        with open(args.out, "a") as sink:
            sink.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
