"""A user environment for the turn-credit training tests (``--env corridor:CorridorEnv``): a
corridor of ``LENGTH`` cells, no warm-up needed. A turn whose text has an even number of
characters moves the agent one cell right (per-turn reward 0.25), an odd one leaves it in place
(0.0); reaching the last cell ends the episode with reward 1.0. The state is the cell
(``info["state_key"]``), so a group's trajectories revisit the same states with different
returns: GiGPO's step groups, from a random policy."""

from fastrl.agents.env import StepResult

LENGTH = 3
STEP_REWARD = 0.25


class CorridorEnv:
    def reset(self, row: dict, seed: int) -> list[dict]:
        self.cell = 0
        return [{"role": "user", "content": f"walk right. cell {self.cell}"}]

    def step(self, action: str) -> StepResult:
        moved = len(action) % 2 == 0
        self.cell += int(moved)
        info = {"state_key": f"cell{self.cell}"}
        if self.cell == LENGTH - 1:
            return StepResult([], 1.0, True, {**info, "stop_reason": "end"})
        return StepResult([{"role": "user", "content": f"cell {self.cell}"}], STEP_REWARD if moved else 0.0, False, info)

    def close(self) -> None:
        pass
