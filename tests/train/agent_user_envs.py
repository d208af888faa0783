"""User environments for ``fastrl train --env module:Class`` tests (imported by name, as a
user's module would be): one that works, and one of each mistake the run must refuse before
its first step."""

from fastrl.agents.env import StepResult


class EchoEnv:
    """Two turns: the policy is asked for a word, then asked again; the outcome is the share
    of the word's characters the second answer gets right."""

    def reset(self, row, seed):
        self.word = "abc"[row["index"] % 3] * 3
        self.turn = 0
        return [{"role": "user", "content": f"Say {self.word}."}]

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return StepResult([{"role": "user", "content": "Once more."}], reward=0.1, info={"state_key": "asked"})
        right = sum(a == b for a, b in zip(action, self.word)) / len(self.word)
        return StepResult([], reward=right, done=True)

    def close(self):
        pass


class NoStepEnv:
    def reset(self, row, seed):
        return [{"role": "user", "content": "hi"}]

    def close(self):
        pass


def lookup(key):  # no type hints, no docstring
    return key


class UndocumentedToolEnv(EchoEnv):
    tools = [lookup]


class TextResetEnv(EchoEnv):
    def reset(self, row, seed):
        return "hi"  # not a list of messages


class HangingEnv(EchoEnv):
    """EchoEnv whose ``reset`` never returns for an odd seed (the rows of a step have
    consecutive seeds: one of every two rows): its worker is killed at the time limit, its
    trajectories end (``env_timeout``) and, with ``failed_trajectories=mask``, leave the loss
    and the baselines; the step goes on with the other rows."""

    def reset(self, row, seed):
        if seed % 2:
            import time

            time.sleep(1000)
        return super().reset(row, seed)
