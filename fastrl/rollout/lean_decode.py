"""A lean forward of the decoder layers for the sampler's decode steps (Llama, Qwen2).

At small shapes a decode step is dominated by per-op and per-module overhead, not FLOPs: the
``transformers`` layers run about 100 tensor ops and a dozen module calls per layer (RMSNorm
as six ops, rotary embeddings as seven per tensor, ...). :class:`LeanDecoder` runs the same
layers with the same weights in fewer ops: ``F.rms_norm`` (one fused op), rotary embeddings as
``x * cos + flip(x) * sin'`` (three ops per tensor), the MLP with in-place ``silu`` and product,
in-place residual adds, and the sampler's attention called directly. The model is not
changed and no weight is copied.

It is used only for models whose modules are exactly the ones it reimplements
(:func:`lean_decoder` checks the classes and the config: SiLU MLP, RMSNorm, full attention, no
extra norms, no forward hooks on its modules), in fp32 (other dtypes keep the model's own forward, whose casts it would have to
copy). The sampler checks it once, at its first prefill, against the model's forward before
relying on it (``HFGroupSampler``; a model that fails the check keeps its own forward). Hooks or
module swaps made on the layers after that first rollout are not seen: build a new sampler.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["LeanDecoder", "lean_decoder", "SUPPORTED_LAYERS"]

SUPPORTED_LAYERS = (
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
)
"""(module, decoder layer, attention, MLP, RMSNorm) class names the lean forward reimplements."""

Attend = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _classes() -> list[tuple[type, type, type, type]]:
    import importlib

    out = []
    for mod, *names in SUPPORTED_LAYERS:
        try:
            m = importlib.import_module(mod)
        except ImportError:  # an older transformers without this model
            continue
        out.append(tuple(getattr(m, n) for n in names))
    return out


def _hooked(base: torch.nn.Module) -> bool:
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for name, m in base.named_modules() if name != "embed_tokens")


def lean_decoder(model: torch.nn.Module) -> "LeanDecoder | None":
    """The lean forward for ``model`` (a ``transformers`` causal LM), or None when its modules
    are not exactly the supported ones (then the sampler keeps the model's own forward)."""
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    config = getattr(model, "config", None)
    if base is None or layers is None or config is None or len(layers) == 0:
        return None
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return None
    if not all(hasattr(base, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return None
    weight = base.embed_tokens.weight
    if weight.dtype != torch.float32:
        return None
    if _hooked(base):  # hooks on the layers would be skipped (the lean forward calls no layer module)
        return None
    for layer_t, attn_t, mlp_t, norm_t in _classes():
        if type(base.norm) is not norm_t:
            continue
        ok = all(
            type(l) is layer_t and type(l.self_attn) is attn_t and type(l.mlp) is mlp_t
            and type(l.input_layernorm) is norm_t and type(l.post_attention_layernorm) is norm_t
            and getattr(l.self_attn, "sliding_window", None) is None
            and all(isinstance(getattr(l.self_attn, p), torch.nn.Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and all(isinstance(getattr(l.mlp, p), torch.nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))
            for l in layers
        )
        if ok and len(layers) == config.num_hidden_layers:
            return LeanDecoder(base)
    return None


class LeanDecoder:
    """``(input_ids [B, T], position_ids [B, T], attend) -> last hidden states [B, T, H]`` (after
    the final norm) of a Llama/Qwen2 base model, with ``attend(module, q, k, v, scaling)`` the
    attention (``q`` ``[B, Hq, T, D]``, ``k``/``v`` ``[B, Hkv, T, D]``, returns ``[B, T, Hq, D]``)."""

    def __init__(self, base: torch.nn.Module):
        self.base = base
        self.layers = list(base.layers)
        a = self.layers[0].self_attn
        self.head_dim = int(a.head_dim)
        self.hidden = int(base.embed_tokens.weight.shape[1])

    @staticmethod
    def _norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
        B, T = input_ids.shape
        D = self.head_dim
        h = self.base.embed_tokens(input_ids)  # [B, T, H] (the module: its hooks see what is run)
        cos, sin = self.base.rotary_emb(h, position_ids)  # [B, T, D]
        half = D // 2
        # rotate_half(x) * sin == flip_halves(x) * sin', sin' = [-sin_1, sin_2]
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos4, sin4 = cos[:, :, None, :], sin_signed[:, :, None, :]  # broadcast over heads

        def rope(x: torch.Tensor) -> torch.Tensor:  # [B, T, heads, D]
            flipped = x.view(B, T, -1, 2, half).flip(-2).view(x.shape)
            return torch.addcmul(x * cos4, flipped, sin4)

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            x = self._norm(h, layer.input_layernorm)
            q = rope(F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(B, T, -1, D))
            k = rope(F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(B, T, -1, D))
            v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(B, T, -1, D)
            o = attend(attn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), float(attn.scaling))
            h = h.add_(F.linear(o.reshape(B, T, -1), attn.o_proj.weight, attn.o_proj.bias))
            x = self._norm(h, layer.post_attention_layernorm)
            g = F.silu(F.linear(x, mlp.gate_proj.weight), inplace=True).mul_(F.linear(x, mlp.up_proj.weight))
            h = h.add_(F.linear(g, mlp.down_proj.weight))
        return self._norm(h, self.base.norm)
