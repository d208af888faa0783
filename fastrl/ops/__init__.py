"""Public differentiable ops: validation, autograd and backend dispatch.

Each op takes ``backend="auto" | "triton" | "torch"``: auto runs the Triton kernel on
CUDA tensors and the PyTorch path otherwise.
"""

from fastrl.ops.aggregation import GlobalCounts, aggregate_loss
from fastrl.ops.advantages import group_advantages, step_advantages
from fastrl.ops.decode_attention import DecodeAttentionPlan, prepare_decode_attention, shared_prefix_decode_attention
from fastrl.ops.fused_policy_loss import fused_linear_policy_loss
from fastrl.ops.kl import kl_penalty
from fastrl.ops.logprobs import linear_logprobs
from fastrl.ops.packing import PackedLayout
from fastrl.ops.policy_loss import policy_loss
from fastrl.ops.scans import discounted_returns, gae
from fastrl.ops.shared_prefix_attention import PackedGroups, SharedPrefixLayout, shared_prefix_attention
from fastrl.ops.tree_attention import PackedTree, TreeLayout, tree_attention
from fastrl.ops.turn_advantages import place_turn_rewards, turn_advantages, turn_gae, turn_index_from_spans
from fastrl.ops.value_loss import value_loss
from fastrl.ops.whiten import masked_whiten

__all__ = [
    "GlobalCounts",
    "aggregate_loss",
    "discounted_returns",
    "fused_linear_policy_loss",
    "gae",
    "group_advantages",
    "kl_penalty",
    "linear_logprobs",
    "masked_whiten",
    "policy_loss",
    "shared_prefix_decode_attention",
    "step_advantages",
    "turn_advantages",
    "turn_gae",
    "place_turn_rewards",
    "turn_index_from_spans",
    "value_loss",
]
__all__ += ["PackedLayout", "PackedGroups", "SharedPrefixLayout", "shared_prefix_attention"]
__all__ += ["PackedTree", "TreeLayout", "tree_attention"]
__all__ += ["DecodeAttentionPlan", "prepare_decode_attention"]
