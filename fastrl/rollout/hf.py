"""Group sampling with any Hugging Face causal LM, encoding each prompt once.

``HFGroupSampler.generate(prompts, group_size=G, sampling=...)`` returns G completions per
prompt. The work it does:

1. **Prefill once.** The distinct prompts are packed into one ``[1, sum P]`` sequence
   (positions restart at 0 for each prompt) and run through the model once; attention
   is causal within each prompt. The prompt keys/values of every layer are kept as they
   come out of the projections (made contiguous once for the CPU path) -- one copy per
   distinct prompt, never repeated G times.
2. **Decode in one batch.** All ``B = num_prompts * G`` samples step together (prompts of
   different lengths in one batch; positions are per sample). Each new token's keys/values
   go into a per-sample suffix buffer ``[B, Hkv, max_new_tokens - 1, D]``; attention is the
   cascade of ``fastrl.ops.shared_prefix_decode_attention``: the group's shared prompt and
   the sample's own suffix are attended separately and merged with their log-sum-exps
   (Triton on CUDA, the batched PyTorch twin on CPU).

The model is used unchanged: the sampler registers an attention function
(``"fastrl_shared_prefix"``) in transformers' ``AttentionInterface``, switches
``config._attn_implementation`` to it for the duration of a call, and hands its KV store
to the attention function through the forward's keyword arguments (the same route
transformers uses for its paged cache). KV memory is ``(sum of distinct prompt lengths +
B * (max_new_tokens - 1))`` token slots instead of ``B * (P + max_new_tokens)``.

Sampling and log-probs: the next-token logits are taken in fp32 and divided by the
temperature; top-k then top-p filtering set the dropped tokens to ``-inf``; the sampled
token's log-prob is ``log_softmax`` of that filtered, tempered distribution (renormalised
over the kept tokens) -- the distribution the token was actually drawn from. With
``top_k=0, top_p=1`` this equals ``log_softmax(model(input_ids).logits / temperature)``
recomputed by the training forward. With filtering on, it is larger than that
(by ``-log`` of the kept probability mass) and importance ratios against the unfiltered
training distribution are not 1 at the first step; ``greedy=True`` takes the argmax and
reports its log-prob under the same (tempered, filtered) distribution.

Supported models: decoder-only causal LMs whose attention layers call
``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2/3, Mistral, ... in transformers >= 4.48) with
full (non-sliding) attention and no attention-logit soft-capping.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from fastrl._checks import check_choice, resolve_backend
from fastrl.ops.decode_attention import _dispatch, shared_prefix_decode_attention
from fastrl.rollout.base import RolloutBatch, RolloutStats, SamplingConfig, validate_prompt_seeds, validate_prompts

ATTN_NAME = "fastrl_shared_prefix"
_KV_KWARG = "fastrl_shared_prefix_kv"

__all__ = ["HFGroupSampler", "SharedPrefixKV", "ATTN_NAME"]


class SharedPrefixKV:
    """Per-layer KV store of one rollout: packed distinct prompts + per-sample suffixes.

    ``prefix_k[l]``/``prefix_v[l]``: ``[Hkv, sum P, D]`` (Triton: views of the prefill's
    key/value projections, no copy; torch: one contiguous copy per rollout, the projection
    is freed after the layer). ``suffix_k[l]``/``suffix_v[l]``: ``[B, Hkv, capacity, D]``.
    """

    def __init__(self, *, num_layers: int, cu_seqlens: list[int], backend: str):
        self.num_layers = num_layers
        self.cu_seqlens = cu_seqlens  # distinct prompts in the packed prefill
        self.backend = backend
        self.mode = "prefill"
        self.prefix_k: list[torch.Tensor | None] = [None] * num_layers
        self.prefix_v: list[torch.Tensor | None] = [None] * num_layers
        self.suffix_k: list[torch.Tensor | None] = [None] * num_layers
        self.suffix_v: list[torch.Tensor | None] = [None] * num_layers
        self.peak_bytes = 0

    def start_decode(self, *, prefix_start: torch.Tensor, prefix_len: torch.Tensor, group_size: int, batch: int, capacity: int) -> None:
        self.mode = "decode"
        self.prefix_start = prefix_start  # [num_prompts] into the packed prefix
        self.prefix_len = prefix_len
        self._host_starts = prefix_start.tolist()
        self._host_lens = prefix_len.tolist()
        self.group_size = group_size
        self.batch = batch
        self.capacity = capacity
        self.step = 0  # suffix slot the next token's keys/values go to

    def set_step(self, step: int) -> None:
        """Before decode forward ``step``: its token goes to suffix slot ``step``, so every
        sample attends to ``step + 1`` suffix slots."""
        self.step = step
        self.suffix_len = torch.full((self.batch,), step + 1, dtype=torch.int32, device=self.prefix_start.device)
        self.host_lengths = (self._host_starts, self._host_lens, [step + 1] * self.batch)

    def bytes(self) -> int:
        total = 0
        for ts in (self.prefix_k, self.prefix_v, self.suffix_k, self.suffix_v):
            for t in ts:
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        layer = module.layer_idx
        if self.mode == "prefill":
            # query [1, Hq, sum P, D], key/value [1, Hkv, sum P, D]; causal within each prompt
            if self.backend == "torch":  # contiguous [Hkv, N, D]: plain BLAS layouts for the per-step matmuls
                self.prefix_k[layer], self.prefix_v[layer] = key[0].contiguous(), value[0].contiguous()
            else:  # the kernel takes any strides: keep the projections' own memory, no copy
                self.prefix_k[layer], self.prefix_v[layer] = key[0], value[0]
            self.peak_bytes = max(self.peak_bytes, self.bytes())
            gqa = query.shape[1] != key.shape[1]
            outs = []
            cu = self.cu_seqlens
            for a, b in zip(cu[:-1], cu[1:]):
                outs.append(
                    F.scaled_dot_product_attention(
                        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=gqa
                    )
                )
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
            return out.transpose(1, 2)  # [1, sum P, Hq, D]
        # decode: query [B, Hq, 1, D], key/value [B, Hkv, 1, D]
        if self.suffix_k[layer] is None:
            B, Hkv, _, D = key.shape
            self.suffix_k[layer] = key.new_empty(B, Hkv, self.capacity, D)
            self.suffix_v[layer] = value.new_empty(B, Hkv, self.capacity, D)
            self.peak_bytes = max(self.peak_bytes, self.bytes())
        sk, sv = self.suffix_k[layer], self.suffix_v[layer]
        sk[:, :, self.step] = key[:, :, 0]
        sv[:, :, self.step] = value[:, :, 0]
        args = (query[:, :, 0], self.prefix_k[layer], self.prefix_v[layer], self.prefix_start, self.prefix_len, sk, sv, self.suffix_len)
        if self.step == 0:  # validate the layer's tensors once per rollout, not at every token
            out = shared_prefix_decode_attention(*args, group_size=self.group_size, scale=scaling, backend=self.backend)
        else:
            out = _dispatch(*args, self.group_size, scaling, self.backend, self.host_lengths)
        return out.unsqueeze(1)  # [B, 1, Hq, D]


def _shared_prefix_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry point (registered as ``ATTN_NAME``)."""
    kv: SharedPrefixKV | None = kwargs.get(_KV_KWARG)
    if kv is None:
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} only runs inside HFGroupSampler.generate "
            "(it needs the sampler's shared-prefix KV store)"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention layers are not supported by HFGroupSampler")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return kv.attend(module, query, key, value, float(scaling)), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _shared_prefix_attention)


