"""``fastrl plan``: peak memory of one RL training step, component by component, before running it.

``plan_memory(model_config, **options)`` counts the bytes of the tensors a GRPO/PPO step
holds on one device and returns a ``MemoryPlan``: the size of every component, the peak of
every phase of the step and the total (the largest phase). ``longest_trajectory`` searches
the longest response that fits a memory size. The CLI prints both as a table.

What is counted (bytes; ``N`` = parameters, ``s`` = bytes of the compute dtype: 4 for
fp32, 2 for bf16; ``n`` = tokens in a micro-batch, ``r`` = response tokens in it):

Persistent (every phase):
  weights ``s_w N`` (fp32: 4, bf16-mixed and bf16: 2); fp32 master weights ``4N``
  (bf16-mixed only); optimizer states: AdamW ``2 x 4N`` (fp32, bf16-mixed) or ``2 x 2N``
  (pure bf16: torch keeps states in the parameter dtype), 8-bit AdamW ``2N``, SGD
  (no momentum) 0 — all 0 on the device with ``optimizer_offload``; reference model and
  reward model ``s_w N`` each (frozen); PPO critic: a copy of the policy with a scalar head
  (``fastrl.train.critic.ValueModel``: it keeps the unused LM head) plus its own master
  weights and optimizer states over the parameters that get gradients.

Activations saved for backward by a Llama/Qwen2-style decoder layer, per token, counted
from what autograd saves in transformers 5 (checked with ``saved_tensors_hooks``):
  RMSNorm (x2): the fp32 input ``4H``, the normalised ``sH`` and the scaled output ``sH``
  (the next projections' input), and 4 bytes of ``rsqrt``;
  attention, SDPA/flash: ``s (2 q_dim + 2 kv_dim)`` (rotated q and k, v, output) plus the
  fp32 log-sum-exp ``4 heads``; eager: ``4 s q_dim`` (q, k and v repeated to all heads,
  output) plus the softmax probabilities ``(4 + s') heads T`` where ``T`` is the row length
  and ``s' = s`` if the compute dtype is not fp32 (the fp32 softmax and its cast) else 0;
  MLP (SwiGLU): ``4 s I`` (gate, silu(gate), up, their product).
  Per-layer checkpointing keeps only the layer input ``sH`` per layer (and recomputes one
  layer in backward); offloading those inputs leaves two layers' inputs on the device.
  The final norm keeps ``4H + sH``, the embedding the int64 ids (8 bytes).

Log-prob head (response tokens only, TRL's ``logits_to_keep``):
  fused (``fastrl.ops.linear_logprobs``): the hidden states of the response tokens ``sH``
  and O(1) fp32 statistics per token; in backward a ``[V, H]`` fp32 weight gradient, two
  ``[r, H]`` buffers and one ``[chunk, V]`` fp32 work buffer (``logprob_chunk_mb``; on
  CUDA the Triton kernel works in tiles, counted as 0);
  naive: the final-norm output ``sH`` for all tokens, the fp32 ``log_softmax`` output
  ``4V`` per response token; forward adds the logits ``sV`` (+ their fp32 copy ``4V`` in
  bf16); backward adds the gradient of the log-softmax output and of the logits ``8V``.

Backward is swept layer by layer from the top: at each point the device holds the saved
activations of the layers not yet processed, the gradients already produced and the
transient of the layer being processed, so the peak is taken where it really is (at the
start of backward when activations dominate, at the end when gradients do).

Phases (the total is the largest): rollout (KV cache ``2 layers kv_dim s`` per slot, with
``P + G L`` slots per group when the prompt's cache is shared, ``G (P + L)`` otherwise),
scoring (reference / old-log-prob forwards without gradients), policy forward+backward,
optimizer step (``foreach`` AdamW allocates one full-size temporary), critic
forward+backward and step.

Not counted: the CUDA context and allocator fragmentation (add ~1-2 GiB on a GPU; the
``overhead_gb`` option), the Python/torch runtime, tensors smaller than one per token per
layer (RoPE tables, masks), multi-GPU sharding (divide the sharded parts by hand).

Checked against real steps (``tests/commands/test_plan.py``: tiny Llama/Qwen2 models on CPU,
fresh process per configuration, peak RSS above a warmed-up baseline): GRPO with and
without a reference, PPO with a critic, fused and naive heads, SDPA and eager attention,
checkpointing, fp32 and bf16 agree within about 5%. Not measured there: bf16-mixed, the
shared-prefix forward, the rollout and scoring phases, CUDA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = [
    "BUILTIN_MODELS",
    "ModelShape",
    "MemoryPlan",
    "plan_memory",
    "longest_trajectory",
    "load_model_shape",
    "add_plan_arguments",
    "run_plan",
    "build_measured_step",
]

GiB = 2**30

ALGORITHMS = ("grpo", "grpo_noref", "ppo")
PRECISIONS = ("fp32", "bf16-mixed", "bf16")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
ATTENTIONS = ("sdpa", "eager")
KV_CACHE_MODES = ("transient", "resident", "none")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama/Qwen2-style decoder that decide its memory."""

    hidden: int
    """Hidden size H."""
    layers: int
    """Number of decoder layers."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (GQA when fewer than ``heads``)."""
    head_dim: int
    """Size of one head."""
    intermediate: int
    """MLP intermediate size I (SwiGLU: gate, up and down projections)."""
    vocab: int
    """Vocabulary size V (rows of the embedding and of the LM head)."""
    tied_embeddings: bool = False
    """The LM head shares the embedding matrix."""
    qkv_bias: bool = False
    """q/k/v projections have biases (Qwen2)."""
    name: str = "custom"
    """Where the shape came from (built-in name, path or hub id)."""

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * i + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Parameters of an untied LM head (0 when tied)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.embedding_params + self.layers * self.layer_params + self.hidden + self.head_params


