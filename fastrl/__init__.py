"""fastrl: fused kernels and a lean orchestrator for LLM reinforcement learning."""

from fastrl.config import PolicyLossConfig

__version__ = "0.1.0"

__all__ = ["PolicyLossConfig", "__version__"]
