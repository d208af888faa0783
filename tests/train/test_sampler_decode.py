"""``fastrl train --sampler_decode``: the hf sampler's decode step chosen from the command
line (``HFGroupSampler(decode=)``): a static-shape run trains as the default one, and the
modes a run cannot use are refused."""

from __future__ import annotations

import json

import pytest
import torch

from fastrl.errors import InputError
from fastrl.train.cli import parse_train_args
from fastrl.train.config import TrainConfig
from fastrl.train.trainer import Trainer

TINY = ["--steps", "2", "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "4", "--task_digits", "1",
        "--task_train_size", "60", "--task_eval_size", "8", "--model_hidden_size", "32", "--model_layers", "1",
        "--sft_steps", "0", "--eval_every", "2", "--reward_workers", "0", "--progress", "false", "--tensorboard", "false",
        "--seed", "0", "--lr", "1e-2", "--threads", "1"]


def run(out, extra: list[str]) -> tuple[str, list[dict]]:
    with Trainer(parse_train_args([*TINY, "--output_dir", str(out), *extra])) as trainer:
        decode = trainer.sampler.decode
        trainer.train()
    return decode, [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_static_decode_trains_as_the_default(tmp_path):
    default_decode, default = run(tmp_path / "eager", [])
    static_decode, static = run(tmp_path / "static", ["--sampler_decode", "static"])
    assert (default_decode, static_decode) == ("eager", "static")
    d = [m for m in default if "event" not in m]
    s = [m for m in static if "event" not in m]
    assert len(d) == len(s) == 2
    for key in ("reward/mean", "response/length_mean", "loss/total", "grad_norm"):
        assert [m[key] for m in s] == pytest.approx([m[key] for m in d], rel=1e-5, abs=1e-7), key
    # the held-out evaluation runs on the same sampler: the same greedy answers
    evals = [[m["eval/accuracy"] for m in run_ if "eval/accuracy" in m] for run_ in (default, static)]
    assert len(evals[0]) == 2 and evals[0] == evals[1]


def test_cuda_graph_without_a_cuda_device_is_one_input_error(tmp_path):
    for device in ("cpu",) if torch.cuda.is_available() else ("cpu", "auto"):
        with pytest.raises(InputError, match="sampler_decode=cuda_graph needs a CUDA device") as error:
            TrainConfig(output_dir=str(tmp_path), sampler_decode="cuda_graph", device=device).resolved()
        assert "\n" not in str(error.value)


def test_sampler_decode_is_the_hf_samplers(tmp_path):
    with pytest.raises(InputError, match="sampler_decode=static is the hf sampler's decode step: it needs sampler=hf"):
        TrainConfig(output_dir=str(tmp_path), sampler_decode="static", sampler="vllm").resolved()
    with pytest.raises(SystemExit):  # not a mode: the parser's choices (DECODE_MODES)
        parse_train_args(["--output_dir", str(tmp_path), "--sampler_decode", "graph"])
