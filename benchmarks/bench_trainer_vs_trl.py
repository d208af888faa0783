"""fastrl's trainer vs TRL's ``GRPOTrainer`` on the same tiny model and task (CPU, no vLLM).

Issue 8, "Benchmark": the same tiny model, task, group size, lengths, optimizer and number
of steps under ``fastrl.train.Trainer`` and ``trl.GRPOTrainer``, each in a fresh process:
seconds per step by stage, peak memory, and held-out success at an equal wall-clock
budget; PPO and GRPO (both fastrl) on the same task at the same budget.

Setup, done once in the parent process and shared by every run:

- the built-in character tokenizer and ``tiny_model`` of ``fastrl.train.task`` (seeded),
  warmed up ONCE with ``fastrl.train.sft.sft_warmup`` on the built-in ``ArithmeticTask``
  (a random model never earns a reward on this task), then saved with
  ``save_pretrained``; every run loads that directory, so all start from identical weights;
- the task's train rows (a ``datasets.Dataset`` of chat prompts for TRL, plain rows for
  fastrl: both render to the same token ids through the tokenizer's chat template, which
  is checked), its held-out rows for evaluation;
- one reward, ``exact_match_reward`` below, a plain module-level function with TRL's
  signature, used unchanged by both trainers;
- the same group size, prompts per step, completion length, temperature 1.0, AdamW
  (lr, betas, eps, no weight decay, constant rate, grad-norm clip 1.0), KL coefficient
  ``beta`` to the frozen start policy (k3, in the loss), clip 0.2, per-sequence token-mean
  loss (TRL ``loss_type="grpo"`` = fastrl's grpo preset ``seq-mean-token-mean``), group
  std-scaled advantages (TRL ``scale_rewards="group"``), one optimizer step per
  generation batch;
- one evaluation, ``greedy_accuracy`` below (HF ``generate``, greedy, exact match with the
  same reward function), applied to both final models, so the metric is identical.

Every run is a fresh ``python`` process with ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)``; it prints one ``RESULT {json}`` line. Measured per run:

- seconds per step (median and mean over steps; ``wall_per_step_s`` = training wall time /
  steps, everything the loop does included) and per stage: fastrl from the metrics its
  ``train_step`` returns (the dicts ``train()`` writes to ``metrics.jsonl``: time/generate,
  time/reward, time/ref_logp, time/update, time/sync, ...); TRL from its own profiling
  contexts (``transformers.generate``, ``_calculate_rewards``, the log-prob passes inside
  ``_prepare_inputs`` = reference log-probs), recorded by patching
  ``trl.extras.profiling.ProfilingContext._log_metrics`` in the child (TRL only sends them
  to wandb/mlflow/trackio), and a ``TrainerCallback`` around each optimizer step; TRL's
  "update" is the step minus ``_prepare_inputs`` (loss forward, backward, clip, AdamW);
- peak resident memory: the process peak (``ru_maxrss`` before training, Linux ``VmHWM``
  after, reset with ``/proc/self/clear_refs`` at the start of training) and the training
  increase (peak during training minus the resident size when training starts);
- held-out greedy accuracy of the final model (and of the shared start model).

Modes: fixed steps (``--steps``, repeated ``--repeats`` times interleaved, best-of-n by
median step time) and equal wall-clock budget (``--budget-seconds``: each side trains
until the budget is spent, checked after every step; fastrl via ``Trainer.train_step()``
in a loop, TRL via a callback that sets ``control.should_training_stop``), run for
fastrl GRPO, TRL GRPO and fastrl PPO.

    python benchmarks/bench_trainer_vs_trl.py                 # full run, writes results/trainer_vs_trl_cpu.json
    python benchmarks/bench_trainer_vs_trl.py --quick         # smoke version (a few minutes on a loaded CPU)
    python benchmarks/bench_trainer_vs_trl.py --real-shape    # issue 20's shape (REAL_SHAPE), writes
                                                              # results/trainer_vs_trl_real_shape_cpu.json

``--real-shape`` (``BenchSettings.shape = "qwen2-real"``): a seeded random Qwen2 with a 151,936-token
vocabulary, hidden 256, 4 layers, built from a config; an offline word-level tokenizer of the same size
(saved beside the model under ``tokenizer/``); random 256-token prompts; 2 prompts x G=8, 128-token
completions; a CRC reward so every group has a spread. The figures to quote on a shared CPU are the
process CPU seconds per step and the peak RSS (``step_cpu_time_fastrl_over_trl``,
``peak_rss_fastrl_over_trl``); fixed-step repeats alternate which side runs first, and each finished
run is also written to ``OUT.partial`` (a TRL step at this shape is ~100 CPU seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RESULT_PREFIX = "RESULT "


# ---------------------------------------------------------------------------- shared settings
@dataclass
class BenchSettings:
    """Everything both trainers share. Written into the results JSON."""

    seed: int = 0
    """Seed of the model init, the problem draw, the warm-up and both RL runs."""
    digits: int = 2
    """Operand digits of the arithmetic task (the embedded default's)."""
    operations: str = "+"
    """Operations of the arithmetic task."""
    num_train: int = 2000
    """Training problems."""
    num_heldout: int = 200
    """Held-out problems (greedy accuracy is measured on all of them)."""
    hidden_size: int = 64
    """Tiny model width (the embedded default's)."""
    layers: int = 2
    """Tiny model decoder layers."""
    sft_steps: int = 600
    """Warm-up steps, done once before both RL runs. The embedded default's 200 leave the model at ~4%
    held-out accuracy, where neither trainer moves much in a few minutes; 600 start it at ~13%."""
    sft_lr: float = 3e-3
    """Warm-up learning rate."""
    sft_batch_size: int = 32
    """Warm-up rows per step."""
    group_size: int = 8
    """Completions per prompt (G; TRL ``num_generations``)."""
    prompts_per_step: int = 16
    """Prompts per step (TRL: ``per_device_train_batch_size = prompts_per_step * group_size``)."""
    max_new_tokens: int = 6
    """Completion budget (TRL ``max_completion_length``)."""
    temperature: float = 1.0
    """Sampling temperature (and the loss's)."""
    lr: float = 2e-4
    """AdamW learning rate, constant."""
    beta: float = 0.04
    """KL coefficient to the frozen start policy (k3 estimator, in the loss)."""
    clip: float = 0.2
    """PPO clip epsilon (low = high)."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    steps: int = 10
    """Steps of the fixed-step comparison."""
    repeats: int = 3
    """Fresh-process repeats of the fixed-step comparison (best-of-n by median step time)."""
    budget_seconds: float = 150.0
    """Wall-clock training budget of the equal-budget comparison (0: skip it)."""
    eval_batch_size: int = 100
    """Prompts per ``generate`` call of the shared evaluation."""
    shape: str = "task"
    """``task``: the tiny model warmed up on the arithmetic task (everything above). ``qwen2-real``: issue 20's
    real shape (``REAL_SHAPE`` below): a seeded random Qwen2 with a 151,936-token vocabulary and an offline
    word-level tokenizer of that size, random prompts of exactly ``prompt_tokens`` tokens, a hash reward;
    no warm-up, no held-out evaluation, no equal-budget runs (the step's cost is the figure)."""
    vocab_size: int = 151_936
    """Vocabulary of the ``qwen2-real`` model and tokenizer."""
    prompt_tokens: int = 256
    """Prompt length of the ``qwen2-real`` shape, in tokens."""
    fastrl_first: bool = False
    """Fixed-step repeats alternate the order (TRL then fastrl, then fastrl then TRL, ...); True starts with fastrl."""


SHAPES = ("task", "qwen2-real")
"""The values of ``BenchSettings.shape``."""

REAL_SHAPE = dict(shape="qwen2-real", hidden_size=256, layers=4, vocab_size=151_936, prompt_tokens=256, group_size=8,
                  prompts_per_step=2, max_new_tokens=128, sft_steps=0, num_train=64, num_heldout=0, steps=3, repeats=3,
                  budget_seconds=0.0)
"""Issue 20's real shape: Qwen2 (vocab 151,936, hidden 256, 4 layers), 2 prompts x G=8, 256 + 128 tokens."""


# ---------------------------------------------------------------------------- shared reward and evaluation
def _completion_text(completion: Any) -> str:
    """TRL hands chat completions as ``[{"role": "assistant", "content": ...}]``; fastrl plain strings."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def exact_match_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion, stripped, equals the row's answer; else 0.0 (TRL's reward signature)."""
    return [1.0 if _completion_text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def hash_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """``qwen2-real``: 0 or 1 from a CRC of the completion text (a random model earns no task reward; this gives
    every group a spread, so neither trainer can skip a group's update). Deterministic, TRL's signature."""
    import zlib

    return [float(zlib.crc32(_completion_text(c).encode()) & 1) for c in completions]


def reward_of(s: "BenchSettings"):
    """The reward both trainers use for ``s.shape``."""
    return hash_reward if s.shape == "qwen2-real" else exact_match_reward


def prompt_token_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The chat-templated prompt as TRL renders a one-message conversation (generation prompt on)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def greedy_accuracy(model: Any, tokenizer: Any, rows: list[dict], *, max_new_tokens: int, batch_size: int = 100) -> dict[str, Any]:
    """Held-out greedy accuracy with plain HF ``generate``: the same metric for every model.

    Prompts are bucketed by token length, so no batch is padded (no padding-side effects);
    each completion is decoded without special tokens and scored by ``exact_match_reward``.
    """
    import torch

    model.eval()
    ids = [prompt_token_ids(tokenizer, r["prompt"]) for r in rows]
    by_length: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        by_length.setdefault(len(x), []).append(i)
    completions = [""] * len(rows)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _, members in sorted(by_length.items()):
            for s in range(0, len(members), batch_size):
                chunk = members[s : s + batch_size]
                input_ids = torch.tensor([ids[i] for i in chunk], dtype=torch.long)
                out = model.generate(
                    input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                    max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                )
                texts = tokenizer.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=True)
                for i, t in zip(chunk, texts):
                    completions[i] = t
    scores = exact_match_reward([r["prompt"] for r in rows], completions, [r["answer"] for r in rows])
    return {
        "accuracy": sum(s >= 1.0 for s in scores) / max(1, len(rows)),
        "num_prompts": len(rows),
        "seconds": time.perf_counter() - t0,
        "examples": [[rows[i]["prompt"], completions[i], rows[i]["answer"]] for i in range(min(3, len(rows)))],
    }


# ---------------------------------------------------------------------------- memory helpers (Linux)
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        return True
    except OSError:
        return False


class _Memory:
    """Process peak RSS across setup and training, and the training-phase increase."""

    def start_training(self) -> None:
        import gc
        import resource

        gc.collect()
        self.setup_peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # before the reset below
        self.rss_at_start_kib = _status_kib("VmRSS")
        self.reset = _reset_peak_rss()

    def finish(self) -> dict[str, float | None]:
        import resource

        hwm = _status_kib("VmHWM") if self.reset else None
        train_peak = hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        mib = lambda k: None if k is None else k / 1024  # noqa: E731
        return {
            "peak_rss_mib": mib(max(self.setup_peak_kib, train_peak)),
            "rss_at_train_start_mib": mib(self.rss_at_start_kib),
            "train_peak_rss_mib": mib(train_peak),
            "train_peak_increase_mib": mib(train_peak - self.rss_at_start_kib) if (self.reset and self.rss_at_start_kib) else None,
        }


def _summarise_steps(step_seconds: list[float], stage_rows: list[dict[str, float]], train_wall: float) -> dict[str, Any]:
    stages = sorted({k for row in stage_rows for k in row})
    later = step_seconds[1:] if len(step_seconds) > 1 else step_seconds
    return {
        "steps": len(step_seconds),
        "step_s_median": statistics.median(step_seconds) if step_seconds else None,
        "step_s_mean": statistics.fmean(step_seconds) if step_seconds else None,
        "step_s_median_after_first": statistics.median(later) if later else None,
        "first_step_s": step_seconds[0] if step_seconds else None,
        "wall_per_step_s": train_wall / len(step_seconds) if step_seconds else None,
        "train_wall_s": train_wall,
        "stage_s_median": {s: statistics.median(row.get(s, 0.0) for row in stage_rows) for s in stages} if stage_rows else {},
        "step_seconds": step_seconds,
    }


def _cpu_summary(step_cpu: list[float]) -> dict[str, Any]:
    """Process CPU seconds per step: on a shared, oversubscribed CPU a 1-thread process's CPU time
    moves far less with the load than its wall time does."""
    return {"step_cpu_s_median": statistics.median(step_cpu) if step_cpu else None, "step_cpu_seconds": step_cpu}


def _evaluate(model: Any, tokenizer: Any, rows: list[dict], s: "BenchSettings") -> dict[str, Any]:
    """``greedy_accuracy`` on the held-out rows; none (accuracy None) when there are none (``qwen2-real``)."""
    if not rows:
        return {"accuracy": None, "num_prompts": 0, "seconds": 0.0, "examples": []}
    return greedy_accuracy(model, tokenizer, rows, max_new_tokens=s.max_new_tokens, batch_size=s.eval_batch_size)


def _load_start(start_dir: str):
    import torch
    import transformers

    own = os.path.join(start_dir, TOKENIZER_SUBDIR)  # qwen2-real: see _prepare_real
    tokenizer = transformers.AutoTokenizer.from_pretrained(own if os.path.isdir(own) else start_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(start_dir, dtype=torch.float32)
    return tokenizer, model


def _threads_one() -> None:
    import torch

    torch.set_num_threads(1)


# ---------------------------------------------------------------------------- child: fastrl
def run_fastrl(s: BenchSettings, start_dir: str, rows_path: str, *, algorithm: str, budget: float | None) -> dict[str, Any]:
    _threads_one()
    import torch

    from fastrl.train import TrainConfig, Trainer

    rows = json.loads(open(rows_path).read())
    tokenizer, model = _load_start(start_dir)
    out_dir = tempfile.mkdtemp(prefix=f"fastrl_bench_{algorithm}_")
    steps = s.steps if budget is None else 1_000_000  # budget mode: the budget ends the run (the rate is constant)
    config = TrainConfig(
        algorithm=algorithm, group_size=s.group_size, prompts_per_step=s.prompts_per_step, max_new_tokens=s.max_new_tokens,
        temperature=s.temperature, lr=s.lr, min_lr_ratio=1.0, warmup_steps=0, weight_decay=0.0, adam_betas=[0.9, 0.999],
        grad_clip=s.grad_clip, kl_coef=s.beta, kl_estimator="k3", clip_low=s.clip, clip_high=s.clip,
        steps=steps, sft_steps=0, eval_every=0, progress=False, tensorboard=False, reward_workers=0,
        output_dir=out_dir, overwrite=True, seed=s.seed, threads=1, device="cpu",
    )
    memory = _Memory()
    t_setup = time.perf_counter()
    trainer = Trainer(config, model=model, tokenizer=tokenizer, train_rows=rows["train"], eval_rows=rows["heldout"],
                      reward_functions=[reward_of(s)])
    setup_s = time.perf_counter() - t_setup
    step_seconds: list[float] = []
    stage_rows: list[dict[str, float]] = []
    rewards: list[float] = []
    step_cpu: list[float] = []
    lengths: list[float] = []
    memory.start_training()
    t0 = time.perf_counter()
    with open(os.path.join(out_dir, "bench_metrics.jsonl"), "w") as log:  # what train() would log, for debugging
        while True:
            cpu0 = time.process_time()
            metrics = trainer.train_step()
            step_cpu.append(time.process_time() - cpu0)
            log.write(json.dumps({"step": trainer.step, **metrics}) + "\n")
            step_seconds.append(metrics["time/step"])
            stage_rows.append({k[len("time/"):]: v for k, v in metrics.items() if k.startswith("time/") and k != "time/step"})
            rewards.append(metrics["reward/mean"])
            lengths.append(metrics["response/length_mean"])
            elapsed = time.perf_counter() - t0
            if (budget is None and trainer.step >= s.steps) or (budget is not None and elapsed >= budget):
                break
    train_wall = time.perf_counter() - t0
    mem = memory.finish()
    trainer.close()
    evaluation = _evaluate(trainer.policy, tokenizer, rows["heldout"], s)
    shutil.rmtree(out_dir, ignore_errors=True)
    return {
        "impl": f"fastrl-{algorithm}", "trainer": "fastrl", "algorithm": algorithm, "budget_s": budget,
        "setup_s": setup_s, **_summarise_steps(step_seconds, stage_rows, train_wall), **_cpu_summary(step_cpu), **mem,
        "train_reward_mean_first": rewards[0], "train_reward_mean_last": rewards[-1],
        "train_reward_mean_all": statistics.fmean(rewards), "train_reward_means": rewards,
        "completion_length_means": lengths,
        "heldout_accuracy": evaluation["accuracy"], "eval": evaluation,
        "loss_config": dataclasses.asdict(trainer.loss_config) if dataclasses.is_dataclass(trainer.loss_config) else str(trainer.loss_config),
        "threads": torch.get_num_threads(), "modules_loaded": _heavy_modules(),
    }


# ---------------------------------------------------------------------------- child: TRL
def _hide_vllm_from_trl() -> None:
    """Make TRL believe vLLM is not installed (as on a CPU machine without it).

    TRL imports vLLM (and with it Ray) whenever vLLM is installed, even with
    ``use_vllm=False``; that adds ~200 MiB of resident memory and a minute of import time
    that have nothing to do with training. Must run before TRL's trainer modules are imported.
    """
    import importlib

    # trl is a lazy module: reach the submodule through importlib, not as an attribute of trl
    importlib.import_module("trl.import_utils").is_vllm_available = lambda *args, **kwargs: False


def _heavy_modules() -> list[str]:
    return [m for m in ("vllm", "ray", "deepspeed", "trl", "liger_kernel") if m in sys.modules]


def run_trl(s: BenchSettings, start_dir: str, rows_path: str, *, budget: float | None, hide_vllm: bool = True) -> dict[str, Any]:
    _threads_one()
    if hide_vllm and "trl.trainer.grpo_trainer" not in sys.modules:
        _hide_vllm_from_trl()
    import trl.extras.profiling as trl_profiling

    # TRL times its stages with ProfilingContext but only reports them to wandb/mlflow/trackio:
    # keep every (name, start, duration) here instead.
    events: list[tuple[str, float, float]] = []

    def _record(self, duration: float) -> None:
        events.append((self.name.split(".", 1)[-1], self._start_time, duration))

    original_log_metrics = trl_profiling.ProfilingContext._log_metrics
    trl_profiling.ProfilingContext._log_metrics = _record
    try:
        return _run_trl(s, start_dir, rows_path, budget=budget, events=events)
    finally:  # leave TRL as it was (matters when run in-process by the smoke test)
        trl_profiling.ProfilingContext._log_metrics = original_log_metrics


def _run_trl(s: BenchSettings, start_dir: str, rows_path: str, *, budget: float | None, events: list) -> dict[str, Any]:
    import warnings

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    class StepClock(TrainerCallback):
        """Times each optimizer step and stops training when the budget is spent."""

        def __init__(self) -> None:
            self.windows: list[tuple[float, float]] = []
            self.cpu: list[float] = []
            self.cpu_step = 0.0
            self.t_train = self.t_step = 0.0
            self.t_end = None

        def on_train_begin(self, args, state, control, **kw):
            self.t_train = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            self.t_step = time.perf_counter()
            self.cpu_step = time.process_time()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.windows.append((self.t_step, now))
            self.cpu.append(time.process_time() - self.cpu_step)
            if budget is not None and now - self.t_train >= budget:
                control.should_training_stop = True
            self.t_end = now

    rows = json.loads(open(rows_path).read())
    tokenizer, model = _load_start(start_dir)
    # Chat prompts: TRL applies the tokenizer's chat template, which gives the same ids as fastrl's prompt encoding.
    if s.shape == "qwen2-real":  # plain-text prompts: no chat template, the same ids as fastrl's encoding (checked)
        dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows["train"]])
    else:
        dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows["train"]])
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_bench_"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False,  # TRL's default is True; fastrl does not recompute, so neither does TRL here
        per_device_train_batch_size=s.prompts_per_step * s.group_size, gradient_accumulation_steps=1,
        num_generations=s.group_size, max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=1.0, top_k=0,
        learning_rate=s.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=s.grad_clip, beta=s.beta, epsilon=s.clip, loss_type="grpo", scale_rewards="group",
        num_iterations=1, max_steps=s.steps if budget is None else 1_000_000, logging_steps=1, report_to="none",
        save_strategy="no", seed=s.seed, disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    clock = StepClock()
    memory = _Memory()
    t_setup = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=reward_of(s), args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[clock])
    setup_s = time.perf_counter() - t_setup
    events.clear()
    memory.start_training()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    train_wall = (clock.t_end or time.perf_counter()) - clock.t_train
    mem = memory.finish()

    # Per step: the events inside its window; log-prob passes inside _prepare_inputs are the reference's
    # (and old log-probs, which TRL skips when exactly on-policy, as here).
    step_seconds, stage_rows = [], []
    for t_begin, t_end in clock.windows:
        inside = [(n, st, d) for n, st, d in events if st >= t_begin and st + d <= t_end]
        prepare = [(st, st + d) for n, st, d in inside if n == "_prepare_inputs"]
        total = lambda name: sum(d for n, _, d in inside if n == name)  # noqa: E731
        ref = sum(d for n, st, d in inside if n == "_get_per_token_logps_and_entropies"
                  and any(a <= st and st + d <= b for a, b in prepare))
        prep = total("_prepare_inputs")
        stage_rows.append({
            "generate": total("transformers.generate"), "reward": total("_calculate_rewards"), "ref_logp": ref,
            "prepare_inputs": prep, "loss_forward": total("compute_loss"), "update": (t_end - t_begin) - prep,
        })
        step_seconds.append(t_end - t_begin)
    logged = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [float(h["reward"]) for h in logged]
    evaluation = _evaluate(trainer.model, tokenizer, rows["heldout"], s)
    shutil.rmtree(args.output_dir, ignore_errors=True)
    return {
        "impl": "trl-grpo", "trainer": "trl", "algorithm": "grpo", "budget_s": budget, "setup_s": setup_s,
        **_summarise_steps(step_seconds, stage_rows, train_wall), **_cpu_summary(clock.cpu), **mem,
        "train_reward_mean_first": rewards[0] if rewards else None, "train_reward_mean_last": rewards[-1] if rewards else None,
        "train_reward_mean_all": statistics.fmean(rewards) if rewards else None, "train_reward_means": rewards,
        "completion_length_means": [float(h["completions/mean_length"]) for h in logged if "completions/mean_length" in h],
        "trl_step_time_logged_median": statistics.median(h["step_time"] for h in logged if "step_time" in h)
        if any("step_time" in h for h in logged) else None,
        "heldout_accuracy": evaluation["accuracy"], "eval": evaluation,
        "trl_config": {k: getattr(args, k) for k in ("loss_type", "scale_rewards", "beta", "epsilon", "num_iterations",
                                                     "generation_batch_size", "steps_per_generation", "gradient_checkpointing",
                                                     "per_device_train_batch_size", "num_generations", "max_completion_length")},
        "threads": torch.get_num_threads(), "modules_loaded": _heavy_modules(),
    }


