"""Branching agent rollouts: ``k`` continuations at chosen turns instead of ``G`` independent trajectories.

A ``TurnSchedule`` ``(branches=(k_0, ..., k_m), turns=(t_0 < ... < t_m))`` grows one tree of
trajectories per row (``fastrl train --env NAME --rollout tree --tree_turns 0 1
--tree_branches 4 2``): at the start of policy turn ``t_l`` every trajectory still running
is continued ``k_l`` times; the ``k_l`` siblings share everything before (the prompt, the
earlier turns and their observations) and differ from turn ``t_l`` on. Turn 0 is the first
policy turn: ``--tree_turns 0 --tree_branches G`` is today's ``G`` trajectories sharing the
prompt. Each row gets ``G = k_0 * ... * k_m`` leaves (``group_size``), in depth-first order.
A trajectory that ends before a later branch point ends every path below it: the leaves
under it are copies of it (as in ``fastrl.rollout.branch``), so every leaf is still
marginally one trajectory of the policy and a group always has ``G`` rows.

The shared part is played once:

- the environment: at a branch point each new sibling's environment is a copy of the
  trajectory's (``EnvRuntime.fork``: the environment's own ``fork()`` in its worker, else
  replay of ``reset(row, seed)`` and the recorded actions, each answer checked against the
  recorded one; see ``fastrl.agents.env``);
- the sampler: with the HF sampler (``ForkingTokenSampler``, ``fastrl.rollout.token_sampler``)
  the siblings' trajectories in the multi-turn state are forked
  (``fastrl.rollout.branch.fork_trajectories``: the suffix keys/values copied, the prompt's
  kept once), so no shared token is recomputed; vLLM and
  the server get each sibling's whole history as token ids (``GroupSamplerTokens``) and
  their prefix caching finds the shared blocks.

Seeds: the trajectory of a row with seed ``s`` whose first leaf is ``f`` samples turn ``k``
with ``(s * G + f) * TURN_SEED_STRIDE + k`` (the driver's formula with ``index = f``): the
first sibling keeps its parent's leaf, sibling ``c`` at level ``l`` starts at ``f + c *
span(l)``. A tree depends on its row's seed alone.

Tree nodes (what the trainer's step groups are built from, ``fastrl.ops.tree_advantages``):
the roots ``0 .. N-1`` are the rows' prompts; every branch creates one node per sibling (a
child of the trajectory's current node) that holds the policy turns from its branch point to
the next; when turn 0 is not a branch point, turn 0 opens one trunk node per row.
``TurnTree.node_grid`` puts each policy token's node on the ``[R, T-1]`` grid.

Equal-budget accounting (``TurnTree.metrics``): ``rollout/generated_tokens`` counts each
sampled policy token once (a shared turn once), ``rollout/tree_leaf_tokens`` what ``G``
independent trajectories of the leaves' lengths would sample; ``agent/env_calls`` counts the
environment calls made (resets, steps, a replay's calls), ``agent/tree_leaf_env_calls`` what
the leaves would have made independently; ``env/forks_native`` / ``env/forks_replayed`` how
environments were forked.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fastrl.agents import metric_names as names
from fastrl.agents.trajectory import Trajectory
from fastrl.errors import InputError
from fastrl.rollout.branch import BranchCounts
from fastrl.rollout.token_sampler import ForkingTokenSampler, token_sampler_for
from fastrl.workers import OK

__all__ = ["TurnSchedule", "TurnTree", "ForkingTokenSampler", "tree_token_sampler"]


@dataclass(frozen=True)
class TurnSchedule(BranchCounts):
    """Where an agent tree rollout branches and how wide: ``branches[l]`` continuations at the
    start of policy turn ``turns[l]``."""

    branches: tuple[int, ...]
    """Continuations per trajectory at each branch point (each >= 1); their product is group_size."""
    turns: tuple[int, ...]
    """Policy turn (0 = the first) of each branch point, strictly increasing."""

    def __post_init__(self) -> None:
        self.validate_points("turns", children="continuations per branch point", one_per="one turn per entry",
                           order="be policy turns >= 0 (0: the first), strictly increasing", first_zero=False)

    def level(self, turn: int) -> int | None:
        """The branch point at the start of ``turn`` (None: not a branch point)."""
        return self.turns.index(turn) if turn in self.turns else None

    def check(self, *, group_size: int, max_turns: int) -> None:
        """The schedule fits a run: ``group_size`` leaves, every branch point a turn the run can reach."""
        self.check_leaves(group_size, per="row")
        if self.turns[-1] >= max_turns:
            raise InputError(f"tree_turns {list(self.turns)}: every branch point must be a policy turn below max_turns "
                             f"({max_turns}; turn 0 is the first)")

    @classmethod
    def default(cls, *, group_size: int, max_turns: int) -> "TurnSchedule":
        """2 continuations of the prompt, each branching into ``G/2`` at turn 1 (one branch point
        of ``G`` at turn 0 when ``G`` is odd or below 4, or the run has one turn)."""
        if group_size % 2 or group_size < 4 or max_turns < 2:
            return cls(branches=(group_size,), turns=(0,))
        return cls(branches=(2, group_size // 2), turns=(0, 1))


@dataclass
class _Record:
    born: int
    """The turn this trajectory was forked at (0: a row's first trajectory)."""
    path: list[tuple[int, int]] = field(default_factory=list)
    """``(first turn, node)`` of each node on its path, in order."""

    def node(self, turn: int) -> int:
        found = -1
        for first, node in self.path:
            if first <= turn:
                found = node
        return found


class TurnTree:
    """The bookkeeping of one branching rollout: the driver's hook (``start``, ``branch``,
    ``leaves``), the tree's nodes and the equal-budget figures (see the module docstring)."""

    def __init__(self, schedule: TurnSchedule, *, group_size: int) -> None:
        if schedule.leaves != group_size:
            raise InputError(f"tree_branches {list(schedule.branches)} give {schedule.leaves} leaves; group_size is {group_size}")
        self.schedule = schedule
        self.parents: list[int] = []
        """Parent node of each node (-1: a root, the prompt of row i is node i)."""
        self._records: list[_Record] = []  # per trajectory id of the run (the driver's list)
        self.leaf_records: list[_Record] = []
        self.copies = 0
        self.forks = {"fork": 0, "replay": 0}
        self.fork_calls = 0
        self.fork_failures = 0
        self.fork_seconds = 0.0
        self.rows = 0
        self._born: dict[int, int] = {}  # id() of each trajectory that ran -> the turn it was forked at
        self._resets = 0

    def _node(self, parent: int) -> int:
        self.parents.append(parent)
        return len(self.parents) - 1

    # ------------------------------------------------------------------ the driver's hooks
    def start(self, rows: Sequence[dict], seeds: Sequence[int]) -> list[Trajectory]:
        """One trajectory per row (first leaf 0); the branch points fork the others."""
        self.rows = len(rows)
        self.parents = [-1] * len(rows)
        self._records = [_Record(born=0) for _ in rows]
        return [Trajectory(group=i, index=0, row=row, env_seed=int(seeds[i])) for i, row in enumerate(rows)]

    def branch(self, turn: int, trajectories: list[Trajectory], runtime: Any) -> list[tuple[int, Any]]:
        """At the start of ``turn``: fork every running trajectory as the schedule says (the
        new ones appended to ``trajectories``, their environments forked by ``runtime``).
        Returns ``(trajectory id, EnvReply)`` of each fork (the driver ends those that failed)."""
        level = self.schedule.level(turn)
        running = [t_id for t_id, t in enumerate(trajectories) if not t.done]
        if level is None:
            if turn == 0:  # a trunk node per row: turns before the first branch point
                for t_id in running:
                    self._records[t_id].path.append((0, self._node(trajectories[t_id].group)))
            return []
        k, span = self.schedule.branches[level], self.schedule.span(level)
        requests = []
        for t_id in running:
            t, record = trajectories[t_id], self._records[t_id]
            parent = record.node(turn - 1) if turn > 0 else -1
            parent = t.group if parent < 0 else parent
            record.path.append((turn, self._node(parent)))
            for c in range(1, k):
                child = copy.deepcopy(t, memo={id(t.row): t.row})
                child.index = t.index + c * span
                trajectories.append(child)
                self._records.append(_Record(born=turn, path=[*record.path[:-1], (turn, self._node(parent))]))
                requests.append((len(trajectories) - 1, t_id))
        if not requests:
            return []
        replies = runtime.fork(requests)
        for reply in replies:
            self.fork_seconds += reply.seconds
            if reply.status == OK:
                self.forks[reply.value.how] += 1
                self.fork_calls += reply.value.calls
            else:
                self.fork_failures += 1
        return [(child, reply) for (child, _), reply in zip(requests, replies)]

    def leaves(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """The ``G`` leaves of each row, depth first: each trajectory, then copies of it for the
        leaves below a branch point it ended before."""
        G = self.schedule.leaves
        by_row: dict[int, list[int]] = {}
        for t_id, t in enumerate(trajectories):
            by_row.setdefault(t.group, []).append(t_id)
        out, records = [], []
        self.copies = 0
        for group in sorted(by_row):
            ids = sorted(by_row[group], key=lambda t_id: trajectories[t_id].index)
            firsts = [trajectories[t_id].index for t_id in ids] + [G]
            for n, t_id in enumerate(ids):
                t = trajectories[t_id]
                out.append(t)
                records.append(self._records[t_id])
                for j in range(firsts[n] + 1, firsts[n + 1]):
                    twin = copy.deepcopy(t, memo={id(t.row): t.row})
                    twin.index = j
                    out.append(twin)
                    records.append(self._records[t_id])
                    self.copies += 1
        self._born = {id(t): self._records[t_id].born for t_id, t in enumerate(trajectories)}
        self._resets = sum(bool(trajectories[i].messages) for i in range(self.rows))  # each row's root trajectory
        self.leaf_records = records
        return out

    # ------------------------------------------------------------------ for the trainer
    def node_grid(self, segments: torch.Tensor, trajectory_ids: torch.Tensor, excluded: torch.Tensor, *,
                  shape: tuple[int, int]) -> torch.Tensor:
        """``[R, T-1]`` int64 node of each policy token on the log-prob grid (column ``c`` scores
        token ``c + 1``; -1 elsewhere and on excluded rows). ``segments [S, 4]`` ``(row, start,
        end, turn)`` and ``trajectory_ids [R]`` (index into the leaves) as ``AgentBatch`` has them."""
        grid = torch.full(shape, -1, dtype=torch.long)
        for row, start, end, turn in segments.tolist():
            if bool(excluded[row]):
                continue
            grid[row, start - 1:end - 1] = self.leaf_records[int(trajectory_ids[row])].node(turn)
        return grid

    @property
    def branch_points(self) -> int:
        """Nodes with two or more children (each a step group of siblings)."""
        counts: dict[int, int] = {}
        for p in self.parents:
            if p >= 0:
                counts[p] = counts.get(p, 0) + 1
        return sum(1 for c in counts.values() if c >= 2)

    def metrics(self, leaves: Sequence[Trajectory]) -> dict[str, float]:
        """The equal-budget figures of this rollout (see the module docstring); ``leaves`` from ``leaves``."""
        generated = leaf_tokens = steps = leaf_steps = 0
        seen: set[int] = set()
        for t in leaves:
            policy = [(s.turn, s.end - s.start) for sample in t.samples for s in sample.segments if s.role == "policy"]
            leaf_tokens += sum(n for _, n in policy)
            leaf_steps += len(t.turn_rewards) + bool(t.messages)
            if id(t) in self._born and id(t) not in seen:  # a trajectory that ran (not a copy): its own turns
                seen.add(id(t))
                born = self._born[id(t)]
                generated += sum(n for turn, n in policy if turn >= born)
                steps += sum(1 for k in range(len(t.turn_rewards)) if k >= born)
        return {
            names.GENERATED_TOKENS: float(generated),
            names.TREE_LEAF_TOKENS: float(leaf_tokens),
            names.TREE_BRANCH_POINTS: float(self.branch_points),
            names.TREE_COPIES: float(self.copies),
            names.ENV_CALLS: float(self._resets + steps + self.fork_calls),
            names.TREE_LEAF_ENV_CALLS: float(leaf_steps),
            names.FORKS_NATIVE: float(self.forks["fork"]),
            names.FORKS_REPLAYED: float(self.forks["replay"]),
            names.FORK_FAILURES: float(self.fork_failures),
        }


def tree_token_sampler(sampler: Any, sampling: Any) -> Any:
    """The driver's ``TokenSampler`` for a branching rollout: ``ForkingTokenSampler`` over a
    multi-turn sampler (the HF sampler), each turn's token ids for the others (vLLM's prefix
    caching shares the prefix): ``fastrl.rollout.token_sampler.token_sampler_for(fork=True)``."""
    return token_sampler_for(sampler, sampling, fork=True)
