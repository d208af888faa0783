"""What ``fastrl train`` shows while it runs: the plan of the run in one line, a progress
bar for the supervised warm-up and one for the RL steps, each value labelled.

On a terminal the bars are tqdm bars; when the output is piped or written to a file (not a
TTY) every bar prints plain lines instead (the first step, every ``PLAIN_LINE_EVERY``-th and
the last), so logs carry no carriage returns or cursor-movement codes. While ``fastrl train``
runs, transformers' and huggingface_hub's own bars (shard writing when a model is saved) are
switched off (``quiet_hf_progress_bars``), so they cannot interleave with fastrl's lines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from fastrl.train.config import TrainConfig


# The metrics the RL bar shows, with the label each is shown under.
STEP_LABELS: dict[str, str] = {
    "reward/mean": "reward",
    "eval/accuracy": "heldout_acc",
    "kl/ref": "kl_to_ref",
    "loss/clip_frac": "clipped",
    "time/step": "s_per_step",
}
# Without a terminal: one plain line at the first step, every PLAIN_LINE_EVERY-th step (or
# every total/PLAIN_LINES_PER_BAR-th, whichever is rarer) and the last.
PLAIN_LINE_EVERY = 10
PLAIN_LINES_PER_BAR = 20


def algorithm_label(cfg: TrainConfig) -> str:
    return cfg.algorithm.upper().replace("_PP", "++").replace("DR_", "Dr. ")


def describe_run(cfg: TrainConfig) -> str:
    """The run's plan in one line, from a resolved ``TrainConfig`` (what is done, in order,
    and where the output goes)."""
    parts = []
    if cfg.sft_steps and not cfg.resume:
        if cfg.sft_target_accuracy is not None:
            probed = (f"probed at most {cfg.sft_check_every} steps apart, sooner near the target" if cfg.sft_probe_sooner
                      else f"checked every {cfg.sft_check_every} steps")
            parts.append(f"warm-up until {cfg.sft_target_accuracy:.0%} greedy accuracy on {cfg.sft_probe_rows} training "
                         f"prompts ({probed}, at most {cfg.sft_steps} steps)")
        else:
            parts.append(f"{cfg.sft_steps} supervised warm-up steps")
    batch = (f"{cfg.prompts_per_step} prompts x {cfg.group_size} samples" if not cfg.prompt_token_budget
             else f"{cfg.prompt_token_budget}-token prompt batches x {cfg.group_size} samples")
    rl = f"{cfg.steps} {algorithm_label(cfg)} steps of {batch} (up to {cfg.max_new_tokens} new tokens each)"
    if getattr(cfg, "env", None) is not None:
        rl = (f"{cfg.steps} {algorithm_label(cfg)} steps of {cfg.prompts_per_step} rows x {cfg.group_size} trajectories in "
              f"{cfg.env} (up to {cfg.max_turns} turns, {cfg.max_trajectory_tokens} tokens each)")
    parts.append(("then " if parts else "") + rl)
    if cfg.eval_every:
        parts.append(f"held-out evaluation ({cfg.eval_prompts} prompts) before step 1, every {cfg.eval_every} steps "
                     "and at the end")
    where = Path(cfg.output_dir).expanduser().resolve()
    resume = f"resuming from {cfg.resume}; " if cfg.resume else ""
    return f"fastrl train: {resume}" + ", ".join(parts) + f"; output in {where}"


def describe_evaluation(cfg: TrainConfig, prompts: int, step: int) -> str:
    """The line shown when a held-out evaluation starts (it generates for every prompt)."""
    if getattr(cfg, "env", None) is not None:
        return (f"held-out evaluation at RL step {step}: {prompts} greedy episodes of {cfg.env} "
                f"(up to {cfg.max_turns} turns) ...")
    sampled = f" + {cfg.pass_k} samples each for pass@{cfg.pass_k}" if cfg.pass_k > 1 else ""
    return (f"held-out evaluation at RL step {step}: {prompts} prompts, greedy{sampled}, "
            f"up to {cfg.max_new_tokens} new tokens ...")


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """A labelled progress bar: tqdm on a terminal, plain lines otherwise.

    ``advance(values)`` moves one step and shows ``values`` (label -> number);
    ``write(text)`` prints a line without breaking the bar.
    """

    def __init__(self, *, total: int, desc: str, unit: str, initial: int = 0, stream: TextIO | None = None,
                 terminal: bool | None = None):
        self.stream = sys.stderr if stream is None else stream
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.every = max(PLAIN_LINE_EVERY, total // PLAIN_LINES_PER_BAR)
        self.bar = None
        if is_terminal(self.stream) if terminal is None else terminal:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, initial=initial, desc=desc, unit=f" {unit}", dynamic_ncols=True,
                                file=self.stream)
            except ImportError:
                self.bar = None

    def advance(self, values: dict[str, float] | None = None) -> None:
        self.n += 1
        shown = {k: f"{v:.3g}" for k, v in (values or {}).items()}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)
        elif self.n == 1 or self.n % self.every == 0 or self.n == self.total:
            self.write(f"{self.desc}: {self.unit} {self.n}/{self.total}" + "".join(f"  {k} {v}" for k, v in shown.items()))

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def step_values(metrics: dict[str, Any]) -> dict[str, float]:
    """The RL bar's labelled values from one step's metrics."""
    return {label: float(metrics[key]) for key, label in STEP_LABELS.items() if key in metrics}


def rl_progress_label(cfg: TrainConfig) -> str:
    """The RL bar's label: the algorithm, e.g. ``GRPO (RL)``."""
    return f"{algorithm_label(cfg)} (RL)"


def warmup_progress(total: int, *, initial: int = 0, stream: TextIO | None = None, terminal: bool | None = None) -> Progress:
    return Progress(total=total, desc="warm-up (SFT)", unit="step", initial=initial, stream=stream, terminal=terminal)


def quiet_hf_progress_bars() -> None:
    """Switch off transformers' and huggingface_hub's progress bars (shard writing, downloads)
    for this process, so they do not interleave with fastrl's."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


class WarmupProgress:
    """The warm-up's bar: the SFT loss after every step, the probe accuracy after every check.
    With ``enabled=False`` (``progress=False``, or a rank other than 0) it shows nothing. ``initial``:
    the steps a resumed warm-up had done."""

    def __init__(self, total: int, *, target_accuracy: float | None, enabled: bool, stream: TextIO | None = None,
                 terminal: bool | None = None, initial: int = 0):
        self.target = target_accuracy
        self.values: dict[str, float] = {}
        self.bar = warmup_progress(total, initial=initial, stream=stream, terminal=terminal) if enabled else None

    def on_step(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.values["sft_loss"] = loss
            self.bar.advance(self.values)

    def on_probe(self, step: int, accuracy: float) -> None:
        if self.bar is not None:
            self.values["greedy_acc"] = accuracy
            target = f" (target {self.target:.0%})" if self.target is not None else ""
            self.bar.write(f"warm-up: greedy accuracy {accuracy:.3f} on training prompts after {step} steps{target}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
