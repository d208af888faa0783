"""``frozenlake``: procedurally generated text grids; the policy moves (``up``/``down``/
``left``/``right``, the turn's last word), the observation is the new grid; reward 1.0 on
reaching the goal, 0.0 on falling into a hole (both end the episode).

Grid characters: ``A`` the agent, ``G`` the goal, ``H`` a hole, ``.`` ice; rows separated by
newlines. A move into the border leaves the agent in place (the same state again: per-turn
credit groups such repeated states by ``info["state_key"] = "<grid id>:<row>,<col>"``).
An unreadable move is an observation saying so (counted as ``bad_format``), the agent stays.
``fork()`` copies the state (branching rollouts, ``--rollout tree``, use it instead of replay).
Rows: ``{"prompt": <instructions + grid>, "grid": [...], "answer": <shortest path length>}``
from :func:`frozenlake_rows`; every grid has a path from start to goal.
"""

from __future__ import annotations

import hashlib
import random
from collections import deque

from fastrl.agents.env import Message, StepResult

__all__ = ["FrozenLakeEnv", "frozenlake_rows", "MOVES", "shortest_path"]

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
"""The actions and their (row, column) steps."""
AGENT, GOAL, HOLE, ICE = "A", "G", "H", "."


def _render(grid: list[str], position: tuple[int, int]) -> str:
    rows = [list(r) for r in grid]
    rows[position[0]][position[1]] = AGENT
    return "\n".join("".join(r) for r in rows)


def shortest_path(grid: list[str], start: tuple[int, int]) -> list[str] | None:
    """The moves of a shortest path from ``start`` to the goal avoiding holes (None: no path)."""
    n_rows, n_cols = len(grid), len(grid[0])
    previous: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if grid[cell[0]][cell[1]] == GOAL:
            moves = []
            while previous[cell] is not None:
                cell, move = previous[cell][0], previous[cell][1]
                moves.append(move)
            return moves[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < n_rows and 0 <= nxt[1] < n_cols and nxt not in previous and grid[nxt[0]][nxt[1]] != HOLE:
                previous[nxt] = (cell, move)
                queue.append(nxt)
    return None


def _grid(rng: random.Random, size: int, hole_rate: float) -> tuple[list[str], tuple[int, int]]:
    while True:
        cells = [[HOLE if rng.random() < hole_rate else ICE for _ in range(size)] for _ in range(size)]
        start = (rng.randrange(size), rng.randrange(size))
        goal = (rng.randrange(size), rng.randrange(size))
        if start == goal:
            continue
        cells[start[0]][start[1]] = ICE
        cells[goal[0]][goal[1]] = GOAL
        grid = ["".join(r) for r in cells]
        if shortest_path(grid, start):
            return grid, start


def frozenlake_rows(*, num_train: int, num_heldout: int, seed: int = 0, size: int = 4, hole_rate: float = 0.2) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` solvable grids, distinct."""
    rng = random.Random(seed)
    seen: set[tuple[tuple[str, ...], tuple[int, int]]] = set()
    rows = []
    while len(rows) < num_train + num_heldout:
        grid, start = _grid(rng, size, hole_rate)
        if (tuple(grid), start) in seen:
            continue
        seen.add((tuple(grid), start))
        prompt = "Reach G, avoid H. Move up/down/left/right.\n" + _render(grid, start)
        rows.append({"prompt": prompt, "grid": grid, "start": list(start), "answer": str(len(shortest_path(grid, start)))})
    return rows[num_heldout:], rows[:num_heldout]


class FrozenLakeEnv:
    """A grid walk; each step's observation is the new grid (a user message)."""

    def __init__(self) -> None:
        self.grid: list[str] = []
        self.position = (0, 0)
        self.grid_id = ""

    def reset(self, row: dict, seed: int) -> list[Message]:
        self.grid = list(row["grid"])
        self.position = tuple(row["start"])
        self.grid_id = hashlib.sha1("\n".join(self.grid).encode()).hexdigest()[:12]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: str) -> StepResult:
        words = action.strip().lower().split()
        move = words[-1].strip(".!") if words else ""
        if move not in MOVES:
            info = {"tool_calls": 0, "tool_failures": {"bad_format": 1}, "state_key": self._key()}
            return StepResult([{"role": "user", "content": "Invalid move. Write up, down, left or right.\n" + _render(self.grid, self.position)}], 0.0, False, info)
        dr, dc = MOVES[move]
        r, c = self.position[0] + dr, self.position[1] + dc
        if 0 <= r < len(self.grid) and 0 <= c < len(self.grid[0]):
            self.position = (r, c)
        cell = self.grid[self.position[0]][self.position[1]]
        info = {"tool_calls": 0, "tool_failures": {}, "state_key": self._key()}
        if cell == GOAL:
            return StepResult([], 1.0, True, {**info, "stop_reason": "goal"})
        if cell == HOLE:
            return StepResult([], 0.0, True, {**info, "stop_reason": "hole"})
        return StepResult([{"role": "user", "content": _render(self.grid, self.position)}], 0.0, False, info)

    def fork(self) -> "FrozenLakeEnv":
        """A copy in the same state (branching rollouts fork it instead of replaying)."""
        twin = FrozenLakeEnv()
        twin.grid, twin.position, twin.grid_id = list(self.grid), self.position, self.grid_id
        return twin

    def _key(self) -> str:
        return f"{self.grid_id}:{self.position[0]},{self.position[1]}"

    def close(self) -> None:
        pass

    @staticmethod
    def solve(row: dict) -> list[dict]:
        """The oracle: one move per turn along a shortest path."""
        return [{"move": move} for move in shortest_path(list(row["grid"]), tuple(row["start"]))]
