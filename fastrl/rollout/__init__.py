"""Group samplers that encode each prompt once and share its KV cache across the group."""

from fastrl.rollout.base import (
    GroupRollout,
    GroupSampler,
    RolloutBatch,
    RolloutStats,
    SamplingConfig,
    merge_rollouts,
    pack_batch,
    validate_prompt_seeds,
    validate_prompts,
)
from fastrl.rollout.hf import HFGroupSampler
from fastrl.rollout.remote import VLLMServerSampler  # a client: needs neither vllm nor a GPU
from fastrl.rollout.vllm import VLLMGroupSampler  # imports vllm only when constructed

__all__ = [
    "GroupRollout",
    "GroupSampler",
    "HFGroupSampler",
    "RolloutBatch",
    "RolloutStats",
    "SamplingConfig",
    "VLLMGroupSampler",
    "VLLMServerSampler",
    "merge_rollouts",
    "pack_batch",
    "validate_prompt_seeds",
    "validate_prompts",
]
