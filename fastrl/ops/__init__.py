"""Public differentiable ops: validation, autograd and backend dispatch.

Each op takes ``backend="auto" | "triton" | "torch"``: auto runs the Triton kernel on
CUDA tensors and the PyTorch path otherwise.
"""

from fastrl.ops.decode_attention import shared_prefix_decode_attention

__all__ = ["shared_prefix_decode_attention"]