def _eos_ids(model: torch.nn.Module) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is None:
            continue
        ids.extend([eos] if isinstance(eos, int) else list(eos))
    return tuple(dict.fromkeys(int(e) for e in ids))


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probs ``[B, V]`` (fp32) of the distribution tokens are drawn from.

    ``logits / temperature``, then top-k (ties with the k-th value are kept), then top-p
    (the smallest set of most likely tokens whose probability reaches ``top_p``; the most
    likely token is always kept); dropped tokens get ``-inf``; ``log_softmax`` renormalises.
    """
    x = logits.float() / sampling.temperature
    V = x.shape[-1]
    if 0 < sampling.top_k < V:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
        drop_sorted = before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def _inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row b's token: the first index whose cumulative probability exceeds ``u[b] * total``
    (``u`` in [0, 1)). A zero-probability token is never picked."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x[:, None], right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


class HFGroupSampler:
    """``GroupSampler`` for a Hugging Face causal LM with one shared prompt KV per group.

    Args:
        model: a ``transformers`` causal LM (``PreTrainedModel``), on the device to sample on.
        pad_token_id: id used to right-pad the ``[B, T]`` batch (default: the model's pad,
            else its first eos, else 0).
        backend: decode-attention backend, ``auto`` (Triton on CUDA, PyTorch otherwise),
            ``triton`` or ``torch``.
        max_length: longest prompt + completion allowed (default:
            ``config.max_position_embeddings``).
    """

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int | None = None, backend: str = "auto", max_length: int | None = None):
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "get_input_embeddings"):
            raise TypeError(f"model must be a Hugging Face PreTrainedModel, got {type(model).__name__}")
        check_choice("backend", backend, ("auto", "triton", "torch"))
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("HFGroupSampler needs a decoder-only causal LM")
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
            raise ValueError(f"only full-attention layers are supported, got layer_types={layer_types}")
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("attention-logit soft-capping is not supported")
        self.model = model
        self.backend = backend
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.max_length = max_length if max_length is not None else getattr(config, "max_position_embeddings", None)
        self.eos_token_ids = _eos_ids(model)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = self.eos_token_ids[0] if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        _register()

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the model's parameters/buffers in place.

        Names are those of ``model.named_parameters()`` / ``named_buffers()`` (tied
        weights may be given under either name). Every name and shape is checked before
        anything is copied; unknown names or shape mismatches raise ``ValueError``.
        """
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers(remove_duplicate=False)))
        items = list(named_tensors)
        for name, t in items:
            if name not in targets:
                raise ValueError(f"update_weights: the model has no parameter or buffer named {name!r}")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(targets[name].shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"update_weights: {name!r} has shape {shape}, the model expects {tuple(targets[name].shape)}")
        for name, t in items:
            targets[name].copy_(t)

    # ------------------------------------------------------------------ sampling
    @contextlib.contextmanager
    def _shared_prefix_attention(self) -> Iterator[None]:
        config = self.model.config
        previous = config._attn_implementation
        was_training = self.model.training
        config._attn_implementation = ATTN_NAME
        self.model.eval()
        try:
            yield
        finally:
            config._attn_implementation = previous
            self.model.train(was_training)

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], *, group_size: int, sampling: SamplingConfig | None = None,
        prompt_seeds: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """``group_size`` completions for each prompt (flat, prompt 0's samples first).

        ``prompt_seeds``: one seed per prompt (overrides ``sampling.seed``). Each group's
        random numbers then come from its own seed alone, so a prompt's completions do not
        depend on which other prompts share the batch (data-parallel ranks sampling slices
        of a batch reproduce the single-process samples).
        """
        sampling = sampling if sampling is not None else SamplingConfig()
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts = validate_prompts(
            prompts, group_size=group_size, vocab_size=self.vocab_size, max_length=self.max_length, max_new_tokens=sampling.max_new_tokens
        )
        t0 = time.perf_counter()
        model = self.model
        device = model.get_input_embeddings().weight.device
        backend = resolve_backend(self.backend, device)
        G = group_size
        N = len(prompts)
        B = N * G
        L = sampling.max_new_tokens

        # distinct prompts, packed
        distinct: dict[tuple[int, ...], int] = {}
        for p in prompts:
            distinct.setdefault(tuple(p), len(distinct))
        uniq = list(distinct)
        cu = [0]
        for p in uniq:
            cu.append(cu[-1] + len(p))
        which = [distinct[tuple(p)] for p in prompts]
        ids = torch.tensor([t for p in uniq for t in p], dtype=torch.long, device=device)[None]
        pos = torch.cat([torch.arange(len(p), device=device) for p in uniq])[None]
        last = torch.tensor(cu[1:], device=device) - 1

        kv = SharedPrefixKV(num_layers=model.config.num_hidden_layers, cu_seqlens=cu, backend=backend)
        stop_ids = torch.tensor(sorted(set(sampling.stop_token_ids) | set(self.eos_token_ids)), dtype=torch.long, device=device)
        gen = None
        uniforms = None
        if prompt_seeds is not None and not sampling.greedy:
            prompt_seeds = validate_prompt_seeds(prompt_seeds, N)
            # drawn on the CPU: the same numbers on every device
            uniforms = torch.cat([
                torch.rand(G, L, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64) for s in prompt_seeds
            ]).to(device)
        elif sampling.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(sampling.seed)

        tokens = torch.empty(B, L, dtype=torch.long, device=device)
        logps = torch.empty(B, L, dtype=torch.float32, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        steps = 0
        with self._shared_prefix_attention():
            out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=last, **{_KV_KWARG: kv})
            logits = out.logits[0].float()[torch.tensor(which, device=device)].repeat_interleave(G, dim=0)  # [B, V]
            del out
            kv.start_decode(
                prefix_start=torch.tensor([cu[w] for w in which], dtype=torch.int32, device=device),
                prefix_len=torch.tensor([len(prompts[n]) for n in range(N)], dtype=torch.int32, device=device),
                group_size=G,
                batch=B,
                capacity=max(L - 1, 1),
            )
            base_pos = torch.tensor([len(p) for p in prompts], device=device).repeat_interleave(G)
            for step in range(L):
                logp_all = process_logits(logits, sampling)
                if sampling.greedy:
                    tok = torch.argmax(logp_all, dim=-1)
                elif uniforms is not None:
                    tok = _inverse_cdf_sample(logp_all.exp(), uniforms[:, step])
                else:
                    tok = torch.multinomial(logp_all.exp(), 1, generator=gen)[:, 0]
                tokens[:, step] = tok
                logps[:, step] = logp_all.gather(1, tok[:, None])[:, 0]
                steps = step + 1
                if stop_ids.numel():
                    finished |= torch.isin(tok, stop_ids)
                if step == L - 1 or bool(finished.all()):
                    break
                kv.set_step(step)
                out = model(
                    input_ids=tok[:, None], position_ids=(base_pos + step)[:, None], use_cache=False, **{_KV_KWARG: kv}
                )
                logits = out.logits[:, -1].float()
                del out

        # cut each completion after its first stop token
        tokens_h = tokens[:, :steps].cpu()
        logps_h = logps[:, :steps].cpu()
        stop_set = set(stop_ids.tolist())
        completion_ids, completion_logp, finish_reasons = [], [], []
        for b in range(B):
            row = tokens_h[b].tolist()
            end = next((i + 1 for i, t in enumerate(row) if t in stop_set), None)
            completion_ids.append(row[: end or steps])
            completion_logp.append(logps_h[b, : end or steps].clone())
            finish_reasons.append("stop" if end is not None else "length")
        computed = cu[-1]
        stats = RolloutStats(
            prompts=N,
            samples=B,
            prefill_tokens_computed=computed,
            prefix_tokens_reused=G * sum(len(p) for p in prompts) - computed,
            generated_tokens=sum(len(c) for c in completion_ids),
            peak_kv_cache_bytes=kv.peak_bytes,
            seconds=time.perf_counter() - t0,
        )
        return RolloutBatch.from_samples(
            prompts, completion_ids, completion_logp, finish_reasons,
            group_size=G, pad_token_id=self.pad_token_id, stats=stats,
        )