# ---------------------------------------------------------------------------- parent
def prepare(s: BenchSettings, workdir: str) -> dict[str, Any]:
    """Build the tokenizer and tiny model, warm it up once, save it; write the rows; check prompt ids agree."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _prepare(s, workdir)
    finally:
        torch.set_num_threads(threads)


def _prepare(s: BenchSettings, workdir: str) -> dict[str, Any]:
    if s.shape == "qwen2-real":
        return _prepare_real(s, workdir)
    from fastrl.train.data import encode_prompt
    from fastrl.train.sft import sft_warmup
    from fastrl.train.task import ArithmeticTask, DefaultTask, char_tokenizer, tiny_model

    default = DefaultTask()
    task = ArithmeticTask(digits=s.digits, operations=s.operations, num_train=s.num_train, num_heldout=s.num_heldout, seed=s.seed)
    train, heldout = task.train_rows(), task.heldout_rows()
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=s.hidden_size, layers=s.layers, heads=default.heads, arch=default.arch,
                       max_position_embeddings=default.max_position_embeddings, seed=s.seed)
    sft = sft_warmup(model, tokenizer, train, steps=s.sft_steps, lr=s.sft_lr, batch_size=s.sft_batch_size, seed=s.seed) if s.sft_steps else {}
    start_dir = os.path.join(workdir, "start")
    model.save_pretrained(start_dir, safe_serialization=True)
    tokenizer.save_pretrained(start_dir)
    rows_path = os.path.join(workdir, "rows.json")
    with open(rows_path, "w") as f:
        json.dump({"train": train, "heldout": heldout}, f)
    # Both trainers must see the same prompt tokens: fastrl's encoding vs TRL's chat rendering, reloaded tokenizer.
    import transformers

    reloaded = transformers.AutoTokenizer.from_pretrained(start_dir)
    mismatched = [r["prompt"] for r in train[:50] + heldout[:50]
                  if encode_prompt(reloaded, r["prompt"]) != prompt_token_ids(reloaded, r["prompt"])]
    if mismatched:
        raise SystemExit(f"fastrl and TRL would encode prompts differently, e.g. {mismatched[:3]}")
    start_eval = greedy_accuracy(model, tokenizer, heldout, max_new_tokens=s.max_new_tokens, batch_size=s.eval_batch_size)
    return {
        "start_dir": start_dir, "rows_path": rows_path, "start_heldout_accuracy": start_eval["accuracy"],
        "sft": {k: sft.get(k) for k in ("steps", "first_loss", "final_loss", "seconds")},
        "model": {"arch": default.arch, "hidden_size": s.hidden_size, "layers": s.layers, "heads": default.heads,
                  "max_position_embeddings": default.max_position_embeddings, "vocab_size": len(tokenizer),
                  "parameters": sum(p.numel() for p in model.parameters())},
        "prompt_example": {"prompt": train[0]["prompt"], "ids": prompt_token_ids(reloaded, train[0]["prompt"])},
    }


def word_tokenizer(vocab_size: int):
    """An offline word-level ``PreTrainedTokenizerFast`` of ``vocab_size`` tokens: ``<pad>``, ``<eos>``, then
    ``w2``..``w{V-1}``; whitespace-split, no special tokens added, no chat template (built in memory, no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left")


TOKENIZER_SUBDIR = "tokenizer"
"""``qwen2-real`` saves its tokenizer here, under the model directory: next to a Qwen2 ``config.json``
``AutoTokenizer`` would load it as a ``Qwen2Tokenizer`` (byte-level BPE), which splits these words differently."""


def _prepare_real(s: BenchSettings, workdir: str) -> dict[str, Any]:
    """``qwen2-real``: the seeded random Qwen2 (``fastrl.bench.rollout_cases.qwen2_bench_model``), the word
    tokenizer, ``num_train`` random prompts of ``prompt_tokens`` words; checks both trainers' prompt ids agree."""
    import random

    import transformers

    from fastrl.bench.rollout_cases import qwen2_bench_model
    from fastrl.train.data import encode_prompt

    tokenizer = word_tokenizer(s.vocab_size)
    model = qwen2_bench_model(vocab=s.vocab_size, hidden=s.hidden_size, layers=s.layers, seed=s.seed)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    rng = random.Random(s.seed)
    train = [{"prompt": " ".join(f"w{rng.randrange(2, s.vocab_size)}" for _ in range(s.prompt_tokens)), "answer": ""}
             for _ in range(s.num_train)]
    start_dir = os.path.join(workdir, "start")
    model.save_pretrained(start_dir, safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(start_dir, TOKENIZER_SUBDIR))
    rows_path = os.path.join(workdir, "rows.json")
    with open(rows_path, "w") as f:
        json.dump({"train": train, "heldout": []}, f)
    reloaded = _load_start(start_dir)[0]
    for r in train[:8]:
        ids_fastrl = encode_prompt(reloaded, r["prompt"])
        ids_trl = reloaded(r["prompt"], add_special_tokens=False)["input_ids"]
        if ids_fastrl != ids_trl or len(ids_fastrl) != s.prompt_tokens:
            raise SystemExit(f"prompt ids differ or are not {s.prompt_tokens} long: {len(ids_fastrl)} vs {len(ids_trl)}")
    return {
        "start_dir": start_dir, "rows_path": rows_path, "start_heldout_accuracy": None, "sft": {},
        "model": {"arch": "qwen2", "hidden_size": s.hidden_size, "layers": s.layers, "heads": model.config.num_attention_heads,
                  "kv_heads": model.config.num_key_value_heads, "intermediate_size": model.config.intermediate_size,
                  "tie_word_embeddings": bool(model.config.tie_word_embeddings), "vocab_size": len(reloaded),
                  "parameters": sum(p.numel() for p in model.parameters())},
        "prompt_example": {"prompt": train[0]["prompt"][:80] + " ...", "ids": encode_prompt(reloaded, train[0]["prompt"])},
    }


def _in_process(kind: str, s: BenchSettings, start_dir: str, rows_path: str, *, algorithm: str, budget: float | None) -> dict[str, Any]:
    """Run one side in this process (smoke tests only: shared imports and heap, so no figure is meaningful)."""
    import torch

    threads = torch.get_num_threads()
    try:
        if kind == "fastrl":
            result = run_fastrl(s, start_dir, rows_path, algorithm=algorithm, budget=budget)
        else:
            result = run_trl(s, start_dir, rows_path, budget=budget, hide_vllm=False)  # never patch a shared TRL
    finally:
        torch.set_num_threads(threads)
    return json.loads(json.dumps(result))  # what a child would have printed


def _spawn(kind: str, s: BenchSettings, start_dir: str, rows_path: str, *, algorithm: str = "grpo",
           budget: float | None = None, in_process: bool = False, trl_with_vllm: bool = False, log=print) -> dict[str, Any]:
    t0 = time.perf_counter()
    if in_process:
        result = _in_process(kind, s, start_dir, rows_path, algorithm=algorithm, budget=budget)
    else:
        result = _child_process(kind, s, start_dir, rows_path, algorithm=algorithm, budget=budget, trl_with_vllm=trl_with_vllm)
    result["process_wall_s"] = time.perf_counter() - t0
    log(f"  {result['impl']:12s} budget={budget}  steps={result['steps']}  median step {result['step_s_median']:.3f}s  "
        f"peak RSS {result['peak_rss_mib']:.0f} MiB  CPU/step {result['step_cpu_s_median']:.2f}s  "
        f"held-out acc {_fmt(result['heldout_accuracy'])}")
    return result


def _child_process(kind: str, s: BenchSettings, start_dir: str, rows_path: str, *, algorithm: str, budget: float | None,
                   trl_with_vllm: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--algorithm", algorithm,
           "--start-dir", start_dir, "--rows", rows_path, "--settings", json.dumps(dataclasses.asdict(s))]
    if budget is not None:
        cmd += ["--child-budget", str(budget)]
    if trl_with_vllm:
        cmd += ["--trl-with-vllm"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p))
    env.pop("TRITON_INTERPRET", None)  # no Triton kernel runs on CPU in the trainer; keep the child as a user runs it
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"{kind} ({algorithm}, budget={budget}) run failed with exit code {proc.returncode}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return min(runs, key=lambda r: r["step_s_median"])


