"""The environment runtime with real worker processes: environments that hang, crash
(os._exit) and raise end only their own trajectory; their workers are killed and replaced;
environments lost with a worker are rebuilt by replay; steps of one turn run in parallel."""

import multiprocessing
import os
import threading

import pytest

from fastrl.agents import metric_names as names
from fastrl.agents.driver import AgentConfig, run_episodes
from fastrl.agents.env import StepResult
from fastrl.agents.render import ChatRenderer
from fastrl.agents.runtime import EnvRuntime, InProcessRuntime, probe_environment
from fastrl.errors import InputError
from fastrl.train.task import char_tokenizer
from scripted import ScriptedSampler


class Faulty:
    """``ok`` -> an observation counting the steps; ``hang`` never returns; ``crash`` kills
    the process; ``raise`` raises; ``end`` -> done with reward = the number of steps so far."""

    def reset(self, row, seed):
        self.steps = 0
        return [{"role": "user", "content": f"start {row['name']}"}]

    def step(self, action):
        self.steps += 1
        if action == "hang":
            threading.Event().wait()
        if action == "crash":
            os._exit(3)
        if action == "raise":
            raise RuntimeError("the environment broke")
        if action == "end":
            return StepResult([], float(self.steps), True, {"stop_reason": "end"})
        return StepResult([{"role": "user", "content": f"seen {self.steps}"}], 0.0, False, {})

    def close(self):
        pass


SCRIPTS = {
    0: ["ok", "ok", "end"],   # slot 0, shares its worker with row 2 (which crashes it)
    1: ["ok", "hang"],        # slot 1
    2: ["ok", "crash"],       # slot 0
    3: ["raise"],             # slot 1
}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(runtime, *, failed="zero", rows=None):
    tokenizer = char_tokenizer()
    rows = rows or [{"name": str(i)} for i in range(4)]
    sampler = ScriptedSampler(tokenizer, lambda trajectory, turn: SCRIPTS[trajectory][turn])
    config = AgentConfig(max_turns=5, max_turn_tokens=16, max_trajectory_tokens=400, failed_trajectories=failed)
    return run_episodes(rows, group_size=1, runtime=runtime, renderer=ChatRenderer(tokenizer), sampler=sampler,
                        config=config, seeds=list(range(len(rows))))


@pytest.mark.parametrize("failed", ["zero", "mask"])
def test_hang_crash_and_raise_end_only_their_trajectory(failed):
    with EnvRuntime(Faulty, num_workers=2, step_timeout_s=1.0, trajectory_timeout_s=60.0) as runtime:
        before = runtime.worker_pids
        trajectories, metrics = _run(runtime, failed=failed)
        after = runtime.worker_pids
    stops = [t.stop_reason for t in trajectories]
    assert stops == ["end", "env_timeout", "env_crashed", "env_error"]
    # row 0 went on after its worker died with row 2: rebuilt by replay, it saw all 3 steps
    assert trajectories[0].outcome_reward == 3.0 and metrics[names.ENV_REPLAYS] >= 1
    assert [m["content"] for m in trajectories[0].messages if m["role"] == "user"] == ["start 0", "seen 1", "seen 2"]
    assert "the environment broke" in trajectories[3].error and "exit code 3" in trajectories[2].error
    for t in trajectories[1:]:
        assert t.outcome_reward == 0.0 and t.excluded == (failed == "mask")
    assert not trajectories[0].excluded
    assert trajectories[1].tool_failures == {"timeout": 1} and metrics[names.tool_failures("timeout")] == 1.0
    assert trajectories[2].tool_failures == trajectories[3].tool_failures == {}
    assert metrics[names.stop("env_timeout")] == metrics[names.stop("env_crashed")] == metrics[names.stop("env_error")] == 1.0
    # both workers were killed (hang, crash) and replaced; the old ones are gone
    assert len(after) == 2 and not set(before) & set(after)
    assert not any(_alive(pid) for pid in before)


def test_trajectory_time_limit_bounds_all_calls_of_a_trajectory():
    with EnvRuntime(Faulty, num_workers=1, step_timeout_s=600.0, trajectory_timeout_s=0.5) as runtime:
        runtime.reset([(0, {"name": "x"}, 0)])
        (reply,) = runtime.step([(0, "hang")])
        (again,) = runtime.step([(0, "ok")])  # nothing left: not even sent
    assert reply.status == "timeout" and "its 0.5 s of environment time" in reply.message
    assert again.status == "timeout" and again.seconds == 0.0


class Rendezvous:
    """Each step waits until the other trajectory's step has started too (a shared barrier):
    steps run one after another -> the barrier breaks and the step raises."""

    def __init__(self, barrier):
        self.barrier = barrier

    def reset(self, row, seed):
        return [{"role": "user", "content": "go"}]

    def step(self, action):
        self.barrier.wait(timeout=120)
        return StepResult([], 1.0, True, {})

    def close(self):
        pass


def test_steps_of_one_turn_run_in_parallel():
    barrier = multiprocessing.get_context("fork").Barrier(2)
    with EnvRuntime(lambda: Rendezvous(barrier), num_workers=2, step_timeout_s=300.0) as runtime:
        runtime.reset([(0, {}, 0), (1, {}, 0)])
        replies = runtime.step([(0, "a"), (1, "b")])
    assert [r.status for r in replies] == ["ok", "ok"] and all(r.value.done for r in replies)


class BadReset(Faulty):
    def reset(self, row, seed):
        return "hello"


