"""fastrl: fused kernels and a lean orchestrator for LLM reinforcement learning."""

from fastrl import _moved
from fastrl.config import PolicyLossConfig

_moved.install()  # old import paths of moved modules keep working (fastrl._moved.MOVED_MODULES)

__version__ = "0.1.0"

__all__ = ["PolicyLossConfig", "__version__"]
