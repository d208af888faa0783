"""Group samplers that encode each prompt once and share its KV cache across the group."""

from fastrl.rollout.base import GroupSampler, RolloutBatch, RolloutStats, SamplingConfig, pack_batch, validate_prompts
from fastrl.rollout.hf import HFGroupSampler

__all__ = [
    "GroupSampler",
    "HFGroupSampler",
    "RolloutBatch",
    "RolloutStats",
    "SamplingConfig",
    "pack_batch",
    "validate_prompts",
]
