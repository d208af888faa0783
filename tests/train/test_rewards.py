"""The reward stage: built-in rewards on hand cases, spec resolution, and the worker pool with
real processes (hangs, exceptions, bad outputs, dying workers, Ctrl-C, shutdown)."""

from __future__ import annotations

import faulthandler
import math
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

from fastrl import workers
from fastrl.train.rewards import functions as rewards_module
from fastrl.train.rewards import (
    BUILTIN_REWARDS,
    RewardPool,
    exact_match_reward,
    extract_final_answer,
    format_reward,
    math_answers_equal,
    math_reward,
    resolve_reward,
)

# A hung reward sleeps for an hour: a test that finishes at all did not wait for it, so no
# test asserts on elapsed time. HANG_LIMIT_S bounds calls in which every task hangs (any value
# works); OK_LIMIT_S bounds calls in which some tasks must finish, a thousand times what
# their work takes, so a loaded machine cannot turn them into timeouts.
HOUR_S = 3600
HANG_LIMIT_S = 0.3
OK_LIMIT_S = 5.0


def _process_gone(pid: int) -> bool:
    """True once ``pid`` is neither running nor a zombie (reaped)."""
    return not os.path.exists(f"/proc/{pid}") if os.path.isdir("/proc") else True


# ----------------------------------------------------------------- reward functions used below
def length_reward(prompts, completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def sleeps_on_hang(prompts, completions, **kwargs):
    if any("hang" in completion for completion in completions):
        time.sleep(HOUR_S)
    return [1.0] * len(completions)


def raises_on_boom(prompts, completions, **kwargs):
    if any("boom" in completion for completion in completions):
        raise RuntimeError("reward exploded")
    return [1.0] * len(completions)


def dies_on_die(prompts, completions, **kwargs):
    if "exit" in completions:
        os._exit(3)
    if "segv" in completions:
        faulthandler.disable()  # pytest's crash report would go to the terminal, not to capfd
        os.kill(os.getpid(), signal.SIGSEGV)
    return [1.0] * len(completions)


# ----------------------------------------------------------------- answer extraction and built-ins
@pytest.mark.parametrize(
    "text, fallback, expected",
    [
        ("so \\boxed{\\frac{1}{\\sqrt{2}}} is it", "text", "\\frac{1}{\\sqrt{2}}"),  # nested braces
        ("\\boxed{1} then \\boxed{ 2 }", "text", "2"),  # the last box
        ("\\fbox{7}", "text", "7"),
        ("\\boxed{3} and a truncated \\boxed{4", "text", "3"),  # an unbalanced box is skipped
        ("steps\n#### -1,234\ntrailing", "text", "-1,234"),
        ("<answer> 12 </answer> <answer>13</answer>", "text", "13"),
        ("  just 42  ", "text", "just 42"),
        ("x = 3, y = -4.5", "last_number", "-4.5"),
        ("ratio 3/4", "last_number", "3/4"),
        ("it is 42, so 1,000 then 7, done", "last_number", "7"),  # list commas are not thousands separators
        ("no digits", "last_number", None),
        ("no marker 5", "none", None),
    ],
)
def test_extract_final_answer(text, fallback, expected):
    assert extract_final_answer(text, fallback=fallback) == expected


def test_degenerate_completions_are_read_in_linear_time():
    # Thousands of unclosed boxes/tags (a collapsing policy) must not make extraction quadratic
    # (in-process mode has no time limit to save it).
    junk = "\\boxed{" * 30_000 + "<answer>" * 30_000 + "\\boxed{7}" + "{" * 30_000
    assert extract_final_answer(junk) == "7"
    assert format_reward([""], [junk]) == [1.0]
    assert format_reward([""], ["\\boxed{" * 30_000 + "<ANSWER>" * 30_000]) == [0.0]
    assert math_reward([""], [junk], answer=["7"]) == [1.0]


def test_exact_match_reward_hand_cases():
    completions = ["#### 72", "The sum is \\boxed{72.0}", "72", "73", "<answer>Paris.</answer>", "#### 1,000", "x"]
    answers = ["Janet has ... so 72 in total.\n#### 72", "72", " 72 ", "72", "paris", "1000", None]
    got = exact_match_reward([""] * len(completions), completions, answer=answers)
    assert got == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, None]
    with pytest.raises(ValueError, match="'answer' dataset column"):
        exact_match_reward(["p"], ["1"])


