"""Public differentiable ops: validation, autograd and backend dispatch.

Each op takes ``backend="auto" | "triton" | "torch"``: auto runs the Triton kernel on
CUDA tensors and the PyTorch path otherwise.
"""

from fastrl.ops.kl import kl_penalty
from fastrl.ops.policy_loss import policy_loss

__all__ = ["kl_penalty", "policy_loss"]
