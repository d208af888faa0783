"""The policy module of a run: where it comes from (a resumed checkpoint, the given model,
the built-in tiny model or ``cfg.model``), the device it trains on, and what it must support
(shared-prefix attention for packed layouts, activation checkpointing)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from fastrl.errors import InputError
from fastrl.train.config import TrainConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["check_shared_prefix_support", "device_of", "enable_checkpointing", "load_model"]


def device_of(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda[:N]`` (``TrainConfig.device``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device={name!r} but CUDA is not available on this machine")
    return device


def load_model(cfg: TrainConfig, *, model: torch.nn.Module | None, tokenizer: PreTrainedTokenizerBase | None,
               resume_dir: Path | None, device: torch.device) -> tuple[PreTrainedTokenizerBase, torch.nn.Module]:
    """``(tokenizer, policy)`` in train mode on ``device``: a resumed checkpoint's policy, the
    given model, the built-in tiny model, or ``cfg.model``."""
    import transformers

    if resume_dir is not None and model is None:
        # the checkpoint holds the policy (after warm-up and the steps so far)
        path = resume_dir / "policy"
        tok = tokenizer or transformers.AutoTokenizer.from_pretrained(path)
        policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return tok, policy.to(device).train()
    if model is not None:
        if tokenizer is None:
            raise InputError("a model passed to Trainer needs its tokenizer too (tokenizer=...)")
        if resume_dir is not None:  # continue from the checkpoint's weights, not the given ones
            saved = transformers.AutoModelForCausalLM.from_pretrained(resume_dir / "policy", dtype=torch.float32)
            model.load_state_dict(saved.state_dict())
        return tokenizer, model.to(device).train()
    if cfg.model is None:
        from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

        default = DefaultTask()
        tok = char_tokenizer()
        # an agent run's tiny model takes its longest trajectory
        positions = default.max_position_embeddings if cfg.env is None else cfg.max_trajectory_tokens
        policy = tiny_model(
            tok, hidden_size=cfg.model_hidden_size, layers=cfg.model_layers, heads=cfg.model_heads, arch=default.arch,
            max_position_embeddings=positions, seed=cfg.seed,
        )
        return tok, policy.to(device).train()
    tok = transformers.AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
    policy = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    return tok, policy.to(device).train()

def enable_checkpointing(models: Sequence[torch.nn.Module | None]) -> None:
    """Activation checkpointing per decoder layer (non-reentrant) on every model given."""
    for m in models:
        if m is None:
            continue
        if not getattr(m, "supports_gradient_checkpointing", False):
            raise InputError(f"{type(m).__name__} does not support gradient checkpointing; set activation_checkpointing=off")
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def check_shared_prefix_support(model: torch.nn.Module) -> None:
    from fastrl.ops.hf_packed import check_shared_prefix_support as check

    try:
        check(model)
    except ValueError as e:
        raise InputError(f"{e}; set shared_prefix=false (and prefix_tree=false) to train on padded rows") from None

