"""``compare.png``: the runs' curves and the seconds per stage, one colour per algorithm."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from fastrl.commands.compare.analysis import SMOOTHING_STEPS, STAGES, moving_average
from fastrl.commands.compare.summary import summarize


def plot_runs(runs: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path | None:
    """``compare.png``: held-out accuracy over RL seconds and over generated tokens, the
    smoothed reward over tokens, entropy and KL over steps, seconds per stage. One colour per
    algorithm, one line per seed. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    algos = list(dict.fromkeys(r["algorithm"] for r in runs))
    colors = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(algos)}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    (acc_t, acc_g, rew), (ent, kl, stages) = axes
    labelled: set[tuple[int, str]] = set()

    def line(ax, x, y, algo, **kw):
        key = (id(ax), algo)
        ax.plot(x, y, color=colors[algo], alpha=0.8, label=None if key in labelled else algo, **kw)
        labelled.add(key)

    for r in runs:
        if not r.get("success"):
            continue
        a = r["algorithm"]
        ev, c = r["evals"], r["curve"]
        line(acc_t, [e["seconds"] for e in ev], [e["accuracy"] for e in ev], a, marker="o", ms=3)
        line(acc_g, [e["generated_tokens"] for e in ev], [e["accuracy"] for e in ev], a, marker="o", ms=3)
        line(rew, c["generated_tokens"], moving_average(c["reward"], SMOOTHING_STEPS), a)
        line(ent, c["step"], c["entropy"], a)
        if any(math.isfinite(k) for k in c["kl"]):
            line(kl, c["step"], c["kl"], a)
    acc_t.set(xlabel="RL seconds (evaluation excluded)", ylabel="held-out accuracy", title="success over wall time")
    acc_g.set(xlabel="generated tokens", ylabel="held-out accuracy", title="success over tokens")
    rew.set(xlabel="generated tokens", ylabel=f"train reward ({SMOOTHING_STEPS}-step mean)", title="reward curve")
    ent.set(xlabel="step", ylabel="mean token entropy", title="entropy")
    kl.set(xlabel="step", ylabel="KL to reference (per token)", title="KL (runs with a reference)")
    summary = summarize(runs)
    names = [st for st in STAGES if any(st in summary[a]["stage_seconds"] for a in algos)]
    bottom = [0.0] * len(algos)
    for i, st in enumerate(names):
        heights = [summary[a]["stage_seconds"].get(st, 0.0) for a in algos]
        stages.bar(algos, heights, bottom=bottom, label=st, color=plt.get_cmap("tab20")(i % 20))
        bottom = [b + h for b, h in zip(bottom, heights)]
    stages.set(ylabel="seconds (mean over seeds)", title="cost per stage")
    for ax in (acc_t, acc_g, rew, ent, kl, stages):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
