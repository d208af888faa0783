"""Public differentiable ops: validation, autograd and backend dispatch.

Each op takes ``backend="auto" | "triton" | "torch"``: auto runs the Triton kernel on
CUDA tensors and the PyTorch path otherwise.
"""

from fastrl.ops.logprobs import fused_linear_policy_loss, linear_logprobs

__all__ = ["linear_logprobs", "fused_linear_policy_loss"]
