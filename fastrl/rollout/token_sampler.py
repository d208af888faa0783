"""The agents driver's token samplers over a run's group sampler, and the one factory that picks one.

The driver asks one thing of a sampler: "continue these token sequences by up to ``n`` tokens"
(``TokenSampler.continue_sequences`` in ``fastrl.agents.driver``). Three answers live here:

- :class:`GroupSamplerTokens`, over any ``GroupSampler`` (HF, vLLM, the vLLM server, the
  sampler process): each turn passes the whole history as the prompt (``generate`` with
  ``group_size=1``, one seed per sequence). Correct, not fast: the history is prefilled again
  every turn, unless the engine's prefix caching finds it (vLLM).
- :class:`HFTokenSampler`, over a sampler that declares the multi-turn capability
  (``supports_multi_turn``: ``HFGroupSampler``): each sequence continues the live trajectory of
  one multi-turn state whose tokens it extends, so turn ``k`` runs only the new tokens.
- :class:`ForkingTokenSampler`, the same for branching rollouts: when several sequences extend
  one live trajectory (siblings right after a branch point) it forks that trajectory
  (:meth:`HFTokenSampler.fork_siblings`, ``fastrl.rollout.branch.fork_trajectories``) so each
  sibling continues its own copy of the shared keys/values.

:func:`token_sampler_for` is the one place that chooses among them, from the sampler's declared
capability (never its class). :class:`TurnOutput` is what each continued sequence returns (the
driver's ``Continuation`` is this record).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from fastrl.rollout.base import GroupSampler, SamplingConfig, supports_multi_turn
from fastrl.rollout.branch import fork_trajectories

__all__ = ["TurnOutput", "GroupSamplerTokens", "HFTokenSampler", "ForkingTokenSampler", "token_sampler_for"]


@dataclass
class TurnOutput:
    """One trajectory's new tokens of a turn (the agents driver's ``Continuation``)."""

    token_ids: list[int]
    """The sampled tokens (ending with the stop token when ``stopped``)."""
    logprobs: list[float]
    """The sampler's log-prob of each (the tempered, filtered distribution)."""
    stopped: bool
    """A stop token ended the turn (else its token limit did)."""


class GroupSamplerTokens:
    """``TokenSampler`` over any ``GroupSampler`` (``HFGroupSampler``, vLLM, server).

    Each turn passes the whole history as the prompt (``group_size=1``, one seed per
    sequence), so the history is prefilled again every turn: correct, not fast. Identical
    sequences (a group's first turn) are prefilled once by ``HFGroupSampler``. Continuing
    each trajectory's own KV across turns (turn k prefills only its new environment tokens)
    is :class:`HFTokenSampler`.
    """

    def __init__(self, sampler: Any, sampling: Any) -> None:
        self.sampler = sampler
        self.sampling = sampling
        self.max_length = getattr(sampler, "max_length", None) or getattr(sampler, "max_model_len", None)
        """Longest sequence the sampler accepts (prompt + new tokens), or None."""
        self.prefix_hits: list[float] = []
        """Each call's prefix-cache hit rate, where the sampler reports one (vLLM)."""

    def continue_sequences(self, sequences: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                           seeds: Sequence[int]) -> list[TurnOutput]:
        out: list[TurnOutput | None] = [None] * len(sequences)
        by_budget: dict[int, list[int]] = {}
        for index, n in enumerate(max_new_tokens):
            by_budget.setdefault(int(n), []).append(index)
        for n, indices in sorted(by_budget.items()):
            batch = self.sampler.generate(
                [list(sequences[i]) for i in indices], group_size=1,
                sampling=replace(self.sampling, max_new_tokens=n), prompt_seeds=[seeds[i] for i in indices],
            )
            if batch.stats.prefix_cache_hit_rate is not None:
                self.prefix_hits.append(float(batch.stats.prefix_cache_hit_rate))
            for k, index in enumerate(indices):
                out[index] = TurnOutput(
                    list(batch.completion_ids[k]), [float(x) for x in batch.completion_logp[k].tolist()],
                    batch.finish_reasons[k] == "stop",
                )
        return out  # type: ignore[return-value]