MATH_CASES = [
    # (completion, reference, expected with math-verify, expected with the fallback)
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),  # nested braces in the box, fraction vs decimal
    ("\\boxed{-3}", "Solution ... #### -3", 1.0, 1.0),  # negative, GSM8K reference
    ("#### 1,000", "1000", 1.0, 1.0),
    ("\\boxed{\\dfrac{-3}{4}}", "-0.75", 1.0, 1.0),
    ("first 12, finally 13", "13", 1.0, 1.0),  # no marker: the last number (fallback) / math-verify's pick
    ("\\boxed{\\frac12}", "0.5", 1.0, 0.0),  # brace-less \frac: only math-verify reads it
    ("\\boxed{x^2}", "x^{2}", 1.0, 0.0),  # symbolic: only math-verify
    ("\\boxed{4}", "5", 0.0, 0.0),
    ("no answer at all", "5", 0.0, 0.0),
]


def test_math_reward_with_math_verify():
    pytest.importorskip("math_verify", reason="math-verify is an optional extra")
    completions, references = [case[0] for case in MATH_CASES], [case[1] for case in MATH_CASES]
    got = math_reward([""] * len(completions), completions, answer=references)
    assert got == [case[2] for case in MATH_CASES]
    assert math_reward(["p"], ["\\boxed{1}"], answer=[None]) == [None]


def test_math_reward_without_math_verify(monkeypatch):
    # Simulate a machine without the package: importing it fails, and the cached check is reset.
    monkeypatch.setitem(sys.modules, "math_verify", None)
    monkeypatch.setattr(rewards_module, "_math_verify_checked", False)
    monkeypatch.setattr(rewards_module, "_math_verify_module", None)
    completions, references = [case[0] for case in MATH_CASES], [case[1] for case in MATH_CASES]
    got = math_reward([""] * len(completions), completions, answer=references)
    assert got == [case[3] for case in MATH_CASES]
    with pytest.raises(ImportError, match="math-verify"):
        math_answers_equal("1", "1", use_math_verify=True)


def test_math_answers_equal_fallback_is_exact_on_rationals():
    assert math_answers_equal("\\frac{2}{4}", "0.5", use_math_verify=False)
    assert math_answers_equal("-7", "-7.00", use_math_verify=False)
    assert not math_answers_equal("-7", "7", use_math_verify=False)
    assert not math_answers_equal("0.333", "1/3", use_math_verify=False)


