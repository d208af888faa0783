"""The shared start of a comparison, built once in the comparing process: the training and
held-out rows as jsonl and, with a warm-up or the built-in model, the model every run starts from."""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

from fastrl.commands.compare.defaults import HYBRID, CompareError
from fastrl.commands.compare.options import ComparePlan
from fastrl.commands.compare.processes import self_cpu_seconds
from fastrl.train.config import AGENT_FIELDS, TrainConfig


def _jsonable_row(row: dict[str, Any]) -> dict[str, Any]:
    def conv(v):
        if hasattr(v, "tolist"):
            return v.tolist()
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v

    return {k: conv(v) for k, v in row.items()}


def prepare_start(plan: ComparePlan) -> dict[str, Any]:
    """Build the starting point every run shares, in this process: the training and held-out
    rows as jsonl and, with a warm-up or the built-in model, the starting model directory.

    Returns the ``TrainConfig`` fields each run gets for it (``model``, ``tokenizer``,
    ``dataset``, ``eval_dataset``, no warm-up) and a description for the report."""
    from fastrl.train.trainer import Trainer

    start = plan.output_dir / "start"
    warmup_seed = plan.warmup_seed
    first = plan.algorithms[0] if plan.algorithms[0] != HYBRID else "grpo"  # a configuration already checked
    fields = {**plan.user_fields, "algorithm": first, "seed": warmup_seed, "output_dir": str(start / "trainer"),
              "steps": 1, "progress": False, "tensorboard": False, "overwrite": True}
    t0, cpu0 = time.perf_counter(), self_cpu_seconds()
    with Trainer(TrainConfig(**fields)) as trainer:
        model_dir = None
        if trainer.builtin or trainer.warmup.metrics:
            model_dir = start / "model"
            trainer.policy.save_pretrained(model_dir, safe_serialization=True)
            trainer.tokenizer.save_pretrained(model_dir)
        for name, rows in (("train.jsonl", trainer.train_rows), ("eval.jsonl", trainer.eval_rows)):
            with open(start / name, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(_jsonable_row(row)) + "\n")
        info = {"seconds": time.perf_counter() - t0, "cpu_seconds": self_cpu_seconds() - cpu0,
                "warmup_seed": warmup_seed, "sft": dict(trainer.warmup.metrics),
                "model": str(model_dir) if model_dir else plan.base.model, "train_rows": len(trainer.train_rows),
                "eval_rows": len(trainer.eval_rows)}
    if not info["eval_rows"]:
        raise CompareError("the configuration has no held-out rows: success is measured on them (give --eval_dataset)")
    shutil.rmtree(start / "trainer", ignore_errors=True)
    run_fields: dict[str, Any] = {"dataset": str(start / "train.jsonl"), "eval_dataset": str(start / "eval.jsonl"),
                                  "sft_steps": 0, "sft_target_accuracy": None}
    if model_dir is not None:
        run_fields.update(model=str(model_dir), tokenizer=str(model_dir))
    # defaults that depend on the built-in model/task (or environment), spelled out now that runs name a model
    spelled = ("max_new_tokens", "lr", "eval_prompts")
    if plan.base.env is not None:
        # an environment's defaults for the built-in model: its tool-call format and its trajectory limits
        spelled += ("env_call_format", *AGENT_FIELDS)
    for name in spelled:
        run_fields[name] = getattr(plan.base, name)
    (start / "start.json").write_text(json.dumps(info, indent=1))
    return {"fields": run_fields, "info": info}