# Shapes typed in from the published config.json of each model (Hugging Face hub, the file
# named in ``source``); only the fields that decide memory.
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936,
                         tied_embeddings=True, qkv_bias=True, source="Qwen/Qwen2.5-0.5B/config.json"),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936,
                         tied_embeddings=True, qkv_bias=True, source="Qwen/Qwen2.5-1.5B/config.json"),
    "qwen2.5-7b": dict(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064,
                       tied_embeddings=False, qkv_bias=True, source="Qwen/Qwen2.5-7B/config.json"),
    "llama-3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
                       tied_embeddings=False, qkv_bias=False, source="meta-llama/Meta-Llama-3-8B/config.json"),
    "llama-2-7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008, vocab=32000,
                       tied_embeddings=False, qkv_bias=False, source="meta-llama/Llama-2-7b-hf/config.json"),
}


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def shape_from_config(config: Any, *, name: str = "custom") -> ModelShape:
    """A ``ModelShape`` from a transformers ``PretrainedConfig`` or a config.json dict."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and "hidden_size" not in cfg:  # multimodal wrappers: the language model
        cfg = dict(text)
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    vocab = _get(cfg, "vocab_size")
    if None in (hidden, layers, heads, vocab):
        raise ValueError(
            f"config {name!r} lacks one of hidden_size, num_hidden_layers, num_attention_heads, vocab_size"
        )
    kv = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=hidden // heads)
    inter = _get(cfg, "intermediate_size", "n_inner", default=4 * hidden)
    model_type = str(cfg.get("model_type", ""))
    bias = bool(cfg.get("attention_bias", model_type.startswith("qwen2")))
    return ModelShape(
        hidden=int(hidden), layers=int(layers), heads=int(heads), kv_heads=int(kv), head_dim=int(head_dim),
        intermediate=int(inter), vocab=int(vocab), tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bias, name=name,
    )


def load_model_shape(model: str | Mapping[str, Any] | Any) -> ModelShape:
    """A ``ModelShape`` from a built-in name, a config.json path, a model folder, a config
    dict/object, or a hub id (through ``transformers.AutoConfig``, when the hub is reachable)."""
    if isinstance(model, ModelShape):
        return model
    if not isinstance(model, str):
        return shape_from_config(model)
    key = model.lower()
    if key in BUILTIN_MODELS:
        fields = {k: v for k, v in BUILTIN_MODELS[key].items() if k != "source"}
        return ModelShape(**fields, name=key)
    path = model
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return shape_from_config(json.load(f), name=model)
    try:
        from transformers import AutoConfig

        return shape_from_config(AutoConfig.from_pretrained(model), name=model)
    except Exception as e:  # offline, unknown id, gated model
        raise ValueError(
            f"cannot load a model config from {model!r} ({type(e).__name__}: {e}); pass a built-in name "
            f"({', '.join(BUILTIN_MODELS)}), a config.json, a model folder or a reachable hub id"
        ) from None


@dataclass
class MemoryPlan:
    """Bytes of each component and of each phase of one training step on one device."""

    model: str
    """Name of the model shape."""
    options: dict[str, Any]
    """The options the plan was computed with."""
    components: dict[str, int]
    """Bytes of each component, at its own peak (``*`` marks a component shown for comparison only)."""
    phases: dict[str, int]
    """Bytes held at the peak of each phase (persistent state included)."""
    tokens: dict[str, int]
    """Token counts: per micro-batch forward, response tokens scored, KV slots, per group."""
    params: int
    """Parameters of the policy."""
    notes: list[str] = field(default_factory=list)
    """Assumptions worth printing next to the numbers."""

    @property
    def total(self) -> int:
        """The peak of the step: the largest phase (bytes)."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["total"] = self.total
        d["peak_phase"] = self.peak_phase
        return d

    def table(self) -> str:
        """A printable table of components and phases (GiB)."""
        o = self.options
        lines = [
            f"fastrl plan: {self.model} ({_count(self.params)} params), {o['algorithm']}, {o['precision']}, "
            f"{o['optimizer']}{' (offloaded)' if o['optimizer_offload'] else ''}, "
            f"P={o['prompt_len']} L={o['response_len']} G={o['group_size']} x{o['prompts_per_micro_batch']} prompt(s)/micro-batch",
            f"  head: {'fused log-probs' if o['fused_logprobs'] else 'naive logits'}; attention: {o['attention']}; "
            f"checkpointing: {'per layer' if o['checkpointing'] else 'off'}"
            f"{' + input offload' if o['offload_layer_inputs'] else ''}; shared prefix: train "
            f"{'on' if o['shared_prefix'] else 'off'}, rollout {'on' if o['shared_prefix_rollout'] else 'off'}",
            f"  tokens: {self.tokens['forward']} per training forward, {self.tokens['response']} scored, "
            f"{self.tokens['kv_slots']} KV slots",
            f"  {'component':<34}{'GiB':>10}{'GB':>10}",
        ]
        for k, v in self.components.items():
            lines.append(f"  {k:<34}{v / GiB:>10.2f}{v / 1e9:>10.2f}")
        lines.append(f"  {'phase peaks':<34}{'GiB':>10}{'GB':>10}")
        for k, v in self.phases.items():
            mark = "  <- peak" if k == self.peak_phase else ""
            lines.append(f"  {k:<34}{v / GiB:>10.2f}{v / 1e9:>10.2f}{mark}")
        lines.append(f"  {'TOTAL (peak)':<34}{self.total / GiB:>10.2f}{self.total / 1e9:>10.2f}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _count(n: int) -> str:
    """A parameter count as 0.49B, 245K, ..."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else (f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K")


def _elem(precision: str) -> tuple[int, int, int, int]:
    """(weight bytes, grad bytes, master bytes, optimizer-state element bytes) for a precision."""
    if precision == "fp32":
        return 4, 4, 0, 4
    if precision == "bf16-mixed":
        return 2, 2, 4, 4
    return 2, 2, 0, 2  # pure bf16: torch keeps AdamW states in the parameter dtype


def _layer_saved_per_token(m: ModelShape, s: int, attention: str, row_len: int) -> int:
    """Bytes autograd saves per token in one decoder layer (see the module docstring)."""
    norm = 4 * m.hidden + 2 * s * m.hidden + 4
    if attention == "sdpa":
        attn = s * (2 * m.q_dim + 2 * m.kv_dim) + 4 * m.heads
    else:
        attn = 4 * s * m.q_dim + (4 + (s if s != 4 else 0)) * m.heads * row_len
    mlp = 4 * s * m.intermediate
    return 2 * norm + attn + mlp


def _layer_backward_transient_per_token(m: ModelShape, s: int, attention: str, row_len: int) -> int:
    """Gradient buffers alive while one layer runs backward: the MLP's input gradients
    (3 x I) and two hidden-size gradients; eager attention adds the fp32 gradients of the
    probabilities and of the scores (2 x 4 heads T)."""
    t = s * (3 * m.intermediate + 2 * m.hidden)
    if attention == "eager":
        t += 8 * m.heads * row_len
    return t


def _forward_transient_per_token(m: ModelShape, s: int, attention: str, row_len: int) -> int:
    """Largest set of tensors alive inside one layer's forward without gradients (MLP:
    gate, up and their product; hidden and residual), eager scores and probabilities."""
    t = s * (3 * m.intermediate + 2 * m.hidden)
    if attention == "eager":
        t = max(t, (8 + s) * m.heads * row_len)
    return t


def plan_memory(
    model_config: str | Mapping[str, Any] | ModelShape | Any,
    *,
    prompt_len: int,
    response_len: int,
    group_size: int = 8,
    prompts_per_micro_batch: int = 1,
    algorithm: str = "grpo",
    reference: bool | None = None,
    reward_model: bool = False,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    optimizer_offload: bool = False,
    checkpointing: bool = False,
    offload_layer_inputs: bool = False,
    shared_prefix: bool = False,
    shared_prefix_rollout: bool = True,
    fused_logprobs: bool = True,
    attention: str = "sdpa",
    kv_cache: str = "transient",
    device: str = "cuda",
    logprob_chunk_mb: float | None = None,
    foreach: bool = False,
    persistent_grads: bool = False,
    overhead_gb: float = 0.0,
) -> MemoryPlan:
    """Plan the peak device memory of one GRPO/PPO training step.

    Args:
        model_config: a built-in name (``BUILTIN_MODELS``), config.json path, model folder,
            hub id, transformers config, config dict or ``ModelShape``.
        prompt_len, response_len: P and L, tokens.
        group_size: G completions per prompt.
        prompts_per_micro_batch: groups in one training forward/backward.
        algorithm: "grpo" (policy + frozen reference), "grpo_noref" (no reference: KL off),
            "ppo" (policy + reference + critic: a copy of the policy with a value head,
            its own gradients and optimizer states).
        reference: override whether a reference model is held.
        reward_model: hold a learned reward model of the policy's shape (frozen, weights only).
        precision: "fp32", "bf16-mixed" (bf16 weights/grads, fp32 master weights and
            states) or "bf16" (everything bf16).
        optimizer: "adamw" (two states), "adamw8bit" (two 1-byte states), "sgd" (none).
        optimizer_offload: optimizer states and master weights live in CPU memory.
        checkpointing: per-decoder-layer activation checkpointing.
        offload_layer_inputs: with checkpointing, the saved layer inputs go to CPU.
        shared_prefix: training forward packs ``[prompt | c1 .. cG]``: P + G L tokens per
            group instead of G (P + L).
        shared_prefix_rollout: the sampler shares the prompt's KV cache across the group.
        fused_logprobs: fastrl's fused linear log-probs (no [tokens, V] logits) vs naive logits.
        attention: "sdpa" (flash/memory-efficient: O(T) saved) or "eager" ([heads, T, T]).
        kv_cache: "transient" (the sampler frees it before training: its own phase),
            "resident" (held through training, like a pre-allocated vLLM cache) or "none"
            (rollout runs elsewhere).
        device: "cuda" (the fused head runs the Triton kernel: tiles, no chunk buffer) or
            "cpu" (the PyTorch chunked head): decides the head's work buffer.
        logprob_chunk_mb: fused head work buffer; default 0 on CUDA, on CPU the PyTorch
            path's chunk (``FASTRL_LOGPROBS_CHUNK_MB``, 48: ``fastrl.ops.logprobs.DEFAULT_CHUNK_MB``).
        foreach: AdamW's multi-tensor step (torch's default on CUDA) allocates one
            state-size temporary (and an fp32 copy of bf16 gradients); False: a fused
            (``fused=True``, DeepSpeed's fused Adam) or per-tensor step, whose temporaries
            are at most one parameter's size.
        persistent_grads: gradient buffers live through the whole step (DeepSpeed /
            Megatron contiguous buffers, ``zero_grad(set_to_none=False)``) instead of being
            freed after each optimizer step (``set_to_none=True``, fastrl's trainer): then the
            policy's and the critic's gradients are held at the same time.
        overhead_gb: added to every phase (CUDA context, allocator slack).
    """
    m = load_model_shape(model_config)
    for name, value, low in (("prompt_len", prompt_len, 0), ("response_len", response_len, 1),
                             ("group_size", group_size, 1), ("prompts_per_micro_batch", prompts_per_micro_batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    for name, value, allowed in (("algorithm", algorithm, ALGORITHMS), ("precision", precision, PRECISIONS),
                                 ("optimizer", optimizer, OPTIMIZERS), ("attention", attention, ATTENTIONS),
                                 ("kv_cache", kv_cache, KV_CACHE_MODES), ("device", device, DEVICES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if offload_layer_inputs and not checkpointing:
        raise ValueError("offload_layer_inputs needs checkpointing=True (it offloads the checkpointed layer inputs)")
    options = {k: v for k, v in locals().items() if k not in ("m", "model_config", "name", "value", "low", "allowed")}

    P, L, G, B = prompt_len, response_len, group_size, prompts_per_micro_batch
    s_w, s_g, s_master, s_state = _elem(precision)
    s = s_w  # activations are in the weights' dtype
    has_ref = (algorithm != "grpo_noref") if reference is None else bool(reference)
    has_critic = algorithm == "ppo"
    if logprob_chunk_mb is None:
        logprob_chunk_mb = 0.0 if device == "cuda" else float(os.environ.get("FASTRL_LOGPROBS_CHUNK_MB", "48"))
    chunk_bytes = int(logprob_chunk_mb * 2**20)

    n_params = m.params
    n_tok = B * (P + G * L) if shared_prefix else B * G * (P + L)
    row_len = (P + G * L) if shared_prefix else (P + L)
    n_resp = B * G * L
    kv_slots = B * (P + G * L) if shared_prefix_rollout else B * G * (P + L)
    states_per_param = {"adamw": 2 * s_state, "adamw8bit": 2, "sgd": 0}[optimizer]

    # ----------------------------------------------------------------- persistent state
    def trained_state(n_weights: int, n_trained: int) -> dict[str, int]:
        return {
            "weights": s_w * n_weights,
            "master": 0 if optimizer_offload else s_master * n_trained,
            "states": 0 if optimizer_offload else states_per_param * n_trained,
        }

    g_live = 0 if persistent_grads else 1  # gradients counted in the phases (else in the persistent state)
    pol = trained_state(n_params, n_params)
    comps: dict[str, int] = {"policy weights": pol["weights"]}
    if s_master:
        comps["fp32 master weights"] = pol["master"]
    comps["gradients"] = s_g * n_params
    comps["optimizer states"] = pol["states"]
    persistent = pol["weights"] + pol["master"] + pol["states"] + (1 - g_live) * comps["gradients"]
    if has_ref:
        comps["reference model"] = s_w * n_params
        persistent += comps["reference model"]
    body_params = n_params - m.head_params  # a scalar-head model has no LM head
    if reward_model:
        comps["reward model"] = s_w * (body_params + m.hidden + 1)
        persistent += comps["reward model"]
    critic_trained = body_params + m.hidden + 1
    if has_critic:
        cr = trained_state(n_params + m.hidden + 1, critic_trained)  # ValueModel keeps the unused LM head
        comps["critic weights+master+states"] = cr["weights"] + cr["master"] + cr["states"]
        comps["critic gradients"] = s_g * critic_trained
        persistent += comps["critic weights+master+states"] + (1 - g_live) * comps["critic gradients"]

    kv_bytes = 2 * m.layers * m.kv_dim * s * kv_slots
    comps["rollout KV cache"] = kv_bytes if kv_cache != "none" else 0
    if kv_cache == "resident":
        persistent += kv_bytes

    # ----------------------------------------------------------------- policy forward + backward
    full_layer = n_tok * _layer_saved_per_token(m, s, attention, row_len)
    if checkpointing:
        per_layer = n_tok * s * m.hidden  # only the layer input is kept
        recompute = full_layer  # one layer's activations, rebuilt in backward
    else:
        per_layer, recompute = full_layer, 0
    # with offload only the inputs of the layers in flight (two) stay on the device
    stored = (lambda k: min(2, k)) if offload_layer_inputs else (lambda k: k)
    g_layer = g_live * s_g * m.layer_params
    layer_bwd = n_tok * _layer_backward_transient_per_token(m, s, attention, row_len)
    final_norm = n_tok * (4 * m.hidden + s * m.hidden + 4)
    batch = n_tok * 8 + n_resp * 40  # token ids; fp32 loss inputs and outputs per response token

    def sweep(head_saved: int, head_fwd: int, head_bwd: int, head_grad: int) -> tuple[int, int, int]:
        """(activations saved, forward-end peak, backward peak), above the persistent state.

        Backward runs the head first (its transient plus its weight gradient), then the
        layers from the top: each frees its activations and adds its gradients; the
        embedding's dense gradient comes last (for a tied head it is summed into the
        head's gradient, a transient of the same size)."""
        acts = stored(m.layers) * per_layer + final_norm
        saved = acts + head_saved + batch
        fwd_peak = saved + head_fwd
        peak = saved + head_bwd + head_grad
        grads = head_grad
        for k in range(1, m.layers + 1):  # layer (layers - k) runs backward
            below = stored(m.layers - k) * per_layer
            peak = max(peak, below + per_layer + batch + grads + g_layer + layer_bwd + recompute)
            grads += g_layer
        peak = max(peak, grads + g_live * s_g * m.embedding_params)
        return acts, fwd_peak, peak

    head_w = m.vocab * m.hidden
    chunk_live = chunk_bytes * (3 if s == 2 else 2) // 2  # the fp32 chunk, plus its bf16 cast
    fused_saved = n_resp * (s * m.hidden + 16)  # hidden rows of the scored tokens, lse and targets
    fused_bwd = 2 * n_resp * s * m.hidden + chunk_live + (4 * head_w if s_g != 4 else 0)  # + fp32 weight grad before its cast
    naive_saved = n_tok * s * m.hidden + n_resp * 4 * m.vocab  # LM head input, fp32 log_softmax output
    naive_fwd = n_resp * m.vocab * (s + (4 if s != 4 else 0))  # logits (+ fp32 copy)
    naive_bwd = n_resp * 8 * m.vocab  # fp32 gradients of the log_softmax output and of the logits
    if fused_logprobs:
        acts, fwd_peak, bwd_peak = sweep(fused_saved, chunk_bytes, fused_bwd, g_live * s_g * head_w)
        comps["logits: fused head"] = fused_saved + max(chunk_bytes, fused_bwd)
        comps["*logits: naive (not counted)"] = naive_saved + max(naive_fwd, naive_bwd)
    else:
        acts, fwd_peak, bwd_peak = sweep(naive_saved, naive_fwd, naive_bwd, g_live * s_g * head_w)
        comps["logits: naive"] = naive_saved + max(naive_fwd, naive_bwd)
        comps["*logits: fused (not counted)"] = fused_saved + max(chunk_bytes, fused_bwd)
    comps["activations (saved for backward)"] = acts
    comps["batch and loss tensors"] = batch

    # optimizer step: gradients alive plus the step's temporaries
    if optimizer == "adamw" and not optimizer_offload:
        largest = max(m.embedding_params, m.head_params, m.layer_params)
        step_tmp = (s_state * n_params if foreach else s_state * largest) + (4 * n_params if s_master and foreach else 0)
    else:
        step_tmp = 0
    comps["optimizer step temporaries"] = step_tmp

    phases: dict[str, int] = {}
    if kv_cache == "transient":
        prefill = (P if shared_prefix_rollout else G * P) * B * _forward_transient_per_token(m, s, attention, P)
        phases["rollout (KV cache)"] = persistent + kv_bytes + prefill + 4 * B * G * m.vocab
    # scoring: reference and old-log-prob forwards without gradients
    score_head = chunk_bytes + n_resp * 8 if fused_logprobs else n_resp * m.vocab * (s + 4)
    phases["scoring (no-grad forwards)"] = persistent + n_tok * (_forward_transient_per_token(m, s, attention, row_len) + 2 * s * m.hidden) + score_head
    phases["policy forward"] = persistent + fwd_peak
    phases["policy backward"] = persistent + bwd_peak
    phases["optimizer step"] = persistent + g_live * s_g * n_params + step_tmp
    if has_critic:
        # the value head's input is a slice of the final-norm output: the whole output is kept
        c_acts, c_fwd, c_bwd = sweep(n_tok * s * m.hidden, 0, 0, g_live * s_g * (m.hidden + 1))
        comps["critic activations"] = c_acts
        phases["critic forward+backward"] = persistent + c_bwd
        phases["critic step"] = persistent + g_live * s_g * critic_trained + (
            (s_state * critic_trained if foreach else s_state * max(m.embedding_params, m.layer_params))
            if optimizer == "adamw" and not optimizer_offload else 0)
    overhead = int(overhead_gb * GiB)
    if overhead:
        comps["overhead (context, allocator)"] = overhead
        phases = {k: v + overhead for k, v in phases.items()}

    notes = []
    if kv_cache == "transient":
        notes.append("the rollout KV cache is freed before training (HF sampler); a resident cache (vLLM) adds to every phase: --kv_cache resident")
    if device == "cuda":
        notes.append("no CUDA context / allocator fragmentation counted unless --overhead_gb")
    tokens = {"forward": n_tok, "response": n_resp, "kv_slots": kv_slots, "per_group": P + G * L}
    return MemoryPlan(model=m.name, options=options, components=comps, phases=phases, tokens=tokens, params=n_params, notes=notes)


def longest_trajectory(
    model_config: Any, *, memory_gb: float, prompt_len: int, max_response_len: int = 1 << 22, **options: Any
) -> tuple[int, MemoryPlan | None]:
    """The longest ``response_len`` whose plan fits in ``memory_gb`` GiB, and its plan
    (``(0, None)`` when not even one response token fits). Binary search: memory grows
    monotonically with L."""
    shape = load_model_shape(model_config)
    limit = memory_gb * GiB

    def fits(length: int) -> MemoryPlan | None:
        plan = plan_memory(shape, prompt_len=prompt_len, response_len=length, **options)
        return plan if plan.total <= limit else None

    if fits(1) is None:
        return 0, None
    lo, hi = 1, 2
    while hi <= max_response_len and fits(hi) is not None:
        lo, hi = hi, hi * 2
    hi = min(hi, max_response_len + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid) is not None:
            lo = mid
        else:
            hi = mid
    return lo, fits(lo)


# ----------------------------------------------------------------------------- measurement


def _hf_config(arch: str, *, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int,
               attention: str, tied: bool = False):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    return cls(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=inter, vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=tied,
               attn_implementation=attention)


def build_measured_step(*, arch: str, model: dict, algorithm: str, precision: str, fused: bool, checkpointing: bool,
               prompt_len: int, response_len: int, group_size: int, foreach: bool = False):
    """A real training step to check a plan against, for ``fastrl.bench.memory``.

    Builds nothing yet: imports torch and transformers and runs a tiny warm-up step of the
    same architecture (lazy imports, the autograd engine and thread pools exist before the
    baseline is taken), then returns a callable that builds the models (policy; reference
    unless ``grpo_noref``; ``ValueModel`` critic for ``ppo``), the AdamW optimizers and their
    states (one short step), and runs one step: reference log-probs without gradients,
    policy log-probs (``fastrl.ops.hf.causal_lm_logprobs`` when ``fused``, else the naive
    logits + fp32 ``log_softmax``), ``fastrl.ops.policy_loss``, backward, AdamW step, then
    the critic's value loss, backward and step. ``model`` holds ``hidden, layers, heads,
    kv_heads, inter, vocab, attention`` of a Llama (``arch="llama"``) or Qwen2 model.
    """
    import copy

    import torch
    import transformers

    from fastrl.config import PolicyLossConfig
    from fastrl.ops import policy_loss
    from fastrl.ops.hf import causal_lm_logprobs
    from fastrl.train.critic import ValueModel

    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    P, L, G = prompt_len, response_len, group_size
    T = P + L
    cfg = _hf_config(arch, **model)
    loss_cfg = PolicyLossConfig(kl_coef=PolicyLossConfig.preset("grpo").kl_coef if algorithm != "grpo_noref" else 0.0)

    def policy_logp(policy, ids, mask):
        if fused:
            return causal_lm_logprobs(policy, ids, mask, logits_to_keep=L)
        # the naive path users run today (TRL's): logits of the scored tokens, fp32 log_softmax
        logits = policy(input_ids=ids, attention_mask=mask, logits_to_keep=L + 1, use_cache=False).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -L:, None]).squeeze(-1)

    def step(policy, ref, critic, opt, critic_opt, ids):
        mask = torch.ones_like(ids)
        resp_mask = torch.ones(ids.shape[0], L)
        ref_logp = None
        if ref is not None:
            with torch.no_grad():
                ref_logp = causal_lm_logprobs(ref, ids, mask, logits_to_keep=L) if fused else policy_logp(ref, ids, mask)
        logp = policy_logp(policy, ids, mask)
        adv = torch.randn(ids.shape[0])
        loss, _ = policy_loss(logp, logp.detach(), adv, resp_mask, ref_logp=ref_logp, config=loss_cfg)
        loss.backward()
        del logp, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        if critic is not None:
            values = critic.values(ids, mask, L)
            vloss = ((values - torch.randn_like(values)) ** 2).mean()
            vloss.backward()
            del values, vloss
            critic_opt.step()
            critic_opt.zero_grad(set_to_none=True)

    def make(config):
        policy = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()
        if checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ref = copy.deepcopy(policy).eval().requires_grad_(False) if algorithm != "grpo_noref" else None
        critic = ValueModel.from_policy(policy).to(dtype).train() if algorithm == "ppo" else None
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-5, foreach=foreach)
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=1e-5, foreach=foreach) if critic is not None else None
        # one short step creates the optimizer states (steady state: they exist in every later step)
        step(policy, ref, critic, opt, critic_opt, torch.randint(0, config.vocab_size, (1, L + 2)))
        return policy, ref, critic, opt, critic_opt

    # warm-up with a tiny model of the same architecture: imports, autograd engine, thread pools
    tiny = dict(model, hidden=32, layers=1, heads=2, kv_heads=1 if model["kv_heads"] < model["heads"] else 2,
                inter=64, vocab=L + 8)
    make(_hf_config(arch, **tiny))

    def run():
        parts = make(cfg)
        ids = torch.randint(0, cfg.vocab_size, (G, T))
        step(*parts, ids)

    return run