def _environment() -> dict[str, Any]:
    import datasets
    import torch
    import transformers
    import trl

    env = {
        "device": "cpu", "platform": platform.platform(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(), "threads_per_run": 1,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "datasets": datasets.__version__},
    }
    try:
        env["load_average_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    return env


def _table(title: str, runs: list[dict[str, Any]]) -> str:
    stages = ["generate", "reward", "ref_logp", "update", "sync"]
    head = f"{'run':14s} {'steps':>5s} {'step s':>7s} {'wall/step':>9s} " + " ".join(f"{x:>9s}" for x in stages) + \
        f" {'peak MiB':>8s} {'train +MiB':>10s} {'held-out':>8s}"
    lines = [title, head]
    for r in runs:
        st = r.get("stage_s_median", {})
        inc = r.get("train_peak_increase_mib")
        lines.append(
            f"{r['impl']:14s} {r['steps']:5d} {r['step_s_median']:7.3f} {r['wall_per_step_s']:9.3f} "
            + " ".join(f"{st[x]:9.3f}" if x in st else f"{'-':>9s}" for x in stages)
            + f" {r['peak_rss_mib']:8.0f} {inc if inc is None else round(inc):>10} {_fmt(r['heldout_accuracy']):>8s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke version: tiny batch, 2 steps, 6 s budget, 20-step warm-up")
    p.add_argument("--real-shape", action="store_true",
                   help="issue 20's real shape (REAL_SHAPE: Qwen2, vocab 151,936, hidden 256, 4 layers, 2 prompts x G=8, "
                        "256 + 128 tokens); writes results/trainer_vs_trl_real_shape_cpu.json unless --out")
    for f in dataclasses.fields(BenchSettings):
        kind = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(f.default, bool) else type(f.default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None, help=f"(default {f.default})")
    p.add_argument("--no-ppo", action="store_true", help="skip the fastrl PPO run of the equal-budget comparison")
    p.add_argument("--in-process", action="store_true",
                   help="run every side in this process instead of fresh ones (smoke tests only: figures are not meaningful)")
    p.add_argument("--out", default=None, help="results JSON (default results/trainer_vs_trl_cpu.json, "
                   "results/trainer_vs_trl_real_shape_cpu.json with --real-shape)")
    p.add_argument("--trl-with-vllm", action="store_true",
                   help="let TRL import vLLM when it is installed (default: hidden from TRL, as on a CPU machine without it; "
                        "TRL imports vLLM and Ray even with use_vllm=False)")
    p.add_argument("--child", choices=("fastrl", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--algorithm", default="grpo", help=argparse.SUPPRESS)
    p.add_argument("--start-dir", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--child-budget", type=float, default=None, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)

    if opts.child:
        s = BenchSettings(**json.loads(opts.settings))
        if opts.child == "fastrl":
            result = run_fastrl(s, opts.start_dir, opts.rows, algorithm=opts.algorithm, budget=opts.child_budget)
        else:
            result = run_trl(s, opts.start_dir, opts.rows, budget=opts.child_budget, hide_vllm=not opts.trl_with_vllm)
        result["load_average_at_end"] = list(os.getloadavg())  # the shared CPU's load over this run (1, 5, 15 min)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return None

    s = BenchSettings(**REAL_SHAPE) if opts.real_shape else BenchSettings()
    if opts.out is None:
        opts.out = os.path.join(HERE, "results", "trainer_vs_trl_real_shape_cpu.json" if opts.real_shape else "trainer_vs_trl_cpu.json")
    if opts.quick and opts.real_shape:  # the real model and vocabulary, short sequences, one step
        s = dataclasses.replace(s, num_train=8, prompt_tokens=16, max_new_tokens=8, steps=1, repeats=1)
    elif opts.quick:
        s = dataclasses.replace(s, num_train=200, num_heldout=20, sft_steps=20, group_size=4, prompts_per_step=4,
                                steps=2, repeats=1, budget_seconds=6.0)
    for f in dataclasses.fields(BenchSettings):
        value = getattr(opts, f.name)
        if value is not None:
            setattr(s, f.name, value)

    t_all = time.perf_counter()
    load_at_start = list(os.getloadavg())
    workdir = tempfile.mkdtemp(prefix="fastrl_bench_trainer_vs_trl_")
    print(f"preparing the shared start model (SFT warm-up, {s.sft_steps} steps) in {workdir}")
    setup = prepare(s, workdir)
    print(f"  start model held-out greedy accuracy {_fmt(setup['start_heldout_accuracy'])}")

    print(f"fixed steps: {s.steps} steps x {s.repeats} repeat(s), interleaved, fresh processes")
    how = dict(in_process=opts.in_process, trl_with_vllm=opts.trl_with_vllm)
    fixed: dict[str, list[dict[str, Any]]] = {"trl-grpo": [], "fastrl-grpo": []}
    for repeat in range(s.repeats):  # A B, B A, ...: neither side always runs first
        for kind in (("fastrl", "trl") if repeat % 2 else ("trl", "fastrl")) if not s.fastrl_first else \
                (("trl", "fastrl") if repeat % 2 else ("fastrl", "trl")):
            if kind == "trl":
                fixed["trl-grpo"].append(_spawn("trl", s, setup["start_dir"], setup["rows_path"], **how))
            else:
                fixed["fastrl-grpo"].append(_spawn("fastrl", s, setup["start_dir"], setup["rows_path"], algorithm="grpo", **how))
            with open(opts.out + ".partial", "w") as f:  # every finished run so far (slow shapes; removed at the end)
                json.dump({"settings": dataclasses.asdict(s), "fixed_steps_runs": fixed}, f, indent=1)
    best = {k: _best(v) for k, v in fixed.items()}
    f_best, t_best = best["fastrl-grpo"], best["trl-grpo"]
    fixed_summary = {
        "step_time_fastrl_over_trl": f_best["step_s_median"] / t_best["step_s_median"],
        "wall_per_step_fastrl_over_trl": f_best["wall_per_step_s"] / t_best["wall_per_step_s"],
        "step_cpu_time_fastrl_over_trl": min(r["step_cpu_s_median"] for r in fixed["fastrl-grpo"])
        / min(r["step_cpu_s_median"] for r in fixed["trl-grpo"]),
        "peak_rss_fastrl_over_trl": f_best["peak_rss_mib"] / t_best["peak_rss_mib"],
        "train_peak_increase_fastrl_over_trl": (f_best["train_peak_increase_mib"] / t_best["train_peak_increase_mib"])
        if f_best.get("train_peak_increase_mib") and t_best.get("train_peak_increase_mib") else None,
    }
    fixed_summary["target_step_time_at_most_half"] = fixed_summary["step_time_fastrl_over_trl"] <= 0.5
    fixed_summary["target_lower_peak_memory"] = fixed_summary["peak_rss_fastrl_over_trl"] < 1.0
    fixed_summary["stage_s_fastrl_over_trl"] = {
        k: f_best["stage_s_median"][k] / t_best["stage_s_median"][k]
        for k in ("generate", "ref_logp", "update") if t_best["stage_s_median"].get(k) and k in f_best["stage_s_median"]
    }
    if s.shape == "qwen2-real":  # issue 20's targets
        fixed_summary["target_cpu_time_at_most_0.35"] = fixed_summary["step_cpu_time_fastrl_over_trl"] <= 0.35
        fixed_summary["target_peak_memory_at_most_0.3"] = fixed_summary["peak_rss_fastrl_over_trl"] <= 0.3

    budget_runs: dict[str, dict[str, Any]] = {}
    if s.budget_seconds > 0:
        print(f"equal wall-clock budget: {s.budget_seconds:g} s of training each")
        budget_runs["fastrl-grpo"] = _spawn("fastrl", s, setup["start_dir"], setup["rows_path"], algorithm="grpo", budget=s.budget_seconds, **how)
        budget_runs["trl-grpo"] = _spawn("trl", s, setup["start_dir"], setup["rows_path"], budget=s.budget_seconds, **how)
        if not opts.no_ppo:
            budget_runs["fastrl-ppo"] = _spawn("fastrl", s, setup["start_dir"], setup["rows_path"], algorithm="ppo", budget=s.budget_seconds, **how)
    budget_summary: dict[str, Any] = {}
    if budget_runs:
        budget_summary = {k: {"steps": r["steps"], "heldout_accuracy": r["heldout_accuracy"], "train_wall_s": r["train_wall_s"]}
                          for k, r in budget_runs.items()}
        budget_summary["target_fastrl_at_least_trl_success"] = (
            budget_runs["fastrl-grpo"]["heldout_accuracy"] >= budget_runs["trl-grpo"]["heldout_accuracy"]
        )

    record = {
        "benchmark": "fastrl Trainer vs TRL GRPOTrainer: same tiny model, task, reward, group size, lengths, optimizer, steps",
        "command": "python " + " ".join([os.path.relpath(os.path.abspath(__file__), ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "environment": {**_environment(), "load_average_at_start": load_at_start},
        "in_process": opts.in_process,
        "trl_vllm_hidden": not opts.trl_with_vllm,
        "note": "shared, loaded 2-core CPU; every run is a fresh process on 1 thread (OMP_NUM_THREADS=1, "
                "torch.set_num_threads(1)); fixed-step figures are best-of-n by median step time",
        "settings": dataclasses.asdict(s),
        "shapes": {"completions_per_step": s.group_size * s.prompts_per_step, "group_size": s.group_size,
                   "prompts_per_step": s.prompts_per_step, "max_new_tokens": s.max_new_tokens,
                   "prompt_tokens_example": len(setup["prompt_example"]["ids"]), **setup["model"]},
        "setup": {k: v for k, v in setup.items() if k not in ("start_dir", "rows_path")},
        "fixed_steps": {"best": best, "runs": fixed, "summary": fixed_summary},
        "equal_budget": {"budget_seconds": s.budget_seconds, "runs": budget_runs, "summary": budget_summary},
        "total_seconds": time.perf_counter() - t_all,
        "load_average_at_end": list(os.getloadavg()),
    }
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(record, f, indent=1)
    if os.path.exists(opts.out + ".partial"):
        os.remove(opts.out + ".partial")

    print()
    print(_table(f"fixed {s.steps} steps (best of {s.repeats}, medians per step, seconds)", list(best.values())))
    print(json.dumps(fixed_summary))
    if budget_runs:
        print()
        print(_table(f"equal budget {s.budget_seconds:g} s", list(budget_runs.values())))
        print(f"start model held-out accuracy {setup['start_heldout_accuracy']:.3f}; " + json.dumps(budget_summary))
    print(f"wrote {opts.out}")
    return record


if __name__ == "__main__":
    main()
