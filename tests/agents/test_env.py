"""The Environment contract: validation of user classes, the TRL adapter, the --env resolver."""

import pytest

from fastrl.agents.env import StepResult, check_messages, check_step_result, default_state_key, validate_environment
from fastrl.agents.envs import BUILTIN_ENVS, resolve_environment
from fastrl.agents.tool_env import TRLEnvironment
from fastrl.errors import InputError


class Good:
    def reset(self, row, seed):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        return StepResult([], 1.0, True, {})

    def close(self):
        pass


class NoStep:
    def reset(self, row, seed):
        return []

    def close(self):
        pass


class ResetTakesNothing(Good):
    def reset(self):
        return []


def test_validate_environment_names_the_problem():
    validate_environment(Good())
    with pytest.raises(InputError, match=r"'NoStep' has no step\(\) method"):
        validate_environment(NoStep())
    with pytest.raises(InputError, match=r"reset\(\) cannot be called as reset\(row, seed\)"):
        validate_environment(ResetTakesNothing())


def test_message_and_step_result_checks():
    with pytest.raises(InputError, match="must return a list of messages"):
        check_messages("hello", where="X.reset()")
    with pytest.raises(InputError, match="without a str 'content'"):
        check_messages([{"role": "user"}], where="X.reset()")
    assert check_step_result(([], 1, 1, {}), where="X.step()") == StepResult([], 1.0, True, {})
    with pytest.raises(InputError, match="must return a StepResult"):
        check_step_result("done", where="X.step()")
    with pytest.raises(InputError, match="reward that is not a number"):
        check_step_result(StepResult([], "high"), where="X.step()")
    assert default_state_key([1, 2, 3]) == default_state_key([1, 2, 3]) != default_state_key([1, 2, 4])


class Counter:
    """TRL's environment_factory shape: reset(**row) -> str | None, public methods are tools."""

    def __init__(self):
        self.value = 0
        self.target = None

    def reset(self, target, **kwargs):
        self.value = 0
        self.target = target
        return f" Reach {target}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.value += by
        return self.value

    def get_reward(self):
        return float(self.value == self.target)


class UntypedTRL:
    def reset(self, **kwargs):
        return None

    def poke(self, x):
        return x


def test_trl_environment_runs_unchanged():
    env = TRLEnvironment(Counter, call_format="hermes")
    validate_environment(env)
    prompt = env.reset({"prompt": [{"role": "user", "content": "Count."}], "target": 5}, seed=0)
    assert prompt == [{"role": "user", "content": "Count. Reach 5."}]
    step = env.step('<tool_call>{"name": "increment", "arguments": {"by": 2}}</tool_call>')
    assert step.observation == [{"role": "tool", "name": "increment", "content": "2"}] and not step.done
    env.step('<tool_call>{"name": "increment", "arguments": {"by": 3}}</tool_call>')
    final = env.step("done")
    assert final.done and final.reward == 1.0
    env.reset({"prompt": "Count.", "target": 5}, seed=1)  # a fresh instance per episode
    assert env.step("done").reward == 0.0
    with pytest.raises(InputError, match="tool 'poke' of TRL environment 'UntypedTRL' has no docstring"):
        TRLEnvironment(UntypedTRL)


def test_resolve_environment():
    for name in BUILTIN_ENVS:
        validate_environment(resolve_environment(name)())
    factory = resolve_environment("fastrl.agents.envs.frozenlake:FrozenLakeEnv")
    assert type(factory()).__name__ == "FrozenLakeEnv"
    with pytest.raises(InputError, match="could not be imported"):
        resolve_environment("no_such_module_xyz:Env")
    with pytest.raises(InputError, match="has no class or callable 'Nope'"):
        resolve_environment("fastrl.agents.envs.frozenlake:Nope")
    with pytest.raises(InputError, match="neither a built-in"):
        resolve_environment("chess")
    with pytest.raises(InputError, match="has no step"):
        resolve_environment(NoStep)