# ----------------------------------------------------------------------------- CLI


# The plan's default prompt length when neither --max_prompt_length nor the config gives one
# (fastrl train takes the dataset's longest prompt, which the plan does not read).
DEFAULT_PLAN_PROMPT_LENGTH = 512
# `fastrl train` options the plan reads (same names, same defaults: a run's --config YAML
# works for both); the other TrainConfig fields in that file do not change the memory plan.
TRAIN_OPTIONS = ("model", "algorithm", "kl_coef", "group_size", "max_prompt_length", "max_new_tokens", "dtype",
                 "device", "shared_prefix", "prefix_tree", "activation_checkpointing", "offload_activations", "env",
                 "max_trajectory_tokens")


def _bool(text: str) -> bool:
    value = str(text).strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_plan_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``fastrl plan``: ``fastrl train``'s names and defaults for what the two
    share (``TRAIN_OPTIONS``), then the plan's own."""
    from fastrl.train.config import ALGORITHMS

    # these are absent from the parsed namespace unless given (SUPPRESS), so a --config file's
    # value is kept where the command line does not set it
    train = parser.add_argument_group("fastrl train's options (same names and defaults; also read from --config)")
    t = train.add_argument
    t("--config", metavar="FILE", help="a fastrl train YAML file (fastrl train --config FILE): the options below are "
      "read from it, the command line overrides them, its other keys are train-only and ignored here")
    t("--model", default=argparse.SUPPRESS,
      help=f"default: fastrl train's built-in model; or a built-in shape ({', '.join(BUILTIN_MODELS)}), a config.json, "
           "a model folder or a hub id")
    t("--algorithm", choices=ALGORITHMS, default=argparse.SUPPRESS,
      help="as fastrl train: ppo has a critic; the others a reference model when kl_coef > 0 (grpo's preset: 0.04)")
    t("--kl_coef", type=float, default=argparse.SUPPRESS, help="default: the algorithm's preset; 0: no reference model")
    t("--group_size", type=int, default=argparse.SUPPRESS, help="completions per prompt G")
    t("--max_prompt_length", "--prompt_len", dest="max_prompt_length", type=int, default=argparse.SUPPRESS,
      help=f"prompt tokens P (default {DEFAULT_PLAN_PROMPT_LENGTH}, the built-in model's context less "
           "max_new_tokens for the built-in model: the plan does not read the dataset)")
    t("--max_new_tokens", "--response_len", dest="max_new_tokens", type=int, default=argparse.SUPPRESS,
      help="response tokens L (default: fastrl train's: the built-in task's, 256 for other models)")
    t("--dtype", choices=("auto", "float32", "bfloat16"), default=argparse.SUPPRESS,
      help="as fastrl train: auto is bf16 autocast on CUDA (planned as bf16-mixed), float32 on CPU")
    t("--device", choices=("auto", "cpu", "cuda"), default=argparse.SUPPRESS,
      help="auto: CUDA when this machine has it, else CPU (as fastrl train)")
    t("--shared_prefix", type=_bool, default=argparse.SUPPRESS, metavar="{true,false}",
      help="the training forward packs each prompt once per group (fastrl train's default: true)")
    t("--prefix_tree", type=lambda v: "auto" if str(v).strip().lower() == "auto" else _bool(v), default=argparse.SUPPRESS,
      metavar="{auto,true,false}",
      help="the training forward packs samples as the trie of their tokens (auto: when it saves tokens); planned as "
           "the prompt once per group (deeper sharing, step-wise samples' earlier turns, is not credited: an upper bound)")
    t("--env", default=argparse.SUPPRESS, metavar="NAME",
      help="an agent run (fastrl train --env NAME): a sample is a whole trajectory of max_trajectory_tokens "
           "(prompt, policy and environment tokens); its limits are the environment's defaults unless given")
    t("--max_trajectory_tokens", type=int, default=argparse.SUPPRESS,
      help="with --env: tokens of a trajectory in all; P is --max_prompt_length (default 0: the environment is "
           "not built, so no prompt sharing is credited) and L the rest")
    t("--activation_checkpointing", choices=("auto", "off", "layer"), default=argparse.SUPPRESS,
      help="auto: on from 2048-token trajectories (as fastrl train)")
    t("--offload_activations", type=_bool, default=argparse.SUPPRESS, metavar="{true,false}",
      help="with checkpointing: the layer inputs in CPU memory")

    own = parser.add_argument_group("the plan's own options")
    a = own.add_argument
    a("--prompts_per_micro_batch", type=int, default=1, help="groups per training forward")
    a("--compare", action="store_true", help="print ppo, grpo and grpo without a reference side by side")
    a("--reward_model", action="store_true", help="also hold a learned reward model of the same shape")
    a("--precision", choices=PRECISIONS, default=None, help="overrides what --dtype and --device give")
    a("--optimizer", choices=OPTIMIZERS, default="adamw")
    a("--optimizer_offload", action="store_true", help="optimizer states and master weights in CPU memory")
    a("--shared_prefix_rollout", type=_bool, default=True, metavar="{true,false}",
      help="the sampler keeps one KV cache of the prompt per group (fastrl's samplers do)")
    a("--fused_logprobs", type=_bool, default=True, metavar="{true,false}",
      help="false: plan the naive [tokens, vocab] logits path instead of fastrl's fused head")
    a("--attention", choices=ATTENTIONS, default="sdpa")
    a("--kv_cache", choices=KV_CACHE_MODES, default="transient")
    a("--foreach", action="store_true", help="AdamW's multi-tensor step (one full-size temporary)")
    a("--persistent_grads", action="store_true", help="gradient buffers persist (DeepSpeed/Megatron) instead of set_to_none")
    a("--overhead_gb", type=float, default=0.0, help="added to every phase (CUDA context, allocator)")
    a("--memory_gb", type=float, default=None, help="also print the longest response that fits in this many GiB")
    a("--json", action="store_true", help="print JSON instead of tables")
    return parser


