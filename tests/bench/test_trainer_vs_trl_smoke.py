"""Smoke test of benchmarks/bench_trainer_vs_trl.py: both trainers, both modes, tiny settings.

The sides run in this process (``--in-process``) so the test shares the suite's imports of
torch/transformers/TRL instead of paying three fresh interpreters; the figures are not
looked at (no timing is asserted), only that every run happened and the JSON has the
fields the report is built from.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is not installed (the trl extra); CI installs it")
pytest.importorskip("datasets", reason="the datasets package is not installed")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_trainer_vs_trl.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_trainer_vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_reward_has_trl_signature_and_reads_chat_completions():
    bench = _load_bench()
    prompts = ["1+2=", "3+4=", "5+5="]
    plain = bench.exact_match_reward(prompts, [" 3", "8", "10\n"], answer=["3", "7", "10"], completion_ids=None)
    chat = bench.exact_match_reward(prompts, [[{"role": "assistant", "content": c}] for c in ["3", "8", "10"]],
                                    answer=["3", "7", "10"], trainer_state=None)
    assert plain == chat == [1.0, 0.0, 1.0]


def test_quick_mode_writes_every_field(tmp_path):
    import torch

    bench = _load_bench()
    threads = torch.get_num_threads()
    out = tmp_path / "r.json"
    record = bench.main([
        "--quick", "--in-process", "--out", str(out), "--num-train", "48", "--num-heldout", "6", "--sft-steps", "2",
        "--group-size", "2", "--prompts-per-step", "2", "--steps", "1", "--budget-seconds", "0.2",
    ])
    assert torch.get_num_threads() == threads  # the in-process runs leave the thread count as it was
    payload = json.loads(out.read_text())
    assert payload == json.loads(json.dumps(record))
    assert payload["environment"]["device"] == "cpu"
    assert {"torch", "transformers", "trl", "datasets"} <= set(payload["environment"]["versions"])
    assert payload["settings"]["group_size"] == 2 and payload["shapes"]["completions_per_step"] == 4
    assert 0.0 <= payload["setup"]["start_heldout_accuracy"] <= 1.0

    best = payload["fixed_steps"]["best"]
    assert set(best) == {"trl-grpo", "fastrl-grpo"}
    for name, run in best.items():
        assert run["steps"] == 1, name
        for key in ("step_s_median", "wall_per_step_s", "peak_rss_mib", "heldout_accuracy"):
            assert math.isfinite(run[key]), (name, key)
        assert {"generate", "reward", "ref_logp", "update"} <= set(run["stage_s_median"]), name
        assert run["eval"]["num_prompts"] == 6
    assert best["fastrl-grpo"]["stage_s_median"]["sync"] >= 0.0
    assert best["trl-grpo"]["trl_config"]["loss_type"] == "grpo"
    summary = payload["fixed_steps"]["summary"]
    for key in ("step_time_fastrl_over_trl", "peak_rss_fastrl_over_trl", "target_step_time_at_most_half", "target_lower_peak_memory"):
        assert key in summary

    budget = payload["equal_budget"]
    assert set(budget["runs"]) == {"fastrl-grpo", "trl-grpo", "fastrl-ppo"}
    for name, run in budget["runs"].items():
        assert run["steps"] >= 1 and run["train_wall_s"] >= 0.2, name  # stops only once the budget is spent
        assert 0.0 <= run["heldout_accuracy"] <= 1.0
    assert budget["runs"]["fastrl-ppo"]["algorithm"] == "ppo"
    assert "target_fastrl_at_least_trl_success" in budget["summary"]


def test_real_shape_mode_builds_its_model_tokenizer_and_prompts_offline(tmp_path):
    """--real-shape (issue 20's shape) at a tiny vocabulary and width: the word tokenizer gives both trainers
    the same prompt ids of exactly --prompt-tokens tokens, the hash reward has TRL's signature, both sides run."""
    bench = _load_bench()
    assert bench.hash_reward(["p"] * 2, ["w5 w7", [{"role": "assistant", "content": "w5 w7"}]]) == [bench.hash_reward(["p"], ["w5 w7"])[0]] * 2
    out = tmp_path / "real.json"
    record = bench.main(["--real-shape", "--quick", "--in-process", "--out", str(out), "--vocab-size", "600",
                         "--hidden-size", "32", "--layers", "1", "--prompt-tokens", "12", "--group-size", "2"])
    payload = json.loads(out.read_text())
    assert payload == json.loads(json.dumps(record)) and not (tmp_path / "real.json.partial").exists()
    assert payload["settings"]["shape"] == "qwen2-real" and payload["shapes"]["vocab_size"] == 600
    assert payload["shapes"]["arch"] == "qwen2" and len(payload["setup"]["prompt_example"]["ids"]) == 12
    summary = payload["fixed_steps"]["summary"]
    assert {"target_cpu_time_at_most_0.35", "target_peak_memory_at_most_0.3", "stage_s_fastrl_over_trl"} <= set(summary)
    for run in payload["fixed_steps"]["best"].values():
        assert run["steps"] == 1 and run["heldout_accuracy"] is None and run["completion_length_means"]