def test_probe_rejects_a_reset_that_returns_the_wrong_type():
    with EnvRuntime(BadReset, num_workers=1, step_timeout_s=10.0) as runtime:
        with pytest.raises(InputError, match="must return a list of messages"):
            probe_environment(runtime, {"name": "x"})
    with InProcessRuntime(BadReset) as runtime:
        with pytest.raises(InputError, match="reset"):
            probe_environment(runtime, {"name": "x"})


def test_in_process_runtime_gives_the_same_trajectories():
    rows = [{"name": "0"}]
    with EnvRuntime(Faulty, num_workers=1) as runtime:
        remote, _ = _run(runtime, rows=rows)
    with InProcessRuntime(Faulty) as runtime:
        local, _ = _run(runtime, rows=rows)
    assert remote[0].samples[0].token_ids == local[0].samples[0].token_ids
    assert remote[0].outcome_reward == local[0].outcome_reward == 3.0


from fastrl.agents.tool_env import ToolEnv  # noqa: E402


def sleepy(x: str) -> str:
    """Never returns.

    Args:
        x: anything
    """
    threading.Event().wait()
    return x


def fatal(x: str) -> str:
    """Kills its process.

    Args:
        x: anything
    """
    os._exit(7)


def broken(x: str) -> str:
    """Raises.

    Args:
        x: anything
    """
    raise KeyError(x)


class Tools(ToolEnv):
    tools = [sleepy, fatal, broken]

    def reset(self, row, seed):
        self.begin_episode()
        return [{"role": "user", "content": "use a tool"}]

    def score(self, answer):
        return 1.0 if answer == "done" else 0.0


def test_tools_that_hang_crash_and_raise():
    tokenizer = char_tokenizer()
    script = {0: ["sleepy(a)"], 1: ["fatal(b)"], 2: ["broken(c)", "nope(d)", "done"]}
    sampler = ScriptedSampler(tokenizer, lambda trajectory, turn: script[trajectory][turn])
    with EnvRuntime(Tools, num_workers=3, step_timeout_s=1.0) as runtime:
        trajectories, metrics = run_episodes(
            [{}, {}, {}], group_size=1, runtime=runtime, renderer=ChatRenderer(tokenizer), sampler=sampler,
            config=AgentConfig(max_turns=4, max_turn_tokens=32), seeds=[0, 1, 2])
    assert [t.stop_reason for t in trajectories] == ["env_timeout", "env_crashed", "answer"]
    raised = trajectories[2]
    assert raised.outcome_reward == 1.0 and raised.tool_failures == {"exception": 1, "unknown_tool": 1}
    assert [m["content"] for m in raised.messages if m["role"] == "tool"] == [
        "error: KeyError: 'c'", "error: unknown tool 'nope'; the tools are ['broken', 'fatal', 'sleepy']"]
    assert metrics[names.tool_failures("timeout")] == metrics[names.tool_failures("exception")] == 1.0
    assert metrics[names.TOOL_CALLS_PER_TRAJECTORY] == pytest.approx(2 / 3)
    assert metrics[names.TOOL_CALL_RATE] == pytest.approx(1 / 3)
    assert metrics[names.ENV_CALLS] == 3 + (1 + 1 + 3)  # resets + steps


def test_a_trl_environment_in_worker_processes_with_hermes_calls():
    from fastrl.agents.tool_env import TRLEnvironment
    from test_env import Counter

    tokenizer = char_tokenizer()
    calls = ['<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>',
             '<tool_call>{"name": "increment", "arguments": {"by": "3"}}</tool_call>',
             '<tool_call>{"name": "increment", "arguments": {"by": 3}}</tool_call>', "done"]
    sampler = ScriptedSampler(tokenizer, lambda trajectory, turn: calls[turn])
    rows = [{"prompt": "Count.", "target": 5}, {"prompt": "Count.", "target": 4}]
    with EnvRuntime(lambda: TRLEnvironment(Counter, call_format="hermes"), num_workers=2) as runtime:
        probe_environment(runtime, rows[0])
        trajectories, _ = run_episodes(rows, group_size=1, runtime=runtime, renderer=ChatRenderer(tokenizer), sampler=sampler,
                                       config=AgentConfig(max_turns=5, max_turn_tokens=96, max_trajectory_tokens=600), seeds=[0, 1])
    assert [t.outcome_reward for t in trajectories] == [1.0, 0.0]  # get_reward(): reached the target or not
    assert trajectories[0].messages[0]["content"] == "Count. Reach 5."
    assert trajectories[0].tool_failures == {"bad_arguments": 1} and trajectories[0].tool_calls == 3


class Counted(Faulty):
    """Counts its closes in the class (the in-process runtime shares this process)."""

    closes = 0

    def close(self):
        type(self).closes += 1


def test_with_closes_a_runtime_once_even_on_an_error():
    with pytest.raises(RuntimeError, match="the caller broke"):
        with EnvRuntime(Faulty, num_workers=2) as runtime:
            runtime.reset([(0, {"name": "0"}, 0)])
            pids = runtime.worker_pids
            raise RuntimeError("the caller broke")
    assert runtime.closed and len(pids) == 2 and not any(_alive(pid) for pid in pids)
    runtime.close()  # a second close does nothing
    Counted.closes = 0
    with pytest.raises(RuntimeError, match="the caller broke"):
        with InProcessRuntime(Counted) as local:
            local.reset([(0, {"name": "0"}, 0), (1, {"name": "1"}, 0)])
            raise RuntimeError("the caller broke")
    assert local.closed and Counted.closes == 2
    local.close()
    assert Counted.closes == 2
