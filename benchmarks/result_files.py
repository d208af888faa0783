"""The results files the pages are rendered from: where they are, how one is read, and the ones
both the tables (render_tables.py) and the prose figures (figures.py) read."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

SAMPLER_VS_GENERATE = "rollout-vs-generate-cpu-20261202-060143.json"
SAMPLER_MULTITURN = "multiturn-rollout-cpu-20261202-055637.json"
TRAINER_VS_TRL_REAL_SHAPE = "trainer_vs_trl_real_shape_cpu.json"


def load(name: str) -> dict:
    """A results file, parsed."""
    return json.loads((RESULTS / name).read_text())


ENV_SEED_FILES = ("env_train_calculator_3seeds_narrowed_cpu.json", "env_train_frozenlake_3seeds_trie_narrowed_cpu.json",
                  "env_train_sql_trie_target05_default_threads_cpu.json")
"""The seed studies of built-in environments (benchmarks/env_train_seeds.py) the README shows, in order:
2026-12-04's with the warm-up's tries and the narrowed decode (code 868e46b; sql's 4725803 with
``--sft_target_accuracy 0.5``, its default since; at 0.4: ``env_train_sql_trie_warmup_default_threads_cpu.json``), whose runs
logged each held-out row's success (the rows gained and lost). Before those two changes (code 16a80a5):
``env_train_calculator_3seeds_paired_cpu.json``, ``env_train_frozenlake_3seeds_paired_cpu.json``,
``env_train_sql_width128_default_threads_paired_cpu.json``. The same studies on 2026-12-03's instance: ``env_train_calculator_3seeds_cpu.json``, ``env_train_frozenlake_3seeds_cpu.json``,
``env_train_sql_width128_default_threads_cpu.json`` (``..._agenttrain3c42318.json``: agenttrain's first
defaults, whose warm-up overshot its target). sql's is its command as a user types it (torch's two threads):
its 128-wide model takes 930-1160 CPU-s a run, over 10 minutes on one thread."""


def p_value(p: float) -> str:
    """An exact p-value as the pages print it."""
    return f"p = {p:.2g}" if p >= 0.001 else "p < 0.001"