def _read_config_file(path: str) -> dict[str, Any]:
    """The keys of a ``fastrl train --config`` YAML file that the plan reads."""
    from fastrl.errors import InputError
    from fastrl.train.config import TrainConfig

    try:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise InputError(f"--config {path!r}: {e.strerror}") from None
    except ImportError:
        raise InputError("--config needs pyyaml (pip install -e '.[train]')") from None
    except yaml.YAMLError as e:
        raise InputError(f"--config {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise InputError(f"--config {path!r}: expected a mapping of fastrl train options, got {type(data).__name__}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(k for k in data if k not in fields)
    if unknown:
        raise InputError(f"--config {path!r}: {', '.join(unknown)} is not a fastrl train option (fastrl train --help)")
    return {k: v for k, v in data.items() if k in TRAIN_OPTIONS}


def _plan_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What the plan computes with: fastrl train's resolution of the shared options (the
    config file, then the command line), then the plan's own."""
    from fastrl.errors import InputError
    from fastrl.train.assemble import uses_activation_checkpointing

    from fastrl.train.config import TrainConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in TRAIN_OPTIONS}
    config_file = getattr(args, "config", None)
    shared = {**defaults, **(_read_config_file(config_file) if config_file else {})}
    shared.update({k: getattr(args, k) for k in TRAIN_OPTIONS if hasattr(args, k)})
    try:
        train = TrainConfig(**shared).resolved()
    except ValueError as e:
        raise InputError(str(e)) from e
    if train.device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = train.device.split(":")[0]
    precision = args.precision or ("fp32" if train.dtype == "float32" or (train.dtype == "auto" and device == "cpu")
                                   else "bf16-mixed")
    if train.env is not None:
        # an agent run: a sample is a whole trajectory; the prompt its G samples share is not
        # known without building the environment, so it is what the user says (0: none)
        sample_len = train.max_trajectory_tokens
        prompt_len = train.max_prompt_length or 0
        if prompt_len >= sample_len:
            raise InputError(f"--max_prompt_length {prompt_len} leaves no trajectory tokens of "
                             f"max_trajectory_tokens={sample_len}")
        response_len = sample_len - prompt_len
    else:
        prompt_len = train.max_prompt_length or DEFAULT_PLAN_PROMPT_LENGTH
        if train.model is None and not train.max_prompt_length:  # the built-in model: what its context leaves
            from fastrl.train.task import DefaultTask

            prompt_len = DefaultTask().max_position_embeddings - train.max_new_tokens
        response_len = train.max_new_tokens
    checkpointing = uses_activation_checkpointing(train.activation_checkpointing, longest=prompt_len + response_len)
    algorithm = "ppo" if train.uses_critic else ("grpo" if train.uses_reference else "grpo_noref")
    notes = []
    if train.env is not None:
        notes.append(f"--env {train.env}: each sample is a trajectory of max_trajectory_tokens={prompt_len + response_len} "
                     f"(prompt P={prompt_len}, the rest policy and environment tokens, all in the forward)"
                     + ("; give --max_prompt_length to credit the prompt the group shares" if not prompt_len else ""))
    if train.prefix_tree is True:
        notes.append("prefix_tree: planned as the prompt once per group; the trie's deeper sharing (earlier turns of "
                     "step-wise samples, branches) makes the real step smaller")
    return dict(
        model=train.model, train=train, notes=notes, prompt_len=prompt_len, response_len=response_len, algorithm=algorithm,
        options=dict(
            group_size=train.group_size, prompts_per_micro_batch=args.prompts_per_micro_batch,
            reward_model=args.reward_model, precision=precision, optimizer=args.optimizer,
            optimizer_offload=args.optimizer_offload, checkpointing=checkpointing,
            offload_layer_inputs=train.offload_activations and checkpointing,
            shared_prefix=train.shared_prefix or train.prefix_tree is True,  # auto: the group layout at most
            shared_prefix_rollout=args.shared_prefix_rollout, fused_logprobs=args.fused_logprobs,
            attention=args.attention, kv_cache=args.kv_cache, device=device, foreach=args.foreach,
            persistent_grads=args.persistent_grads, overhead_gb=args.overhead_gb,
        ),
    )