class HFTokenSampler:
    """The agents driver's ``TokenSampler`` (``continue_sequences``) over one multi-turn state
    of a sampler that declares the capability (``HFGroupSampler``): each sequence is matched to
    the live trajectory whose tokens it extends, and only the difference is run through the model.

    Sequences that extend no live trajectory (the first turn, or a sample the driver
    restarted from the template) start a new state for all sequences of that call (their
    prompts are prefilled; identical ones once). ``restarts`` counts those calls.
    """

    def __init__(self, sampler: Any, sampling: SamplingConfig) -> None:
        self.sampler = sampler
        self.sampling = sampling
        self.max_length = sampler.max_length
        self.state: Any = None
        """The open multi-turn state (``sampler.start``'s: ``fastrl.rollout.hf.MultiTurnState``), or None."""
        self._tokens: dict[int, list[int]] = {}
        """Each live trajectory's tokens (prompt and history): what a sequence must extend to continue it."""
        self.restarts = 0

    def _live_index(self) -> dict[tuple[int, ...], list[int]]:
        """The live trajectories by their tokens (several when forks share them)."""
        index: dict[tuple[int, ...], list[int]] = {}
        for t, toks in self._tokens.items():
            index.setdefault(tuple(toks), []).append(t)
        return index

    def _match(self, sequences: list[list[int]]) -> list[int] | None:
        if self.state is None:
            return None
        index = self._live_index()
        lengths = sorted({len(k) for k in index}, reverse=True)
        out = []
        for seq in sequences:
            hit = None
            for n in lengths:
                ids = index.get(tuple(seq[:n])) if n <= len(seq) else None
                if ids:
                    hit = ids.pop()
                    break
            if hit is None:
                return None
            out.append(hit)
        return out

    def fork_siblings(self, sequences: Sequence[Sequence[int]]) -> list[int]:
        """Fork the live trajectories that more of ``sequences`` extend than there are live
        copies of (siblings right after a branch point), so the next :meth:`continue_sequences`
        gives each sequence a trajectory of its own: each fork copies its parent's suffix
        keys/values (``fastrl.rollout.branch.fork_trajectories``; the prompt's stay shared) and
        its tokens. Each sequence counts for the longest live trajectory it extends. Returns the
        new trajectory ids (none without a live state)."""
        if self.state is None:
            return []
        index = self._live_index()
        lengths = sorted({len(k) for k in index}, reverse=True)
        demand: dict[tuple[int, ...], int] = {}
        for seq in sequences:
            for n in lengths:
                key = tuple(seq[:n])
                if n <= len(seq) and key in index:
                    demand[key] = demand.get(key, 0) + 1
                    break
        parents = [index[key][0] for key, n in demand.items() for _ in range(n - len(index[key]))]
        if not parents:
            return []
        new = fork_trajectories(self.state, parents)
        for t, parent in zip(new, parents):
            self._tokens[t] = list(self._tokens[parent])
        return new

    def continue_sequences(self, sequences: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                           seeds: Sequence[int]) -> list[TurnOutput]:
        seqs = [[int(x) for x in s] for s in sequences]
        ids = self._match(seqs)
        if ids is None:
            if self.state is not None:
                self.sampler.close(self.state)
            self.restarts += 1
            self.state = self.sampler.start(seqs, group_size=1, sampling=self.sampling)
            self._tokens = {t: list(s) for t, s in enumerate(seqs)}
            ids = list(range(len(seqs)))
        appended = [s[len(self._tokens[t]):] for t, s in zip(ids, seqs)]
        out = self.sampler.continue_(self.state, appended, trajectories=ids, max_new_tokens=list(max_new_tokens), seeds=list(seeds))
        self._tokens = {t: s + o.token_ids for t, s, o in zip(ids, seqs, out)}
        return out

    def close(self) -> None:
        if self.state is not None:
            self.sampler.close(self.state)
        self.state = None
        self._tokens = {}


class ForkingTokenSampler:
    """The driver's ``TokenSampler`` over a multi-turn sampler for branching rollouts: an
    :class:`HFTokenSampler` (each sequence continues the live trajectory whose tokens it
    extends) that, when several sequences extend the same live trajectory (siblings right
    after a branch point), first forks that trajectory (:meth:`HFTokenSampler.fork_siblings`)
    so each sibling continues its own copy of the shared keys/values instead of prefilling
    the history again; the sampler's decode path is untouched."""

    def __init__(self, sampler: Any, sampling: Any) -> None:
        self.inner = HFTokenSampler(sampler, sampling)
        self.max_length = self.inner.max_length
        self.forked = 0
        """Trajectories forked in the multi-turn state (shared keys/values copied, not recomputed)."""

    def continue_sequences(self, sequences: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                           seeds: Sequence[int]) -> list[TurnOutput]:
        seqs = [[int(x) for x in s] for s in sequences]
        self.forked += len(self.inner.fork_siblings(seqs))
        return self.inner.continue_sequences(seqs, max_new_tokens=max_new_tokens, seeds=seeds)

    @property
    def restarts(self) -> int:
        return self.inner.restarts

    def close(self) -> None:
        self.inner.close()


def token_sampler_for(sampler: GroupSampler, sampling: SamplingConfig, *, fork: bool = False) -> Any:
    """The driver's ``TokenSampler`` over the run's ``sampler``: trajectories that keep their
    keys/values across turns where the sampler declares the multi-turn capability
    (``supports_multi_turn``; with ``fork``, a branching rollout's siblings fork them:
    :class:`ForkingTokenSampler`, else :class:`HFTokenSampler`), each turn's whole token ids
    for the others (:class:`GroupSamplerTokens`; vLLM's prefix caching shares the prefix)."""
    if supports_multi_turn(sampler):
        return ForkingTokenSampler(sampler, sampling) if fork else HFTokenSampler(sampler, sampling)
    return GroupSamplerTokens(sampler, sampling)
