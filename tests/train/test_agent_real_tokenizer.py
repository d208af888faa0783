"""``fastrl train`` on the real byte-level BPE (Qwen's ranks, ``tests/real_bpe.py``) and a tiny
random Qwen2 with the real vocabulary size: a single-turn run from a model directory, an env
run whose sampled turns end on either of the model's end tokens (``stop_logit``), checked
against the Qwen2.5-style template and resumed exactly, and the same as a branching (tree)
rollout. The policy's turns are random byte-level tokens: U+FFFD halves of characters,
control tokens, tokenisations BPE would not choose -- all kept as sampled."""

import json

import torch

from fastrl.agents import metric_names as names
from fastrl.cli import main
from fastrl.train import TrainConfig
from fastrl.train.trainer import Trainer
import real_bpe

STOP_LOGIT = 10.0
"""About one sampled token in four ends the turn (``real_bpe.tiny_model``)."""
ENV_RUN = dict(steps=2, prompts_per_step=2, group_size=2, task_train_size=8, task_eval_size=2, env_workers=1,
               reward_workers=0, max_turns=3, max_turn_tokens=6, max_trajectory_tokens=160, sft_steps=0, eval_every=0,
               progress=False, tensorboard=False, seed=0, threads=1, env="agent_user_envs:EchoEnv", kl_coef=0.0)


def read_steps(run_dir):
    return [m for m in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in m]


def env_run(tmp_path, name, stop_after=None, **changes):
    cfg = TrainConfig(**{**ENV_RUN, "output_dir": str(tmp_path / name), **changes})
    model = real_bpe.tiny_model("qwen2.5", stop_logit=STOP_LOGIT)
    with Trainer(cfg, model=model, tokenizer=real_bpe.real_tokenizer("qwen2.5")) as trainer:
        trainer.train(stop_after=stop_after)
        return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def check_run(steps):
    for step in steps:
        # random turns end on <|im_end|> or <|endoftext|>, are checked, and never mismatch the prefix-preserving template
        assert step[names.TOKENIZATION_CHECKED_TURNS] > 0 and step[names.TOKENIZATION_MISMATCH_RATE] == 0.0
        assert step[names.SAMPLES_PER_TRAJECTORY] == 1.0 and step[names.TURNS_MEAN] > 1
        assert step["rollout/logp_gap_max"] < 1e-3 and torch.isfinite(torch.tensor(step["loss/total"]))


def test_an_env_run_on_the_real_bpe_is_checked_and_resumes_exactly(tmp_path):
    straight = env_run(tmp_path, "a")
    env_run(tmp_path, "b", stop_after=1)
    resumed = env_run(tmp_path, "b", resume="latest")
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    steps_a, steps_b = read_steps(tmp_path / "a"), read_steps(tmp_path / "b")
    assert [m["step"] for m in steps_b] == [1, 2]
    check_run(steps_a)
    for key in ("loss/total", "reward/mean", names.TOKENIZATION_CHECKED_TURNS, names.TRAJECTORY_TOKENS_MEAN):
        assert steps_a[-1][key] == steps_b[-1][key], key
    samples = (tmp_path / "a" / "samples.txt").read_text()
    assert "[prompt] <|im_start|>system\n" in samples and "<|im_start|>user\nOnce more.<|im_end|>" in samples


def test_a_branching_env_run_on_the_real_bpe(tmp_path):
    env_run(tmp_path, "tree", steps=1, rollout="tree", group_size=4, tree_turns=[0, 1], tree_branches=[2, 2])
    (step,) = read_steps(tmp_path / "tree")
    check_run([step])
    assert step[names.FORKS_REPLAYED] > 0 and step["rollout/samples"] == 8


def test_fastrl_train_single_turn_from_a_real_bpe_model_directory(tmp_path):
    model_dir = real_bpe.save_model_dir(tmp_path / "model", "qwen2.5")
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}= 東京 🎉"}], "answer": str(a + b)} for a in range(4) for b in range(2)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = tmp_path / "run"
    assert main(["train", "--model", model_dir, "--dataset", str(tmp_path / "train.jsonl"), "--output_dir", str(out),
                 "--steps", "1", "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4", "--eval_every", "0",
                 "--reward_workers", "0", "--progress", "false", "--tensorboard", "false", "--threads", "1",
                 "--rewards", "[exact_match]"]) == 0
    (step,) = read_steps(out)
    assert step["rollout/samples"] == 4 and torch.isfinite(torch.tensor(step["loss/total"]))
    assert (out / "final" / "tokenizer.json").exists()
