"""Weight sync: the trained policy into the sampler, and the probe that checks it arrived.

After every update the sampler must sample from the new weights. A sampler that runs the
trainer's own module needs nothing; one that holds its own copy gets ``update_weights``;
under torchrun the trainer's full copy of the (sharded) policy is refreshed first and rank 0
uploads it to a shared server while the other ranks wait for the version it reports. The
probe compares the sampler's log-probs of a short greedy sequence with the trainer's.

The probe is short on purpose: its guarantee -- the sampler scores tokens with the
trainer's weights -- needs every weight to take part in scoring, not a long sequence. Any
token's log-prob runs every layer and the whole LM head (the log-softmax normaliser reads
every vocabulary row), so ``PROBE_TOKENS`` greedy tokens after the last
``PROBE_PROMPT_TOKENS`` tokens of the probe prompt check the same weights as a full-length
sequence did (what neither checks: embedding rows of tokens not in the sequence), at a
fixed cost that no longer grows with the prompt or ``max_new_tokens``: a 16-token prefill
and 4 one-row decode steps on the sampler, one 20-token forward on the trainer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from fastrl.ops.hf import causal_lm_logprobs
from fastrl.rollout.base import SamplingConfig
from fastrl.train import distributed as dist_mod

if TYPE_CHECKING:
    from fastrl.rollout.base import GroupSampler
    from fastrl.train.ranks import Ranks


__all__ = ["PROBE_PROMPT_TOKENS", "PROBE_TOKENS", "WeightSyncError", "check_gap", "probe_gap", "push_weights"]

FAILED_UPLOAD = -(1 << 40)
"""The version rank 0 contributes when its upload failed: the summed version is then negative on every rank."""

PROBE_TOKENS = 4
"""Greedy tokens of the weight-sync probe (at most ``max_new_tokens``): the positions compared."""

PROBE_PROMPT_TOKENS = 16
"""Tokens of the probe prompt the probe continues (its last ones): the context of the compared positions."""


class WeightSyncError(RuntimeError):
    """The sampler's log-probs disagree with the trainer's after a weight sync."""


@torch.no_grad()
def _copy_named_(module: torch.nn.Module, named) -> None:
    """Copy ``(name, tensor)`` pairs into ``module``'s parameters of those names."""
    params = dict(module.named_parameters())
    for name, t in named:
        params[name].copy_(t)


def push_weights(sampler: GroupSampler, *, policy: torch.nn.Module, full_copy: torch.nn.Module | None, own_weights: bool,
                 ranks: Ranks) -> None:
    """The policy's current weights into ``sampler`` (see the module docstring).

    ``own_weights``: the sampler holds a copy of its own. ``full_copy``: under torchrun, the
    unsharded copy the trainer keeps (the HF sampler runs it; checkpoints read it)."""
    if full_copy is None:  # one process
        if own_weights:
            sampler.update_weights(policy.state_dict().items())
        return
    _copy_named_(full_copy, dist_mod.full_named_tensors(policy))
    if not own_weights:
        return
    # rank 0 uploads the copy to the shared server; the others wait for its version (or its failure)
    version, error = 0, None
    if ranks.is_main:
        try:
            version = sampler.update_weights(full_copy.state_dict().items())
        except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
            version, error = FAILED_UPLOAD, e
    version = int(ranks.sum(version))
    if error is not None:
        raise error
    if version < 0:
        raise RuntimeError("rank 0 could not push the weights to the vLLM server (see its error)")
    sampler.expect_weights_version(version)


@torch.no_grad()
def probe_gap(sampler: GroupSampler, policy: torch.nn.Module, prompt: list[int], *, max_new_tokens: int,
              device: torch.device) -> float:
    """Largest |sampler log-prob - trainer log-prob| over a greedy continuation of the last
    ``PROBE_PROMPT_TOKENS`` tokens of ``prompt`` (``PROBE_TOKENS`` tokens at most; see the
    module docstring for why a short sequence keeps the guarantee)."""
    probe = sampler.generate(
        [list(prompt[-PROBE_PROMPT_TOKENS:])], group_size=1,
        sampling=SamplingConfig(greedy=True, temperature=1.0, max_new_tokens=min(PROBE_TOKENS, max_new_tokens)),
    )
    was_training = policy.training
    policy.eval()
    try:
        ids = probe.input_ids.to(device)
        k = len(probe.completion_ids[0])
        lp = causal_lm_logprobs(policy, ids, probe.attention_mask.to(device), logits_to_keep=k)
    finally:
        policy.train(was_training)
    return float((lp[0].float().cpu() - probe.completion_logp[0].float()).abs().max())


def check_gap(gap: float, *, tolerance: float, step: int) -> None:
    if not math.isfinite(gap) or gap > tolerance:
        raise WeightSyncError(
            f"step {step}: after the weight sync the sampler's log-probs differ from the trainer's by {gap:.3g} "
            f"(tolerance {tolerance:g}); the sampler is not running the trained weights"
        )
