"""The sampler registry: each sampler a run can name, what it needs and how it is built.

Samplers are a registry (``SAMPLERS``): each entry declares what it needs instead of the
trainer testing names. A new sampler is one entry here (plus its class in
``fastrl/rollout/`` implementing ``GroupSampler``); ``TrainConfig.sampler`` takes the
registry's names. A server sampler is reached (``SamplerSpec.connect``) and checked against
the policy (``check_served_model``) before any long work.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from fastrl.errors import InputError
from fastrl.rollout.base import GroupSampler
from fastrl.train.config import TrainConfig

if TYPE_CHECKING:
    from fastrl.rollout.remote import VLLMServerSampler

__all__ = ["SAMPLERS", "SamplerContext", "SamplerSpec", "build_sampler", "check_served_model", "sampler_spec"]


# ---------------------------------------------------------------------------- samplers
@dataclass(frozen=True)
class SamplerContext:
    """What a sampler may be built from."""

    cfg: TrainConfig
    policy: torch.nn.Module
    """The trainer's policy (sharded under torchrun)."""
    full_copy: torch.nn.Module | None
    """Under torchrun, the unsharded copy of the policy that the trainer refreshes after each update."""
    pad_token_id: int
    output_dir: Path
    max_length: int | None
    connected: GroupSampler | None = None
    """What the entry's ``connect`` returned (a server client), else None."""


@dataclass(frozen=True)
class SamplerSpec:
    """A registry entry: how to build a sampler and what it needs from the trainer."""

    build: Callable[[SamplerContext], GroupSampler]
    own_weights: bool
    """The sampler holds a copy of the weights of its own: the trainer pushes the policy into
    it (``update_weights``) before the first rollout and after every update. False: it runs
    the trainer's module (the policy, or under torchrun the trainer's full copy)."""
    torchrun: str | None = None
    """None: usable under torchrun; else the reason it is not (an error before any work)."""
    needs_url: bool = False
    """Takes ``sampler_url`` (a server shared by every rank)."""
    connect: Callable[[TrainConfig], GroupSampler] | None = None
    """Reached before any long work (a server: is it up, what does it serve); its result is
    ``SamplerContext.connected``."""
    push_on_start: bool = False
    """Its weights come from elsewhere (a server started from a model folder): the trainer
    pushes the policy's (after warm-up or resume) before the first rollout."""


VLLM_BLOCK_SIZE = 32
"""KV-cache block size of the in-process vLLM engine (tokens)."""

SERVER_CONNECT_TIMEOUT_S = 30.0
"""Longest wait for a vllm-server to answer its first request (at most ``sampler_timeout``)."""


def _hf(ctx: SamplerContext) -> GroupSampler:
    from fastrl.rollout import HFGroupSampler

    return HFGroupSampler(ctx.full_copy if ctx.full_copy is not None else ctx.policy, pad_token_id=ctx.pad_token_id,
                          decode=ctx.cfg.sampler_decode)


def _vllm(ctx: SamplerContext) -> GroupSampler:
    from fastrl.rollout import VLLMGroupSampler

    init = ctx.output_dir / "sampler_init"
    ctx.policy.save_pretrained(init, safe_serialization=True)
    return VLLMGroupSampler(str(init), block_size=VLLM_BLOCK_SIZE, max_model_len=ctx.max_length, seed=ctx.cfg.seed)


def _connect_server(cfg: TrainConfig) -> GroupSampler:
    from fastrl.rollout.remote import VLLMServerSampler

    return VLLMServerSampler(cfg.sampler_url, timeout=cfg.sampler_timeout, connect_timeout=min(SERVER_CONNECT_TIMEOUT_S, cfg.sampler_timeout))


SAMPLERS: dict[str, SamplerSpec] = {
    # the shared-prefix HF sampler on the policy module itself: no copy, no push
    "hf": SamplerSpec(build=_hf, own_weights=False),
    # an in-process vLLM engine from a saved copy of the policy
    "vllm": SamplerSpec(
        build=_vllm, own_weights=True,
        torchrun="sampler='vllm' (an engine inside the training process) is single-process only; under torchrun the ranks "
                 "share one engine through `fastrl vllm-server` (--sampler vllm-server URL), or each samples with sampler=hf",
    ),
    # one `fastrl vllm-server` shared by every rank; rank 0 uploads the weights
    "vllm-server": SamplerSpec(build=lambda ctx: ctx.connected, own_weights=True, needs_url=True, connect=_connect_server,
                               push_on_start=True),
}


def sampler_spec(name: str) -> SamplerSpec:
    if name not in SAMPLERS:
        raise InputError(f"sampler must be one of {sorted(SAMPLERS)}, got {name!r}")
    return SAMPLERS[name]


def build_sampler(spec: SamplerSpec, ctx: SamplerContext) -> GroupSampler:
    return spec.build(ctx)


def check_served_model(sampler: VLLMServerSampler, *, cfg: TrainConfig, policy: torch.nn.Module, longest: int) -> None:
    """A server sampler serves the policy's architecture and takes the run's longest sequence."""
    served = getattr(sampler, "info", {}).get("model") or {}
    differ = [f"{k} {v!r} (policy: {getattr(policy.config, k, None)!r})" for k, v in served.items()
              if v != getattr(policy.config, k, None)]
    if differ:
        raise InputError(
            f"the vLLM server at {cfg.sampler_url} serves another architecture: {', '.join(differ)}; start it with "
            "the policy's model folder (`fastrl vllm-server --model DIR`)"
        )
    if sampler.max_model_len < longest:
        raise InputError(
            f"the vLLM server at {cfg.sampler_url} takes at most {sampler.max_model_len} tokens, this run needs "
            f"{longest} (longest prompt + max_new_tokens): restart it with --max-model-len {longest}"
        )