def test_format_rewards():
    completions = ["\\boxed{3}", "#### 4", "<answer>5</answer>", "just 6", "####", "\\boxed{}", "\\boxed{8"]
    assert format_reward([""] * 7, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    name, think = resolve_reward("format=^<think>.*</think>\\s*\\S")
    assert name == "format"
    assert think([""] * 3, ["<think>a\nb</think> 7", "7 <think></think> 8", "<think>a</think>"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="invalid regular expression"):
        resolve_reward("format=([")


# ----------------------------------------------------------------- resolving specs
def test_resolve_reward_specs(tmp_path, monkeypatch):
    assert resolve_reward("exact_match") == ("exact_match", exact_match_reward)
    assert resolve_reward("fastrl.train.rewards:math_reward") == ("math_reward", math_reward)
    assert resolve_reward(lambda prompts, completions, **kwargs: [])[0] == "lambda"
    path = tmp_path / "my_rewards.py"
    path.write_text("def shout(prompts, completions, **kwargs):\n    return [float(c.isupper()) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    name, shout = resolve_reward("my_rewards.py:shout")
    assert name == "shout" and shout([""] * 2, ["AB", "ab"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="exact_match, math, format"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_reward("missing.py:shout")
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_reward("my_rewards.py:whisper")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="unknown reward"):
        RewardPool(["nope"], num_workers=0)


# ----------------------------------------------------------------- the pool
def test_trl_style_kwargs_columns_and_logging():
    seen = {}

    def inspects_kwargs(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra, **kwargs):
        seen.update(kwargs)  # runs in a worker: only the return value and the logs come back
        if "prompt" in kwargs:  # TRL drops the prompt column (the prompts come as `prompts`)
            raise KeyError("the prompt column was passed twice")
        log_metric("mean_len", sum(map(len, completions)) / len(completions))
        log_extra("echo", [f"{p}|{a}" for p, a in zip(prompts, answer)])
        return [float(len(ids) + trainer_state["step"]) if a == c else 0.0 for ids, a, c in zip(completion_ids, answer, completions)]

    prompts = ["p0", "p0", "p1", "p1"]
    completions = ["a", "b", "cc", "dd"]
    columns = {"prompt": prompts, "answer": ["a", "x", "cc", "dd"]}
    with RewardPool([inspects_kwargs], num_workers=2, timeout_s=20) as pool:
        pool.validate(prompts, completions, columns, completion_ids=[[1], [2], [3, 4], [5, 6]], trainer_state={"step": 0})
        result = pool.score(
            prompts, completions, completion_ids=[[1], [2], [3, 4], [5, 6]], columns=columns, trainer_state={"step": 10}
        )
    assert result.rewards.tolist() == [11.0, 0.0, 12.0, 12.0]
    assert result.rewards.dtype == torch.float32
    assert result.metrics["reward/inspects_kwargs/user/mean_len"] == pytest.approx(1.5)
    assert result.extra_columns["echo"] == ["p0|a", "p0|x", "p1|cc", "p1|dd"]
    assert seen == {}  # the parent's closure was not mutated: the call really ran elsewhere


def test_trl_reward_function_unchanged():
    from trl.rewards import get_repetition_penalty_reward

    repetition = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    completion_ids = [[1, 2, 1, 2, 1, 2], [1, 2, 3, 4, 5], [7], [9, 9, 9, 9]]
    completions = ["x"] * 4
    with RewardPool([repetition], num_workers=2, timeout_s=20) as pool:
        pool.validate(["q"] * 4, completions, {}, completion_ids=completion_ids)
        result = pool.score(["q"] * 4, completions, completion_ids=completion_ids)
    expected = repetition(completion_ids=completion_ids)
    assert result.per_function["repetition_penalty_reward"].tolist() == pytest.approx(expected)
    assert min(expected) < 0.0  # the case really penalises something


def test_weights_none_and_scored_mask():
    def half_none(prompts, completions, **kwargs):
        return [None if completion.startswith("n") else 2.0 for completion in completions]

    def all_none(prompts, completions, **kwargs):
        return [None] * len(completions)

    completions = ["n1", "y22", "n333", "y4444"]
    with RewardPool([length_reward, half_none, all_none], weights=[0.5, -1.0, 3.0], num_workers=0) as pool:
        result = pool.score(["p"] * 4, completions)
    lengths = torch.tensor([2.0, 3.0, 4.0, 5.0])
    expected = 0.5 * lengths - torch.tensor([0.0, 2.0, 0.0, 2.0])
    torch.testing.assert_close(result.rewards, expected)
    assert result.per_function["half_none"].tolist() == [0.0, 2.0, 0.0, 2.0]
    assert result.metrics["reward/half_none/mean"] == 2.0  # over the values that apply (TRL's nanmean)
    assert result.metrics["reward/half_none/none"] == 2.0
    assert result.metrics["reward/all_none/none"] == 4.0 and result.metrics["reward/all_none/mean"] == 0.0
    assert result.scored.tolist() == [True] * 4

    with RewardPool([all_none, half_none], num_workers=0) as pool:
        assert pool.score(["p"] * 4, completions).scored.tolist() == [False, True, False, True]


def test_timeout_kills_only_the_hung_chunk_and_replaces_the_worker():
    completions = ["ok0", "ok1", "hang2", "ok3"]  # two workers: chunks [0:2] and [2:4]
    with RewardPool([sleeps_on_hang, length_reward], timeout_s=OK_LIMIT_S, num_workers=2) as pool:
        pids_before = set(pool.worker_pids)
        result = pool.score(["p"] * 4, completions)
        assert result.per_function["sleeps_on_hang"].tolist() == [1.0, 1.0, 0.0, 0.0]
        assert result.per_function["length_reward"].tolist() == [3.0, 3.0, 5.0, 3.0]
        assert result.metrics["reward/sleeps_on_hang/timeout"] == 2.0
        assert any("timeout" in line for line in result.errors)
        # The hung worker was killed and reaped, and a fresh one took its slot.
        killed = pids_before - set(pool.worker_pids)
        assert len(killed) == 1 and all(_process_gone(pid) for pid in killed)
        assert len(pool.worker_pids) == 2
        again = pool.score(["p"] * 2, ["ok", "fine"])
        assert again.per_function["sleeps_on_hang"].tolist() == [1.0, 1.0]
        assert again.metrics["reward/sleeps_on_hang/timeout"] == 0.0


def test_every_chunk_hanging_returns_in_about_the_limit():
    with RewardPool([sleeps_on_hang], timeout_s=HANG_LIMIT_S, num_workers=2) as pool:
        result = pool.score(["p"] * 6, ["hang"] * 6)  # returns (an hour's sleep was not waited for)
    assert result.rewards.tolist() == [0.0] * 6
    assert result.metrics["reward/sleeps_on_hang/timeout"] == 6.0


def runs_a_sleep_and_records_its_pid(prompts, completions, *, pid_file, **kwargs):
    """Starts `sleep 3600` the way reward code does (subprocess), writes its pid, waits for it."""
    import subprocess

    child = subprocess.Popen(["sleep", "3600"])
    with open(pid_file[0], "a") as handle:
        handle.write(f"{child.pid}\n")
    child.wait()
    return [1.0] * len(completions)


def test_a_timed_out_reward_leaks_no_child_processes(tmp_path):
    pid_file = str(tmp_path / "pids")
    with RewardPool([runs_a_sleep_and_records_its_pid], timeout_s=1.0, num_workers=2) as pool:
        for _ in range(2):  # two steps, as in the report that found 4 leaked sleeps
            result = pool.score(["p"] * 4, ["a"] * 4, columns={"pid_file": [pid_file] * 4})
            assert result.metrics["reward/runs_a_sleep_and_records_its_pid/timeout"] == 4.0
    sleepers = [int(line) for line in open(pid_file).read().split()]
    assert len(sleepers) == 4
    deadline = time.monotonic() + 120  # generous: only the kernel's bookkeeping is waited for
    while time.monotonic() < deadline and not all(_process_gone_or_zombie(pid) for pid in sleepers):
        time.sleep(0.05)
    assert all(_process_gone_or_zombie(pid) for pid in sleepers)


def _process_gone_or_zombie(pid: int) -> bool:
    """Killed: gone, or a zombie that its new parent (init, which may not reap here) has not reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def scripted(prompts, completions, **kwargs):
    """Does what each completion says: 'ok:<v>', 'none', 'nan', or the first of raise/exit/hang."""
    for completion in completions:
        if completion == "raise":
            raise ValueError("scripted failure")
        if completion == "exit":
            os._exit(1)
        if completion == "hang":
            time.sleep(HOUR_S)
    special = {"none": None, "nan": math.nan}
    return [special[c] if c in special else float(c.split(":")[1]) for c in completions]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_of_failures_matches_the_chunk_rule(seed):
    """Each chunk's first fatal behaviour zeroes that chunk and is counted; the rest per sample."""
    rng = random.Random(seed)
    count, workers = 11, 3
    kinds = ["raise", "exit", "hang", "none", "nan"]
    completions = [rng.choice(kinds) if rng.random() < 0.35 else f"ok:{rng.randint(-5, 5)}" for _ in range(count)]
    bounds = [round(index * count / workers) for index in range(workers + 1)]
    expected = [0.0] * count
    counts = dict.fromkeys(["raised", "crashed", "timeout", "none", "invalid"], 0)
    fatal_kind = {"raise": "raised", "exit": "crashed", "hang": "timeout"}
    for start, stop in zip(bounds, bounds[1:]):
        chunk = completions[start:stop]
        fatal = next((c for c in chunk if c in fatal_kind), None)
        if fatal is not None:
            counts[fatal_kind[fatal]] += stop - start
            continue
        for offset, completion in enumerate(chunk):
            if completion == "none":
                counts["none"] += 1
            elif completion == "nan":
                counts["invalid"] += 1
            else:
                expected[start + offset] = float(completion.split(":")[1])
    with RewardPool([scripted, length_reward], weights=[1.0, 0.0], num_workers=workers, timeout_s=OK_LIMIT_S) as pool:
        result = pool.score(["p"] * count, completions)
        assert result.rewards.tolist() == expected
        assert result.per_function["length_reward"].tolist() == [float(len(c)) for c in completions]
        for kind, number in counts.items():
            assert result.metrics[f"reward/scripted/{kind}"] == number, kind
        assert len(pool.worker_pids) == workers


def torch_reward(prompts, completions, **kwargs):
    matrix = torch.full((256, 256), 0.5)
    return [float((matrix @ matrix)[0, 0]) + len(completion) for completion in completions]


def test_torch_ops_in_forked_workers_after_the_trainer_used_threads():
    # The trainer has run multi-threaded torch ops before the workers fork; without care the
    # workers' first multi-threaded op deadlocks (every call would time out and score 0).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        big = torch.randn(512, 512)
        (big @ big).sum()
        with RewardPool([torch_reward], num_workers=2, timeout_s=10) as pool:
            result = pool.score(["p"] * 4, ["a", "bb", "c", "dd"])
    finally:
        torch.set_num_threads(threads)
    assert result.errors == []
    assert result.rewards.tolist() == [65.0, 66.0, 65.0, 66.0]


def test_raise_zeroes_only_its_chunk():
    with RewardPool([raises_on_boom, length_reward], num_workers=2, timeout_s=20) as pool:
        result = pool.score(["p"] * 4, ["a", "boom", "c", "d"])
    assert result.per_function["raises_on_boom"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert result.metrics["reward/raises_on_boom/raised"] == 2.0
    assert "reward exploded" in " ".join(result.errors)
    assert result.per_function["length_reward"].tolist() == [1.0, 4.0, 1.0, 1.0]


@pytest.mark.parametrize("how", ["exit", "segv"])
def test_worker_that_dies_is_counted_and_replaced(how):
    with RewardPool([dies_on_die], num_workers=2, timeout_s=20) as pool:
        result = pool.score(["p"] * 4, ["a", "b", how, "d"])
        assert result.per_function["dies_on_die"].tolist() == [1.0, 1.0, 0.0, 0.0]
        assert result.metrics["reward/dies_on_die/crashed"] == 2.0
        assert ("SIGSEGV" if how == "segv" else "exit code 3") in " ".join(result.errors)
        assert pool.score(["p"] * 2, ["a", "b"]).rewards.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_invalid_outputs(num_workers):
    special = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}

    def non_finite(prompts, completions, **kwargs):
        return [special.get(completion, 1.0) for completion in completions]

    def too_short(prompts, completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    def a_string(prompts, completions, **kwargs):
        return "1" * len(completions)

    def a_scalar(prompts, completions, **kwargs):
        return 1.0

    def vectors(prompts, completions, **kwargs):
        return [torch.ones(2) for _ in completions]  # float() of a 2-element tensor raises

    class Unmeasurable(list):
        def __len__(self):
            raise RuntimeError("no length today")

    def unmeasurable(prompts, completions, **kwargs):
        return Unmeasurable([1.0] * len(completions))

    numbers = {"a": np.float32(0.5), "b": np.int64(3), "c": np.bool_(True), "d": torch.tensor(-2.0), "e": True}

    def numpy_and_torch_scalars(prompts, completions, **kwargs):
        return np.array([numbers[completion] for completion in completions], dtype=object)

    functions = [non_finite, too_short, a_string, a_scalar, vectors, unmeasurable, numpy_and_torch_scalars]
    with RewardPool(functions, num_workers=num_workers, timeout_s=20) as pool:
        result = pool.score(["p"] * 5, ["nan", "inf", "ok", "-inf", "ok"])
        assert result.per_function["non_finite"].tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
        assert result.metrics["reward/non_finite/invalid"] == 3.0
        for name in ("too_short", "a_string", "a_scalar", "vectors", "unmeasurable"):
            assert result.per_function[name].tolist() == [0.0] * 5
            assert result.metrics[f"reward/{name}/invalid"] == 5.0
        assert result.rewards.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0]
        assert any("values for" in line for line in result.errors)
        scalars = pool.score(["p"] * 5, ["a", "b", "c", "d", "e"])
        assert scalars.per_function["numpy_and_torch_scalars"].tolist() == [0.5, 3.0, 1.0, -2.0, 1.0]
        assert scalars.metrics["reward/numpy_and_torch_scalars/invalid"] == 0.0


async def async_reward(prompts, completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def test_async_reward_and_unpicklable_logs():
    def logs_a_lock(prompts, completions, log_extra, **kwargs):
        log_extra("lock", [threading.Lock() for _ in completions])  # cannot travel back to the trainer
        return [1.0] * len(completions)

    with RewardPool([async_reward, logs_a_lock], num_workers=2, timeout_s=20) as pool:
        result = pool.score(["p"] * 3, ["a", "bb", "ccc"])
    assert result.per_function["async_reward"].tolist() == [1.0, 2.0, 3.0]
    assert result.per_function["logs_a_lock"].tolist() == [1.0, 1.0, 1.0]  # the rewards survive
    assert "lock" not in result.extra_columns


def test_in_process_mode_catches_exceptions():
    def exits(prompts, completions, **kwargs):
        sys.exit(2)

    functions = [raises_on_boom, exits, lambda prompts, completions, **kwargs: [2.0] * len(completions)]
    with RewardPool(functions, num_workers=0) as pool:
        result = pool.score(["p"] * 3, ["a", "boom", "c"])
    assert result.per_function["raises_on_boom"].tolist() == [0.0, 0.0, 0.0]  # one chunk in-process
    assert result.metrics["reward/raises_on_boom/raised"] == 3.0
    assert result.metrics["reward/exits/raised"] == 3.0 and "SystemExit" in " ".join(result.errors)
    assert result.per_function["lambda"].tolist() == [2.0, 2.0, 2.0]


def test_loud_function_and_large_batch(capfd):
    def loud(prompts, completions, **kwargs):
        print("x" * 1_000_000)
        print("y" * 1_000_000, file=sys.stderr)
        return [float(len(completion)) for completion in completions]

    count = 20_000
    completions = [str(index) for index in range(count)]
    with RewardPool([loud], num_workers=2, timeout_s=30) as pool:
        result = pool.score(["p"] * count, completions, completion_ids=[[index] for index in range(count)])
    assert result.rewards.tolist() == [float(len(completion)) for completion in completions]
    capfd.readouterr()  # drop the noise


def marks_then_hangs(prompts, completions, *, marker=None, **kwargs):
    """``ok...`` completions score 1; others: write a file named after the chunk's first
    completion (the task has started), then hang."""
    if all(completion.startswith("ok") for completion in completions):
        return [1.0] * len(completions)
    with open(f"{marker[0]}-{completions[0]}", "w") as handle:
        handle.write("started\n")
    time.sleep(HOUR_S)
    return [0.0] * len(completions)


def test_keyboard_interrupt_kills_busy_workers_and_pool_recovers(tmp_path):
    marker = str(tmp_path / "started")
    with RewardPool([marks_then_hangs], num_workers=2, timeout_s=HOUR_S) as pool:
        pids = pool.worker_pids
        # One Ctrl-C once both workers are inside the call (only the interrupt can end it: the
        # tasks hang for an hour and so does the limit), sent to the main thread itself: a
        # process-directed signal may be taken by the sending thread, which leaves the main
        # thread blocked in select() until something else wakes it.
        main_thread = threading.get_ident()
        started = [f"{marker}-a", f"{marker}-b"]

        def interrupt_once_both_started() -> None:
            deadline = time.monotonic() + 120  # generous: only the workers' start is waited for
            while time.monotonic() < deadline and not all(os.path.exists(path) for path in started):
                time.sleep(0.01)
            signal.pthread_kill(main_thread, signal.SIGINT)

        def on_sigint(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)
        sender = threading.Thread(target=interrupt_once_both_started, daemon=True)
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.score(["p"] * 2, ["a", "b"], columns={"marker": [marker] * 2})
        finally:
            sender.join()
            signal.signal(signal.SIGINT, previous)
        assert all(os.path.exists(path) for path in started)  # interrupted mid-call, not before it
        assert all(_process_gone(pid) for pid in pids)
        assert pool.score(["p"] * 2, ["ok1", "ok2"]).rewards.tolist() == [1.0, 1.0]  # fresh workers
        new_pids = pool.worker_pids
    assert all(_process_gone(pid) for pid in new_pids)


def test_close_reaps_workers_and_rejects_further_calls():
    pool = RewardPool([length_reward], num_workers=3)
    pids = pool.worker_pids
    assert len(pids) == 3
    pool.close()
    pool.close()  # idempotent
    assert all(_process_gone(pid) for pid in pids)
    with pytest.raises(ValueError, match="closed"):
        pool.score(["p"], ["a"])


def test_pool_dropped_without_close_is_cleaned_up():
    pool = RewardPool([length_reward], num_workers=2)
    pids = pool.worker_pids
    del pool
    import gc

    gc.collect()
    assert all(_process_gone(pid) for pid in pids)


def test_forkserver_ships_lambdas_and_workers_outlive_an_idle_spell():
    # Non-fork start methods ship the functions with cloudpickle; a forkserver worker's parent
    # is the server, which must not read as "the trainer is gone" while the pool sits idle.
    pytest.importorskip("cloudpickle", reason="cloudpickle (pulled in by the train extra) is not installed")
    offset = 5.0
    function = lambda prompts, completions, **kwargs: [offset + len(c) for c in completions]  # noqa: E731
    with RewardPool([function], num_workers=1, timeout_s=60, start_method="forkserver") as pool:
        assert pool.score(["p"] * 2, ["a", "bb"]).rewards.tolist() == [6.0, 7.0]
        pid = pool.worker_pids
        # several of the workers' parent checks (load can only make fewer happen, never a false failure)
        time.sleep(3 * workers.PARENT_CHECK_INTERVAL_S)
        assert pool.score(["p"], ["abc"]).rewards.tolist() == [8.0]
        assert pool.worker_pids == pid


def test_empty_batch():
    with RewardPool(["format", length_reward], num_workers=0) as pool:
        result = pool.score([], [])
    assert result.rewards.shape == (0,) and result.metrics["reward/format/mean"] == 0.0


# ----------------------------------------------------------------- errors before the first step
def test_validate_errors_name_the_function():
    def no_kwargs(completions):
        return [0.0] * len(completions)

    def wrong_length(prompts, completions, **kwargs):
        return [0.0]

    def needs_column(prompts, completions, **kwargs):
        return [float(s == c) for s, c in zip(kwargs["solution"], completions)]

    rows = dict(prompts=["p1", "p2"], completions=["1", "2"], columns={"answer": ["1", "3"]})
    for function, message in (
        (no_kwargs, "'no_kwargs' cannot be called"),
        (wrong_length, "'wrong_length' failed on a probe.*returned 1 values for 2"),
        (needs_column, "'needs_column' failed on a probe.*raised.*KeyError.*solution"),
    ):
        with RewardPool(["exact_match", function], num_workers=2, timeout_s=20) as pool:
            with pytest.raises(ValueError, match=message):
                pool.validate(**rows)
    with RewardPool(["exact_match", "math", "format"], num_workers=0) as pool:
        pool.validate(**rows)  # the built-ins pass on real rows
        with pytest.raises(ValueError, match="'exact_match' failed.*'answer' dataset column"):
            pool.validate(["p"], ["1"], {"solution": ["1"]})
    with RewardPool([sleeps_on_hang], num_workers=1, timeout_s=HANG_LIMIT_S) as pool:
        with pytest.raises(ValueError, match="'sleeps_on_hang'.*timeout.*raise timeout_s"):
            pool.validate(["p"], ["hang"], {})


def test_bad_pool_arguments_and_inputs():
    with pytest.raises(ValueError, match="weights has 1 entries for 2"):
        RewardPool(["format", "math"], weights=[1.0], num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(["format"], timeout_s=0, num_workers=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(["format"], num_workers=-1)
    with RewardPool(["format", length_reward], names=["fmt", "len"], num_workers=0) as pool:
        assert pool.score(["p"], ["#### 1"]).per_function.keys() == {"fmt", "len"}
    with RewardPool(["format", "format"], num_workers=0) as pool:
        assert pool.names == ["format", "format_2"]
        with pytest.raises(ValueError, match="column 'answer' must hold one value per completion"):
            pool.score(["p", "q"], ["a", "b"], columns={"answer": ["x"]})
        with pytest.raises(ValueError, match="prompts has 1 entries for 2"):
            pool.score(["p"], ["a", "b"])
        with pytest.raises(ValueError, match="clashes"):
            pool.score(["p"], ["a"], columns={"trainer_state": [1]})
    assert set(BUILTIN_REWARDS) == {"exact_match", "math", "format"}


def test_the_pool_lives_in_rewards_pool_and_closes_like_a_worker_pool_on_an_error():
    """``fastrl.train.rewards`` hands on the pool's names from their home; the pool's closing is the
    worker pool's (``workers.Closeable``): an error inside ``with`` still reaps the workers."""
    from fastrl.train import rewards
    from fastrl.train.rewards import pool as pool_module

    for name in ("RewardPool", "RewardResult", "NON_FINITE_TOTAL_METRIC"):
        assert getattr(rewards, name) is getattr(pool_module, name)
    assert issubclass(RewardPool, workers.Closeable) and issubclass(workers.WorkerPool, workers.Closeable)
    with pytest.raises(RuntimeError, match="the caller's"):
        with RewardPool([length_reward], num_workers=1) as pool:
            pids = pool.worker_pids
            raise RuntimeError("the caller's error")
    assert pool.closed and pids and all(_process_gone(pid) for pid in pids)
