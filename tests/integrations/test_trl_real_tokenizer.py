"""The TRL drop-in (``fastrl.integrations.trl.GRPOTrainer``, the README's example) on the real
byte-level BPE (``tests/real_bpe.py``): a tiny random Qwen2 with the real vocabulary size,
conversational prompts through the Qwen2.5-style chat template, one step; nothing falls back
to TRL's own loss."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install 'trl>=1.16,<1.17')")
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/real_bpe.py

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

import real_bpe  # noqa: E402
from fastrl.integrations.trl import GRPOTrainer  # noqa: E402


def digits(completions, **kwargs):
    """TRL's reward signature on conversational completions: the share of digits written."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(1, len(t)) for t in texts]


def test_the_trl_drop_in_trains_on_the_real_bpe(tmp_path):
    model_dir = real_bpe.save_model_dir(tmp_path / "policy", "qwen2.5")
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{a}+{b}= 東京 🎉"}] for a in range(4) for b in range(2)]})
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, max_steps=1, learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none",
                      save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                      model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=digits, args=args, train_dataset=dataset)
    assert trainer.processing_class.chat_template == real_bpe.QWEN25
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert logs and math.isfinite(logs[0]["loss"]) and "reward" in logs[0]
    assert trainer.fastrl_fallback_reason is None
