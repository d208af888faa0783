"""The PPO critic: a causal LM body with a scalar value head.

``ValueModel.values(input_ids, attention_mask, k)`` returns ``V(s_t)`` for the last ``k``
positions of each row, aligned exactly like ``causal_lm_logprobs(..., logits_to_keep=k)``:
column ``j`` is the value of the state *before* token ``T - k + j`` is generated (the hidden
state at position ``T - k + j - 1``), so ``values``, ``logp`` and the response mask share
one layout and GAE runs on it directly.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from fastrl.errors import InputError
from fastrl.ops.hf import causal_lm_hidden_states
from fastrl.ops.stats import explained_variance  # noqa: F401  (its home is ops; imported here by older callers)

if TYPE_CHECKING:
    from fastrl.train.config import TrainConfig

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_MARKER = "fastrl_critic.json"


class ValueModel(nn.Module):
    """A decoder (any HF causal LM; its LM head is unused) plus ``nn.Linear(hidden, 1)``."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body
        hidden = int(body.config.hidden_size)
        self.value_head = nn.Linear(hidden, 1)
        # A small head and a zero bias: the first values are near 0, the scale of centred returns.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(body.parameters()).device)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> "ValueModel":
        """A critic whose body is a copy of the policy (the usual PPO-RLHF initialisation)."""
        return cls(copy.deepcopy(policy))

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int) -> torch.Tensor:
        """``[B, k]`` fp32 values of the states before each of the last ``k`` tokens."""
        return self.head(causal_lm_hidden_states(self.body, input_ids, attention_mask, logits_to_keep=k))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Values from last hidden states ``[..., H]`` -> ``[...]`` fp32."""
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike) -> None:
        """The body as a Hugging Face model directory plus the value head (safetensors)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        self.body.save_pretrained(directory, safe_serialization=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.value_head.state_dict().items()}, directory / VALUE_HEAD_FILE)
        (directory / CRITIC_MARKER).write_text(json.dumps({"format": "fastrl-critic", "version": 1}))

    @classmethod
    def load(cls, directory: str | os.PathLike, *, device: torch.device, dtype: torch.dtype = torch.float32) -> "ValueModel":
        """A critic from ``save()``'s directory, or from a plain model directory (new value head).

        A plain directory is how a GRPO run's final policy becomes the PPO critic's body
        (the hybrid GRPO -> PPO recipe: the critic starts from a model that already
        understands the task).
        """
        import transformers
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / "config.json").exists():
            raise InputError(f"critic_init {str(directory)!r} is not a model directory (no config.json)")
        body = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device)
        critic = cls(body)
        head = directory / VALUE_HEAD_FILE
        if head.exists():
            critic.value_head.load_state_dict(load_file(head, device=str(device)))
        return critic


def build_critic(cfg: TrainConfig, policy: torch.nn.Module, *, resume_dir: Path | None, device: torch.device) -> ValueModel:
    """PPO's critic: a single-process checkpoint's, ``critic_init``'s, or a copy of the policy
    with a new value head (a torchrun checkpoint's shards load after sharding)."""
    from fastrl.train.run.checkpoint import is_distributed_checkpoint

    if resume_dir is not None and not is_distributed_checkpoint(resume_dir):
        return ValueModel.load(resume_dir / "critic", device=device).train()
    if cfg.critic_init is not None:
        return ValueModel.load(cfg.critic_init, device=device).train()
    return ValueModel.from_policy(policy).train()

