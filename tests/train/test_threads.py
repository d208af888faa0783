"""fastrl train's thread rule (fastrl/train/run/threads.py) on hand-made inputs, the governor on
made-up counters, and the rule's use in a real run."""

from __future__ import annotations

import copy

import pytest
import torch

from fastrl.train.run.threads import (RAISE_AFTER_WINDOWS, ThreadGovernor, choose_threads, free_cores,
                                      others_busy_reader, other_runnable)


def test_the_rule_is_the_free_cores_whatever_the_model_size():
    for parameters in (276_032, 1_100_000, None):
        assert choose_threads(parameters=parameters, cores=8, load=0.0).threads == 8
        assert choose_threads(parameters=parameters, cores=8, load=3.0).threads == 5
        assert choose_threads(parameters=parameters, cores=2, load=1.0).threads == 1
    assert choose_threads(parameters=276_032, cores=2, load=9.0).threads == 1  # never below one
    assert "0.28M-parameter model on 2 core(s) with 0 other" in choose_threads(parameters=276_032, cores=2, load=0.0).reason
    assert free_cores(2, 0.4) == 2 and free_cores(2, 0.6) == 1 and free_cores(4, 2.5) == 2 and free_cores(1, 0.0) == 1


def test_other_runnable_counts_running_processes_not_this_one():
    count = other_runnable(samples=3, interval=0.0)
    assert count >= 0.0 and count == int(count)


def test_cuda_keeps_torchs_default_and_the_line_says_who_chose():
    choice = choose_threads(parameters=10, cores=2, load=0.0, device_type="cuda")
    assert choice.threads is None and choice.describe().startswith("threads: torch's default (on cuda")
    assert choose_threads(parameters=10, cores=2, load=0.0).describe(given=3) == "threads: 3 (--threads)"


class Machine:
    """Made-up counters: the others' CPU seconds advance by ``others`` cores' worth per second of the clock."""

    def __init__(self) -> None:
        self.now, self.others_seconds, self.others, self.set = 0.0, 0.0, 0.0, []

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.others_seconds += self.others * seconds

    def governor(self, *, cores: int, threads: int) -> ThreadGovernor:
        return ThreadGovernor(cores=cores, threads=threads, read_others=lambda: self.others_seconds,
                              set_threads=self.set.append, clock=lambda: self.now, window=1.0)


def test_the_governor_gives_a_core_back_at_once_and_takes_it_again_only_after_windows_agree():
    m = Machine()
    g = m.governor(cores=2, threads=2)
    m.advance(0.5)
    g.tick()
    assert m.set == []  # within the first window: nothing read
    m.others = 1.0  # a busy neighbour arrives
    m.advance(0.6)
    g.tick()
    assert m.set == [1] and g.threads == 1 and g.changes[-1][1:] == (1, 0.55)  # 1.1 s read, the neighbour on for 0.6 of them
    m.others = 0.0  # it leaves
    for window in range(RAISE_AFTER_WINDOWS - 1):
        m.advance(1.0)
        g.tick()
        assert m.set == [1], window  # one quiet window is not enough
    m.advance(1.0)
    g.tick()
    assert m.set == [1, 2] and g.threads == 2


def test_the_governor_reads_a_share_of_a_core_as_the_nearest_whole_core():
    m = Machine()
    g = m.governor(cores=4, threads=4)
    m.others = 1.4  # one neighbour and a bit
    m.advance(1.0)
    g.tick()
    assert m.set == [3]
    m.others = 3.7  # more than the cores can give: one thread stays
    m.advance(1.0)
    g.tick()
    assert m.set == [3, 1]


def test_the_governor_ticks_on_every_path_through_a_model_its_embeddings_included():
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    m = Machine()
    g = m.governor(cores=2, threads=2)
    model = tiny_model(char_tokenizer(), hidden_size=32, layers=1, heads=2, arch=DefaultTask().arch)
    g.attach(model)
    m.others = 1.0
    m.advance(1.0)
    model.base_model(torch.tensor([[1, 2, 3]]))  # the base alone, as the warm-up's hidden states are taken
    assert m.set == [1]
    g.close()


def test_a_closed_governor_and_a_copied_modules_hook_do_nothing():
    m = Machine()
    g = m.governor(cores=2, threads=2)
    module = torch.nn.Linear(2, 2)
    g.attach(module)
    twin = copy.deepcopy(module)  # the reference policy and the critic start as deep copies of the policy
    m.others = 1.0
    m.advance(1.0)
    twin(torch.zeros(1, 2))
    assert m.set == [1]  # the copy's hook reaches the one governor
    g.close()
    m.others = 0.0
    for _ in range(3):
        m.advance(1.0)
        module(torch.zeros(1, 2))
        twin(torch.zeros(1, 2))
    assert m.set == [1] and not module._forward_pre_hooks


