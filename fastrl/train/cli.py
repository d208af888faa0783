"""``fastrl train``: the command line generated from ``TrainConfig``.

Every field of ``TrainConfig`` is an option (``--lr 1e-4``, ``--algorithm ppo``); a YAML file
given with ``--config run.yaml`` sets any of them, and later options override it. Unknown
names are an error, before any model is loaded. ``--print_config`` shows the resolved
configuration and exits.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from fastrl.train.config import ALGORITHM_PRESETS, TrainConfig

DESCRIPTION = """Train a causal LM with GRPO-family algorithms or PPO.

With no options: the embedded default, offline on a CPU in a few minutes -- a tiny model
built from a config, the built-in arithmetic task and tokenizer, a short supervised
warm-up, then GRPO; held-out accuracy before and after is printed.
With --model and --dataset: any Hugging Face causal LM and a jsonl/parquet/hub dataset.
Algorithms: """ + ", ".join(f"{k} ({v.citation})" for k, v in ALGORITHM_PRESETS.items())


def build_train_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    # field docstrings become the --help text of each option
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog="fastrl train", description=DESCRIPTION, exit_on_error=True)
    parser.add_argument("--config", action=ActionConfigFile, help="A YAML file of options (any field below).")
    parser.add_class_arguments(TrainConfig, None, as_group=False)
    return parser


def expand_sampler_url(argv: list[str]) -> list[str]:
    """``--sampler vllm-server URL`` (the server's address right after the sampler's name)
    as ``--sampler vllm-server --sampler_url URL``."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        out.append(a)
        if a in ("--sampler", "--sampler=vllm-server"):
            name_given = a == "--sampler=vllm-server"
            if not name_given and i + 1 < len(argv):
                out.append(argv[i + 1])
                name_given = argv[i + 1] == "vllm-server"
                i += 1
            if name_given and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                out += ["--sampler_url", argv[i + 1]]
                i += 1
        i += 1
    return out


def parse_train_args(argv: list[str]) -> TrainConfig:
    parser = build_train_parser()
    ns = parser.parse_args(expand_sampler_url(argv))
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**values)
    try:
        return config.resolved()
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: error() exits


def run_train(argv: list[str]) -> int:
    config = parse_train_args(argv)
    from fastrl.rollout.remote import ServerError, ServerTimeout, ServerUnavailable
    from fastrl.train.trainer import Trainer, TrainingDivergedError, WeightSyncError

    try:
        with Trainer(config) as trainer:
            result = trainer.train()
    except (TrainingDivergedError, WeightSyncError) as e:
        print(f"fastrl train: stopped: {e}", file=sys.stderr)
        return 3
    except (ServerError, ServerTimeout, ServerUnavailable) as e:
        # the shared vLLM server failed, stopped or restarted: the run's checkpoints are intact
        print(f"fastrl train: stopped: {e}\nStart the server again and continue the run with --resume latest "
              f"(from the last checkpoint in {config.output_dir}).", file=sys.stderr)
        return 4
    if os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 reports
        return 0
    first, last = result.first_eval, result.last_eval
    print(f"fastrl train: {result.steps} steps, outputs in {result.output_dir}")
    if first and last:
        keys = [k for k in last if k.startswith("eval/")]
        for k in keys:
            print(f"  {k:<24} {first.get(k, float('nan')):.3f} -> {last[k]:.3f}")
    print(f"  final model: {result.final_model_dir} (load with from_pretrained)")
    return 0
