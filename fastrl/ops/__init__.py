"""Public differentiable ops: validation, autograd and backend dispatch.

Each op takes ``backend="auto" | "triton" | "torch"``: auto runs the Triton kernel on
CUDA tensors and the PyTorch path otherwise.
"""

from fastrl.ops.scans import discounted_returns, gae

__all__ = ["gae", "discounted_returns"]