def test_a_forked_copy_and_an_unreadable_counter_leave_the_count_alone():
    m = Machine()
    g = m.governor(cores=2, threads=2)
    g._pid = -1  # as in a process forked from the run: its copy of the hook must not steer that process
    m.others = 1.0
    m.advance(1.0)
    g.tick()
    assert m.set == []

    def unreadable() -> float:
        raise OSError("no /proc/stat")

    m = Machine()
    g = m.governor(cores=2, threads=2)
    g.read_others = unreadable
    m.advance(1.0)
    g.tick()
    assert m.set == [] and g.threads == 2


def test_the_reader_counts_the_processes_cores_less_its_own_time(tmp_path):
    import os

    stat = tmp_path / "stat"
    own = [os.times_result((1.0, 0.5, 0.0, 0.0, 0.0))]

    def write(cpu0: int, cpu1: int, cpu2: int) -> None:
        # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        rows = [f"cpu{i} {v} 0 {v} 9999 77 0 0 0 0 0" for i, v in enumerate((cpu0, cpu1, cpu2))]
        stat.write_text(f"cpu {cpu0 + cpu1 + cpu2} 0 0 0 0 0 0 0 0 0\n" + "\n".join(rows) + "\nintr 1 2 3\n")

    write(100, 100, 5000)
    tick = os.sysconf("SC_CLK_TCK")
    read = others_busy_reader([0, 1], stat_path=str(stat), own_times=lambda: own[0])
    first = read()
    assert first == pytest.approx(400 / tick - 1.5)  # core 2 is not this process's: not counted
    write(100 + tick, 100 + tick, 99_999)  # two more busy seconds on cores 0 and 1 (user + system each)
    own[0] = os.times_result((2.0, 1.0, 0.0, 0.0, 0.0))  # 1.5 of them were this process's
    assert read() - first == pytest.approx(4.0 - 1.5)
    assert others_busy_reader([0], stat_path=str(tmp_path / "missing")) is None


def tiny_config(out):
    from fastrl.train.config import TrainConfig

    return TrainConfig(output_dir=str(out), steps=1, sft_steps=0, eval_every=0, model_hidden_size=32, model_layers=1,
                       task_train_size=20, task_eval_size=4, prompts_per_step=2, group_size=2, max_new_tokens=2,
                       reward_workers=0, progress=False, tensorboard=False)


def test_a_run_sets_and_states_the_rule_and_lets_the_governor_go(tmp_path, capsys, monkeypatch):
    from fastrl.train.trainer import Trainer

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # tests/conftest.py pins it for every other run
    before = torch.get_num_threads()
    try:
        with Trainer(tiny_config(tmp_path / "run")) as trainer:
            governor = trainer.site.threads
            assert governor is not None and 1 <= torch.get_num_threads() == governor.threads <= len(os_cores())
            embeddings = trainer.loaded.module.get_input_embeddings()
            assert len(embeddings._forward_pre_hooks) == 1  # every path through the model looks its tokens up there
            trainer.train()
        assert governor.closed and not embeddings._forward_pre_hooks and not trainer.loaded.module._forward_pre_hooks
        err = capsys.readouterr().err
        assert "fastrl train: threads: " in err and "the free cores, re-read every half second; --threads N overrides" in err
    finally:
        torch.set_num_threads(before)


def os_cores() -> set[int]:
    import os

    return os.sched_getaffinity(0)


@pytest.mark.parametrize("env,given", [("3", 3), (" 2 ", 2), ("", None), ("0", None), ("4,2", None), ("x", None)])
def test_omp_num_threads_counts_as_a_given_count_when_it_is_one(env, given):
    from fastrl.train.run.threads import threads_from_environment

    assert threads_from_environment({"OMP_NUM_THREADS": env}) == given
    assert threads_from_environment({}) is None


def test_a_run_takes_omp_num_threads_as_pinned(tmp_path, capsys, monkeypatch):
    from fastrl.train.trainer import Trainer

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    try:
        with Trainer(tiny_config(tmp_path / "run")) as trainer:
            assert trainer.site.threads is None and torch.get_num_threads() == 2
        assert "fastrl train: threads: 2 (OMP_NUM_THREADS)" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
