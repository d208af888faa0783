"""What ``fastrl compare`` runs when the command line leaves it out, the algorithms it accepts,
and its input error: the names every other module of the command shares."""

from __future__ import annotations

from dataclasses import dataclass

from fastrl.train.config import ALGORITHMS

HYBRID = "grpo_then_ppo"
"""GRPO for a share of the budget, then PPO from its final policy, the critic initialised from it."""
COMPARE_ALGORITHMS: tuple[str, ...] = (*ALGORITHMS, HYBRID)

DEFAULT_ALGORITHMS = ("ppo", "grpo")
DEFAULT_SEEDS = 3
DEFAULT_BUDGET = "40-steps"
"""The default budget: 40 RL steps per run. With the built-in task (16 prompts x 8 samples a
step) PPO and GRPO see the same 5120 samples. Timed end to end at code c54dab1 on the
project's 2-core CPU shared with other sessions (load 2.0 at the start and the end,
``--jobs 1``, torch's default threads): 12.3 min wall, 10.6 min CPU, of which the shared
warm-up took 11.3 min wall and 9.2 min CPU (it ran to 500 SFT steps, probe accuracy 0.48) and
each of the six runs about 10 s wall (2-3 s of RL steps). Not timed on an idle machine."""


@dataclass(frozen=True)
class EnvCompareDefaults:
    """What ``fastrl compare --env NAME`` uses for a built-in environment where the command
    line leaves it out: sized so that ``--algorithms grpo gigpo ppo grpo_then_ppo`` (four
    algorithms, five ``fastrl train`` processes a seed) fits 15 minutes on the project's
    2-core CPU, warm-up included, with the default ``--jobs`` (2 there: two single-threaded
    runs at once). An agent step costs several times a single-turn one, so ``DEFAULT_BUDGET``
    would not fit. Timed end to end at code 17b71b6 on that CPU, otherwise idle:
    sql 13.6 min wall (its warm-up 7.1), frozenlake 11.5, calculator 4.4; at load ~5-10 from
    other sessions (code db8c24e) 37.3, 21.9 and 12.7. The reports are in ``docs/compare.md``."""

    budget: str
    """``--budget`` of every run."""
    seeds: int
    """``--seeds``."""
    evaluations: int
    """Held-out evaluations along the budget after the start's (``--eval_every`` is the budget
    over this, rounded up): each one plays every held-out row, so fewer than the single-turn
    default's six."""
    threads: int = 1
    """``--threads`` of the shared warm-up and of every run (unless given): the built-in
    environments' tiny model gains little from a second intra-op thread, and on a shared CPU
    a second thread waits at every parallel region for a descheduled partner (measured in
    this project at load ~13 on 2 cores: the warm-up's second thread used as much CPU as the
    first, and the warm-up ran several times longer than its single-thread time)."""


ENV_COMPARE_DEFAULTS: dict[str, EnvCompareDefaults] = {
    # per step on an idle core (GRPO, 16 prompts x 8 trajectories): frozenlake ~2 s, calculator ~1 s;
    # sql's warm-up (~280 SFT steps) is most of its time
    "frozenlake": EnvCompareDefaults(budget="16-steps", seeds=3, evaluations=2),
    "calculator": EnvCompareDefaults(budget="24-steps", seeds=3, evaluations=3),
    "sql": EnvCompareDefaults(budget="12-steps", seeds=3, evaluations=2),
}
"""Per built-in environment (keys among ``fastrl.agents.envs.BUILTIN_ENVS``)."""
DEFAULT_EVALUATIONS = 6
"""Held-out evaluations along a steps budget after the start's (``--eval_every`` = budget / this)."""
DEFAULT_JOBS = 1
"""``--jobs`` for runs of a user's model without ``--threads``: one after another. Such a run's
threads are ``fastrl train``'s rule's (the free cores, ``fastrl.train.run.threads``), so two at once
would share the cores and each wait at its parallel regions for the other's threads; not
measured to pay off."""
BUILTIN_MODEL_THREADS = 1
"""``--threads`` of the built-in model's runs (and a built-in ``--env``'s, ``EnvCompareDefaults.threads``)
unless given: one, and ``cores`` runs at a time. On the idle 2-core CPU the embedded default's
short run took 12.8 s on one thread and 10.0 s on two (``benchmarks/results/thread_rule_idle_cpu.json``):
two one-thread runs side by side end in about 13 s where two two-thread runs one after the
other take 20 s; and a pinned count makes each seed one run whatever the load (the rule
follows the machine)."""


class CompareError(ValueError):
    """A mistake in the ``fastrl compare`` command line, found before any run starts."""