def builtin_train_model_shape(train: Any = None) -> ModelShape:
    """The shape of ``fastrl train``'s built-in model (no ``--model``) for the resolved
    ``TrainConfig`` ``train`` (its ``model_hidden_size``, ``model_layers``; an env run's
    context is its ``max_trajectory_tokens``, as ``policy.load_model`` makes it); None: the
    built-in task's."""
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    default = DefaultTask()
    hidden = train.model_hidden_size if train is not None else default.hidden_size
    layers = train.model_layers if train is not None else default.layers
    heads = train.model_heads if train is not None else default.heads
    positions = train.max_trajectory_tokens if train is not None and train.env is not None else default.max_position_embeddings
    model = tiny_model(char_tokenizer(), hidden_size=hidden, layers=layers, heads=heads, arch=default.arch,
                       max_position_embeddings=positions)
    name = "fastrl train's built-in model" + (f" (--env {train.env})" if train is not None and train.env is not None else "")
    return shape_from_config(model.config, name=name)


def run_plan(args: argparse.Namespace) -> int:
    """Run ``fastrl plan`` with parsed arguments; prints tables (or JSON) and returns 0.
    A bad option or model source raises ``InputError``."""
    from fastrl.errors import InputError

    settings = _plan_settings(args)
    try:
        shape = (load_model_shape(settings["model"]) if settings["model"] is not None
                 else builtin_train_model_shape(settings["train"]))
        algorithms = ("ppo", "grpo", "grpo_noref") if args.compare else (settings["algorithm"],)
        out = []
        for algo in algorithms:
            opts = dict(settings["options"], algorithm=algo)
            plan = plan_memory(shape, prompt_len=settings["prompt_len"], response_len=settings["response_len"], **opts)
            plan.notes.extend(settings["notes"])
            entry: dict[str, Any] = {"plan": plan}
            if args.memory_gb is not None:
                entry["longest"] = longest_trajectory(shape, memory_gb=args.memory_gb, prompt_len=settings["prompt_len"], **opts)
            out.append(entry)
    except InputError:
        raise
    except ValueError as e:
        raise InputError(str(e)) from e
    if args.json:
        payload = []
        for e in out:
            d = e["plan"].to_dict()
            if "longest" in e:
                length, lp = e["longest"]
                d["longest_response_len"] = length
                d["longest_total"] = lp.total if lp else None
                d["memory_gb"] = args.memory_gb
            payload.append(d)
        print(json.dumps(payload if args.compare else payload[0], indent=2))
        return 0
    for e in out:
        print(e["plan"].table())
        if "longest" in e:
            length, lp = e["longest"]
            if lp is None:
                print(f"  longest response in {args.memory_gb:g} GiB: none fits (even L=1)")
            else:
                print(f"  longest response in {args.memory_gb:g} GiB: L = {length} "
                      f"({lp.tokens['per_group']} tokens per group, peak {lp.total / GiB:.2f} GiB in '{lp.peak_phase}')")
        print()
    if args.compare:
        print(f"  {'algorithm':<12}{'total GiB':>12}{'total GB':>12}")
        for e in out:
            print(f"  {e['plan'].options['algorithm']:<12}{e['plan'].total / GiB:>12.2f}{e['plan'].total / 1e9:>12.2f}")
    return 0
