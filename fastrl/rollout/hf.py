"""Group sampling with any Hugging Face causal LM, encoding each prompt once.

``HFGroupSampler.generate(prompts, group_size=G, sampling=...)`` returns G completions per
prompt. The work it does:

1. **Prefill once.** The distinct prompts are packed into one ``[1, sum P]`` sequence
   (positions restart at 0 for each prompt) and run through the model once; attention
   is causal within each prompt. Each layer's prompt keys/values are copied once into a
   ``[Hkv, U, P_max, D]`` store (the ``U`` distinct prompts right-padded to the longest):
   one copy per distinct prompt, never repeated G times (:class:`CascadeKV`).
2. **Decode in one batch.** All ``B = num_prompts * G`` rows step together. Each new
   token's keys/values are written in place into a preallocated per-row suffix buffer
   ``[B, Hkv, capacity, D]`` (no per-step concatenation). Attention is over the row's stored
   prompt and its own suffix: their scores in two batched matmuls, one softmax over both, in
   a fixed number of batched ops per layer with no loop over groups
   (``fastrl.ops.decode_attention.padded_prefix_attention`` on CPU; on CUDA the Triton
   kernels of ``shared_prefix_decode_attention`` read each group's prompt once). The only
   host sync per step is the stop check (none when no row can end early). Once enough rows
   have ended (``COMPACT_FRACTION``), the eager step runs the rows still sampling only (their
   suffix rows moved to the front of the store, :meth:`CascadeKV.narrow`). For Llama/Qwen2
   models in fp32 the prefills and decode steps run the layers through
   :mod:`fastrl.rollout.lean_decode` (the same weights in fewer ops; checked once, at the
   first prefill, against the model's own forward).
3. **Project only what is sampled.** The decode steps run the model's base model and apply
   its output projection themselves, to the rows still sampling only (rows that hit a stop
   token or their budget drop out of the LM head and the sampling); on CPU, with at most
   ``TRANSPOSED_HEAD_MAX_ROWS`` rows, through a contiguous ``W^T`` copied once per rollout
   (MKL's small-M GEMM is 1.4-2.3x faster on it; the copy is the head's size, held for the
   rollout only and not counted in ``peak_kv_cache_bytes``). Whether ``lm_head(base_model(x))`` is the
   model's output is checked at the first prefill; a model that scales or caps its logits
   keeps its own forward. The logits and ``exp`` buffers are reused across steps.

``decode="static"`` runs each step with static shapes (write slots and the suffix mask from a
device tensor, attention over the whole suffix capacity, no host value inside), the step
``decode="cuda_graph"`` captures once per rollout in a CUDA graph and replays; on CPU the
static step is the tested stand-in (same tokens and log-probs as the eager step).

The model is used unchanged: the sampler registers an attention function
(``"fastrl_shared_prefix"``) in transformers' ``AttentionInterface``, switches
``config._attn_implementation`` to it for the duration of a call, and hands its KV store
to the attention function through the forward's keyword arguments (the same route
transformers uses for its paged cache). KV memory is ``U * P_max + B * max_new_tokens``
token slots (the last suffix slot is a scratch slot) instead of ``B * (P + max_new_tokens)``.

**Multi-turn** (``start`` / ``continue_`` / ``close``; :class:`HFTokenSampler` is the agents
driver's ``TokenSampler`` over it): each trajectory keeps its own suffix across turns, so
turn ``k`` runs only the tokens appended to it (different lengths per trajectory, in one
left-padded forward); the G trajectories of a prompt keep sharing its stored prompt;
trajectories that stop drop out and their rows are released. See :meth:`HFGroupSampler.start`.

The rooms beside this one: :mod:`fastrl.rollout.kv_store` (the KV store, ``CascadeKV``, and the
attention entry point), :mod:`fastrl.rollout.sampling` (logit warping, the draw and its
log-prob: ``sample_tokens``), :mod:`fastrl.rollout.token_sampler` (the agents driver's token
samplers over this sampler's multi-turn state, and the factory that picks one).

Supported models: decoder-only causal LMs whose attention layers call
``ALL_ATTENTION_FUNCTIONS`` (Llama, Qwen2/3, Mistral, ... in transformers >= 4.48) with
full (non-sliding) attention and no attention-logit soft-capping.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from fastrl._checks import check_choice, resolve_backend
from fastrl.errors import InputError
from fastrl.rollout.base import RolloutBatch, RolloutStats, SamplingConfig, validate_prompt_seeds, validate_prompts
from fastrl.rollout.kv_store import ATTN_NAME, KV_KWARG, PREFILL_PAD_WASTE, CascadeKV, register_attention  # noqa: F401 (PREFILL_PAD_WASTE: its old import path)
from fastrl.rollout.lean_decode import lean_decoder
from fastrl.rollout.sampling import (  # noqa: F401 (all but sample_tokens: their old import path)
    CDF_BLOCK,
    CDF_CAST_ELEMENTS,
    TOP_P_FIRST_K,
    process_logits,
    sample_tokens,
    warp_logits,
)
from fastrl.rollout.token_sampler import HFTokenSampler, TurnOutput

TURN_SEED_STRIDE = 1009
"""Seeds of consecutive turns of one trajectory are this far apart (the agents driver's stride)."""
TRANSPOSED_HEAD_MAX_ROWS = 16
"""On CPU the LM head is applied as ``hidden @ W^T`` with ``W^T`` stored contiguous (a copy made
once per rollout) when at most this many rows step together: for 1-16 rows MKL's GEMM is
1.4-2.3x faster (CPU time) on a ``[H, V]`` operand than on the ``[V, H]`` weight, with the same
logits; at 32 and 64 rows it is slower (``benchmarks/bench_lm_head_layout.py``,
``benchmarks/results/lm-head-layout-cpu-20261201-235130.json``)."""
TRANSPOSED_HEAD_MIN_STEPS = 16
"""... and when the rollout runs at least this many decode steps (the copy costs a few steps)."""
FORWARD_CHECK_RTOL = 1e-4
FORWARD_CHECK_ATOL = 1e-5
"""The sampler's one-time checks of its own paths at the first prefill (the LM head applied to
the base model's hidden states; the lean forward's hidden states) must match the model's own
forward within these (relative; absolute, times ``1 + max |x|``), else it keeps the model's."""
DECODE_MODES = ("eager", "static", "cuda_graph")
"""``HFGroupSampler(decode=...)``: the per-token step as variable-shape eager ops, as one
static-shape step (run eagerly; the CPU test of the captured path), or that step captured
once per rollout in a CUDA graph and replayed."""
COMPACT_FRACTION = 0.75
"""The eager decode narrows its KV store to the rows still sampling (:meth:`CascadeKV.narrow`)
once they are at most this fraction of the rows its forward runs: ended rows would otherwise
keep stepping through every layer and the attention until the longest row ends. Each narrowing
copies the whole suffix store once (one ``index_select`` per tensor, of the order of a few
decode steps' attention reads), so it waits until a quarter of the rows run are idle: at most
``log(B) / log(4 / 3)`` copies per decode (17 for 128 rows), and at most a third more rows run
than are sampled. ``0`` never narrows."""

# CascadeKV and ATTN_NAME live in kv_store, TurnOutput and HFTokenSampler in token_sampler,
# sample_tokens / warp_logits / process_logits in sampling: this module keeps exporting them
__all__ = ["HFGroupSampler", "CascadeKV", "ATTN_NAME", "MultiTurnState", "TurnOutput", "HFTokenSampler"]


class _CudaGraphStep:
    """A static decode step captured in a CUDA graph at its first call (after one warm-up
    run on a side stream, whose write slot is then rewound) and replayed after that. The
    graph holds the rollout's buffers: one capture per rollout."""

    def __init__(self, step, kv: CascadeKV):
        self.step, self.kv = step, kv
        self.graph = None

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.tok = tok.clone()
            slot = self.kv.static_slot.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step(self.tok)
            torch.cuda.current_stream().wait_stream(side)
            self.kv.static_slot.copy_(slot)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.step(self.tok)
        self.tok.copy_(tok)
        self.graph.replay()
        return self.out


class _LMHead:
    """The model's output projection, applied by the sampler (hidden states -> fp32 logits).

    ``transposed``: ``hidden @ W^T`` with a contiguous copy of ``W^T`` (``[H, V]``, one copy of
    the head's weight for as long as the rollout holds this object), refreshed when the weight
    changed in place (its version counter) or was replaced."""

    def __init__(self, linear: torch.nn.Linear, *, transposed: bool):
        self.linear = linear
        self.transposed = transposed
        self.weight_t: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self.refresh()

    def refresh(self) -> None:
        w = self.linear.weight
        key = (w.data_ptr(), w._version)
        if self.transposed and key != self._key:
            self.weight_t = None
            self.weight_t = w.detach().t().contiguous()
            self._key = key

    def __call__(self, h: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, H] -> [n, V]`` fp32 logits; ``out``: a ``[n, V]`` buffer to write them into
        (the weight's dtype; reused across decode steps instead of a fresh allocation)."""
        bias = self.linear.bias
        w_t = self.weight_t if self.weight_t is not None else self.linear.weight.t()
        if out is None or out.dtype != h.dtype:
            y = torch.matmul(h, w_t) if bias is None else torch.addmm(bias, h, w_t)
        elif bias is None:
            y = torch.matmul(h, w_t, out=out)
        else:
            y = torch.addmm(bias, h, w_t, out=out)
        return y.float()


def _eos_ids(model: torch.nn.Module) -> tuple[int, ...]:
    from fastrl.rollout.stop_tokens import model_eos_ids  # one stop set for the sampler and the agent renderer

    return model_eos_ids(model)


@dataclass
class MultiTurnState:
    """A multi-turn rollout held by :meth:`HFGroupSampler.start` (pass it back to
    ``continue_``; ``close`` releases its memory).

    ``live``: the trajectory ids whose KV is kept (row order of the store).
    ``history[t]``: every token of trajectory ``t`` after its prompt (sampled and appended).
    ``prefill_tokens``: per ``continue_`` call, the appended tokens it ran through the model
    (never the history). ``forward_tokens``: per call, every token it ran (the appended
    ones, the previous turn's last sampled token, the decode steps).
    """

    kv: CascadeKV
    sampling: SamplingConfig
    prompts: list[list[int]]
    group_size: int
    prompt_seeds: list[int] | None
    live: list[int]
    history: list[list[int]]
    pending: list[list[int]]
    first_logits: torch.Tensor | None
    head: "_LMHead | None" = None
    turn: int = 0
    prefill_tokens: list[int] = field(default_factory=list)
    forward_tokens: list[int] = field(default_factory=list)
    closed: bool = False


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
        decode: the per-token step (``DECODE_MODES``): ``eager`` (default), ``static`` (one
            static-shape step: device-side write slots and masks over the whole suffix
            capacity, no host value inside; the same tokens and log-probs as ``eager``, slower
            on CPU) or ``cuda_graph`` (that step captured in a CUDA graph once per rollout and
            replayed; CUDA only).
    """

    multi_turn = True
    """Trajectories keep their keys/values across calls (``start`` / ``continue_`` / ``close``:
    the ``MultiTurnSampler`` capability of ``fastrl.rollout.base``)."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int | None = None, backend: str = "auto", max_length: int | None = None,
                 decode: str = "eager"):
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "get_input_embeddings"):
            raise TypeError(f"model must be a Hugging Face PreTrainedModel, got {type(model).__name__}")
        check_choice("backend", backend, ("auto", "triton", "torch"))
        check_choice("decode", decode, DECODE_MODES)
        if decode == "cuda_graph" and model.get_input_embeddings().weight.device.type != "cuda":
            raise InputError("decode='cuda_graph' needs the model on a CUDA device; use decode='eager' (or 'static') on CPU")
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
        self.decode = decode
        self._split: bool | None = None if self._splittable() else False
        """Whether the sampler runs the base model and applies the output projection itself (to
        project only the rows still sampling, with a transposed weight on CPU): decided at the
        first prefill, where the model's own logits must equal ``lm_head`` of its base model's
        last hidden states (a model that scales or caps its logits keeps its own forward)."""
        self._lean = lean_decoder(model)
        """The lean decode forward (None: the model's own), trusted once ``_lean_checked``."""
        self._lean_checked = False
        register_attention()

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
        if was_training:  # (eval() and train() walk every submodule: skipped for a model already in eval mode)
            self.model.eval()
        try:
            yield
        finally:
            config._attn_implementation = previous
            if was_training:
                self.model.train(True)

    def _splittable(self) -> bool:
        head = self.model.get_output_embeddings()
        base = getattr(self.model, "base_model", None)
        return isinstance(head, torch.nn.Linear) and isinstance(base, torch.nn.Module) and base is not self.model

    def _head(self, device: torch.device, *, rows: int, steps: int | None) -> "_LMHead | None":
        """The output projection for one rollout (None: the model's own forward)."""
        if not self._split:
            return None
        transposed = device.type == "cpu" and rows <= TRANSPOSED_HEAD_MAX_ROWS and (steps is None or steps >= TRANSPOSED_HEAD_MIN_STEPS)
        return _LMHead(self.model.get_output_embeddings(), transposed=transposed)

    def _forward(self, kv: CascadeKV, ids: torch.Tensor, pos: torch.Tensor, head: "_LMHead | None") -> torch.Tensor:
        """The last position's output of every row: its hidden state when ``head`` is given
        (the caller projects the rows it needs), else the model's fp32 logits. With ``head``,
        the lean forward of the layers (:mod:`fastrl.rollout.lean_decode`) once it passed its
        check at the first prefill (:meth:`_prefill`)."""
        if head is not None:
            if self._lean is not None and self._lean_checked:
                return self._lean(ids, pos, kv.attend)[:, -1]
            out = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False, **{KV_KWARG: kv})
            return out.last_hidden_state[:, -1]
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1, **{KV_KWARG: kv})
        return out.logits[:, -1].float()

    @staticmethod
    def _project(h: torch.Tensor, head: "_LMHead | None", out: torch.Tensor | None = None) -> torch.Tensor:
        return h if head is None else head(h, out=None if out is None else out[: h.shape[0]])

    def _prefill(self, distinct_prompts: list[list[int]], device: torch.device, backend: str) -> tuple[CascadeKV, torch.Tensor]:
        """Run the distinct prompts once (packed); returns the store and their last logits ``[U, V]``.

        The first prefill runs the model's own forward and decides two things from it: whether
        ``lm_head(base_model(x))`` is the model's output (``_split``), and, where the lean
        forward of the layers applies (:mod:`fastrl.rollout.lean_decode`), whether it gives the
        same hidden states (run second: its keys/values are the ones kept, so every rollout's
        tokens come from the lean forward alone and seeds reproduce). A model that fails keeps
        its own forward (the prefill runs again with it). From then on prefills and decode
        steps run the lean forward where it passed."""
        kv = CascadeKV(num_layers=self.model.config.num_hidden_layers, prompt_lens=[len(p) for p in distinct_prompts],
                       backend=backend, device=device)
        cu = kv.cu_seqlens
        ids = torch.tensor([t for p in distinct_prompts for t in p], dtype=torch.long, device=device)[None]
        pos = torch.cat([torch.arange(len(p), device=device) for p in distinct_prompts])[None]
        last = torch.tensor(cu[1:], device=device) - 1
        head = self.model.get_output_embeddings()
        if self._split and self._lean is not None and self._lean_checked:
            h = self._lean(ids, pos, kv.attend)[0].index_select(0, last)
            return kv, F.linear(h, head.weight, head.bias).float()
        check_lean = self._split is not False and self._lean is not None and not self._lean_checked
        seen: list[torch.Tensor] = []
        hook = None
        if self._split is None or check_lean:
            hook = self.model.base_model.register_forward_hook(lambda m, a, out: seen.append(getattr(out, "last_hidden_state", None)))
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=last, **{KV_KWARG: kv})
        finally:
            if hook is not None:
                hook.remove()
        logits = out.logits[0].float()
        captured = len(seen) == 1 and isinstance(seen[0], torch.Tensor)
        if self._split is None:
            ok = captured
            if ok:
                got = F.linear(seen[0][0, last], head.weight, head.bias).float()
                ok = bool(torch.allclose(got, logits, rtol=FORWARD_CHECK_RTOL, atol=FORWARD_CHECK_ATOL * (1.0 + float(logits.abs().max()))))
            self._split = ok
        if check_lean and self._split:
            want = seen[0][0] if captured else None
            got = self._lean(ids, pos, kv.attend)[0]  # rewrites the prompts' keys/values
            if want is not None and bool(torch.allclose(got, want, rtol=FORWARD_CHECK_RTOL, atol=FORWARD_CHECK_ATOL * (1.0 + float(want.abs().max())))):
                self._lean_checked = True
                return kv, F.linear(got.index_select(0, last), head.weight, head.bias).float()
            self._lean = None
            return self._prefill(distinct_prompts, device, backend)
        return kv, logits

    def _stop_ids(self, sampling: SamplingConfig, device: torch.device) -> torch.Tensor:
        return torch.tensor(sorted(set(sampling.stop_token_ids) | set(self.eos_token_ids)), dtype=torch.long, device=device)

    def _decode(self, kv: CascadeKV, logits: torch.Tensor, budgets: list[int], sampling: SamplingConfig, stop_ids: torch.Tensor,
                uniforms: torch.Tensor | None, gen: torch.Generator | None, head: "_LMHead | None") -> tuple[list[list[int]], list[torch.Tensor], list[bool]]:
        """Sample up to ``budgets[b]`` tokens per row from ``logits`` (each row's next-token
        logits), one batched decode step per token. Returns per row the tokens (cut after a
        stop token), their log-probs and whether a stop token ended them.

        The only host sync per step is the stop check (none at all when nothing can end a row
        early: no stop token and equal budgets). Rows that have ended are no longer projected to
        logits nor sampled. With ``decode="eager"``, once the rows still sampling are at most
        ``COMPACT_FRACTION`` of the rows the forward runs, the store is narrowed to them
        (:meth:`CascadeKV.narrow`) and the following steps run only those rows; until then, and
        in the static modes (fixed shapes) throughout, ended rows keep stepping through the
        model with the pad token as input (their keys/values are never read back). The store
        is widened back to the batch's row order before returning. Every sampled token but the
        last of each row has been run through the model (its keys/values are in ``kv``)."""
        B = len(budgets)
        L = max(budgets)
        device = logits.device
        tokens = torch.full((B, L), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros(B, L, dtype=torch.float32, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        uneven = any(b != L for b in budgets)
        can_stop = stop_ids.numel() > 0 or uneven
        budget_t = torch.tensor(budgets, device=device)
        active: torch.Tensor | None = None  # the rows still sampling (None: all)
        n_active = B
        computed = list(range(B))  # the rows the eager forward runs (ascending)
        computed_t: torch.Tensor | None = None  # ... as a tensor (None: all rows)
        pick: torch.Tensor | None = None  # the positions of the active rows among them (None: all)
        step_fn = None
        steps = 0
        # [B, V] buffers written by every step (fresh ones would be page-faulted in each step)
        work = torch.empty(logits.shape, dtype=torch.float32, device=device) if not sampling.greedy else None
        head_out = None
        if head is not None and self.decode == "eager" and L > 1:
            head_out = torch.empty(logits.shape, dtype=head.linear.weight.dtype, device=device)
        try:
            for step in range(L):
                u = None if uniforms is None else (uniforms[:, step] if active is None else uniforms[active, step])
                tok, lp = sample_tokens(logits, sampling, uniforms=u, generator=gen, work=work)
                if active is None:
                    tokens[:, step] = tok
                    logps[:, step] = lp
                else:
                    tokens[active, step] = tok
                    logps[active, step] = lp
                steps = step + 1
                if step == L - 1:
                    break
                if can_stop:
                    if stop_ids.numel():
                        finished |= torch.isin(tokens[:, step], stop_ids)
                    if uneven:
                        finished |= budget_t <= steps
                    done = finished.tolist()  # the one host sync of the step
                    if all(done):
                        break
                    if B - sum(done) < n_active:
                        alive = [b for b, d in enumerate(done) if not d]
                        active = torch.tensor(alive, dtype=torch.long, device=device)
                        n_active = len(alive)
                        if self.decode == "eager":
                            if n_active <= COMPACT_FRACTION * len(computed):
                                kv.narrow(alive)
                                computed, computed_t = alive, active
                            where = {b: i for i, b in enumerate(computed)}
                            pick = None if n_active == len(computed) else torch.tensor(
                                [where[b] for b in alive], dtype=torch.long, device=device)
                if self.decode == "eager":
                    pos = kv.set_forward([1] * len(computed), 1)
                    ids = tokens[:, step, None] if computed_t is None else tokens[:, step].index_select(0, computed_t)[:, None]
                    h = self._forward(kv, ids, pos, head)
                    logits = self._project(h if pick is None else h.index_select(0, pick), head, head_out)
                else:
                    if step_fn is None:
                        kv.start_static()
                        step_fn = self._static_step(kv, head)
                    logits = step_fn(tokens[:, step])
                    kv.suffix_len = [n + 1 for n in kv.suffix_len]
                    if active is not None:
                        logits = logits.index_select(0, active)
        finally:
            kv.widen()  # also when a step raised: the store stays usable
        rows_h = tokens[:, :steps].tolist()
        logps_h = logps[:, :steps].cpu().unbind(0)  # one copy; each row's log-probs are a view of it
        stop_set = set(stop_ids.tolist())
        ids_out, logp_out, stopped = [], [], []
        for b in range(B):
            row = rows_h[b][: budgets[b]]
            end = next((i + 1 for i, t in enumerate(row) if t in stop_set), None) if stop_set else None
            n = end or len(row)
            ids_out.append(row[:n])
            logp_out.append(logps_h[b] if n == steps else logps_h[b][:n])
            stopped.append(end is not None)
        return ids_out, logp_out, stopped

    def _static_step(self, kv: CascadeKV, head: "_LMHead | None"):
        """One static-shape decode step ``tokens [B] -> logits [B, V]`` (fp32) for this rollout:
        every shape fixed by the batch and the suffix capacity, write slots and masks from
        ``kv.static_slot`` (advanced in place). ``decode='cuda_graph'`` captures it at its
        first call and replays the graph after that."""

        def step(tok: torch.Tensor) -> torch.Tensor:
            pos = kv.static_step_begin()
            out = self._project(self._forward(kv, tok[:, None], pos, head), head)
            kv.static_step_end()
            return out

        if self.decode == "static":
            return step
        return _CudaGraphStep(step, kv)

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
        sampling = self._check_sampling(sampling)
        prompts = validate_prompts(
            prompts, group_size=group_size, vocab_size=self.vocab_size, max_length=self.max_length, max_new_tokens=sampling.max_new_tokens
        )
        t0 = time.perf_counter()
        device = self.model.get_input_embeddings().weight.device
        backend = resolve_backend(self.backend, device)
        G = group_size
        N = len(prompts)
        B = N * G
        L = sampling.max_new_tokens
        distinct: dict[tuple[int, ...], int] = {}
        for p in prompts:
            distinct.setdefault(tuple(p), len(distinct))
        which = [distinct[tuple(p)] for p in prompts]
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
        stop_ids = self._stop_ids(sampling, device)
        with self._shared_prefix_attention():
            kv, last_logits = self._prefill([list(p) for p in distinct], device, backend)
            head = self._head(device, rows=B, steps=L - 1) if L > 1 else None
            kv.set_rows([which[b // G] for b in range(B)], group_size=G)
            kv.reserve(max(L - 1, 0))
            logits = last_logits[torch.tensor(which, device=device)].repeat_interleave(G, dim=0)  # [B, V]
            completion_ids, completion_logp, stopped = self._decode(kv, logits, [L] * B, sampling, stop_ids, uniforms, gen, head)
        del head
        computed = kv.cu_seqlens[-1]
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
            prompts, completion_ids, completion_logp, ["stop" if s else "length" for s in stopped],
            group_size=G, pad_token_id=self.pad_token_id, stats=stats,
        )

    def _check_sampling(self, sampling: SamplingConfig | None) -> SamplingConfig:
        sampling = sampling if sampling is not None else SamplingConfig()
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        return sampling

    # ------------------------------------------------------------------ multi-turn
    @torch.no_grad()
    def start(
        self, prompts: list[list[int]], *, group_size: int, sampling: SamplingConfig | None = None,
        prompt_seeds: Sequence[int] | None = None,
    ) -> MultiTurnState:
        """Open a multi-turn rollout: prefill the distinct prompts once; trajectory
        ``t = i * group_size + j`` is sample ``j`` of prompt ``i``. Nothing is sampled yet:
        the first :meth:`continue_` samples the first turn.

        Contract: every ``continue_`` call names the trajectories that go on (the others drop
        out and their suffix memory is released), appends tokens to each (the environment's
        answer; may be empty on the first turn), and samples up to ``max_new_tokens`` new
        tokens per trajectory. Turn ``k`` runs only the appended tokens (plus the previous
        turn's last sampled token, whose keys/values are not stored yet) through the model,
        never the history; the ``G`` trajectories of a prompt keep reading one copy of its
        prompt's keys/values.

        Seeds: turn ``k`` of trajectory ``t`` draws its uniforms from the seed given to
        ``continue_(seeds=...)``, else ``(prompt_seeds[i] * G + j) * TURN_SEED_STRIDE + k``: a
        trajectory's tokens depend on its own seed, history and budget alone, not on the
        other trajectories in the batch. Without either, ``sampling.seed`` seeds one
        generator per turn (batch-dependent), else the global generator.

        Memory: prompts ``U * P_max`` token slots (padded), trajectories ``B * capacity``
        slots; the capacity grows (to the larger of what the turn needs and twice the old
        one, one copy) when a turn would pass it. ``close`` releases everything.
        """
        sampling = self._check_sampling(sampling)
        prompts = validate_prompts(prompts, group_size=group_size, vocab_size=self.vocab_size, max_length=self.max_length, max_new_tokens=1)
        N = len(prompts)
        seeds = validate_prompt_seeds(prompt_seeds, N) if prompt_seeds is not None else None
        device = self.model.get_input_embeddings().weight.device
        backend = resolve_backend(self.backend, device)
        distinct: dict[tuple[int, ...], int] = {}
        for p in prompts:
            distinct.setdefault(tuple(p), len(distinct))
        which = [distinct[tuple(p)] for p in prompts]
        G = group_size
        B = N * G
        with self._shared_prefix_attention():
            kv, last_logits = self._prefill([list(p) for p in distinct], device, backend)
        head = self._head(device, rows=B, steps=None)
        kv.set_rows([which[t // G] for t in range(B)], group_size=G)
        first = last_logits[torch.tensor(which, device=device)].repeat_interleave(G, dim=0)
        state = MultiTurnState(kv=kv, sampling=sampling, prompts=prompts, group_size=G, prompt_seeds=seeds,
                               live=list(range(B)), history=[[] for _ in range(B)], pending=[[] for _ in range(B)],
                               first_logits=first, head=head)
        state.prefill_tokens.append(kv.cu_seqlens[-1])
        state.forward_tokens.append(kv.cu_seqlens[-1])
        return state

    @torch.no_grad()
    def continue_(
        self, state: MultiTurnState, appended: Sequence[Sequence[int]], *, trajectories: Sequence[int] | None = None,
        max_new_tokens: int | Sequence[int], seeds: Sequence[int] | None = None,
    ) -> list[TurnOutput]:
        """One turn: append ``appended[i]`` to trajectory ``trajectories[i]`` (default: every
        live trajectory, in order) and sample up to ``max_new_tokens`` (one int, or one per
        trajectory) after it. Trajectories left out are dropped for good. Returns one
        :class:`TurnOutput` per named trajectory."""
        if state.closed:
            raise ValueError("continue_: this multi-turn state was closed")
        ids = list(state.live) if trajectories is None else [int(t) for t in trajectories]
        live = set(state.live)
        if len(set(ids)) != len(ids) or any(t not in live for t in ids):
            raise ValueError(f"continue_: trajectories must be distinct live trajectory ids, got {ids} (live: {state.live})")
        if not ids:
            raise ValueError("continue_: no trajectory to continue")
        appended = [[int(x) for x in a] for a in appended]
        if len(appended) != len(ids):
            raise ValueError(f"continue_: appended has {len(appended)} entries for {len(ids)} trajectories")
        budgets = [int(max_new_tokens)] * len(ids) if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
        if len(budgets) != len(ids) or any(n < 1 for n in budgets):
            raise ValueError(f"continue_: max_new_tokens must be an int >= 1 or one per trajectory, got {max_new_tokens!r}")
        G = state.group_size
        for t, a, n in zip(ids, appended, budgets):
            bad = [x for x in a if x < 0 or x >= self.vocab_size]
            if bad:
                raise ValueError(f"continue_: tokens appended to trajectory {t} are outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            total = len(state.prompts[t // G]) + len(state.history[t]) + len(a) + n
            if self.max_length is not None and total > self.max_length:
                raise ValueError(f"continue_: trajectory {t} would reach {total} tokens, past the model's maximum length {self.max_length}")
        if seeds is not None:
            seeds = [int(s) for s in seeds]
            if len(seeds) != len(ids):
                raise ValueError(f"continue_: seeds must have one entry per trajectory ({len(ids)}), got {len(seeds)}")
        elif state.prompt_seeds is not None:
            seeds = [(state.prompt_seeds[t // G] * G + t % G) * TURN_SEED_STRIDE + state.turn for t in ids]
        kv = state.kv
        device = kv.device
        sampling = state.sampling
        head = state.head
        if head is not None:
            head.refresh()  # the weights may have changed since the last turn
        rows = [state.live.index(t) for t in ids]
        kv.keep(rows)
        first = state.first_logits[torch.tensor(rows, device=device)] if state.first_logits is not None else None
        state.live = ids
        todo = [state.pending[t] + a for t, a in zip(ids, appended)]
        counts = [len(x) for x in todo]
        T = max(counts)
        # a row may run max(budgets) - 1 decode steps (rows that are done may keep stepping, unread)
        kv.reserve(max(s + c for s, c in zip(kv.suffix_len, counts)) + max(budgets))
        gen = None
        uniforms = None
        if not sampling.greedy and seeds is not None:
            L = max(budgets)
            uniforms = torch.zeros(len(ids), L, dtype=torch.float64)
            for i, (s, n) in enumerate(zip(seeds, budgets)):
                uniforms[i, :n] = torch.rand(n, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
            uniforms = uniforms.to(device)
        elif not sampling.greedy and sampling.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(sampling.seed * TURN_SEED_STRIDE + state.turn)
        with self._shared_prefix_attention():
            if T > 0:
                batch_ids = torch.full((len(ids), T), self.pad_token_id, dtype=torch.long, device=device)
                for i, x in enumerate(todo):
                    if x:
                        batch_ids[i, T - len(x):] = torch.tensor(x, dtype=torch.long, device=device)
                pos = kv.set_forward(counts, T)
                logits = self._project(self._forward(kv, batch_ids, pos, head), head)
                if min(counts) == 0:
                    if first is None:
                        raise RuntimeError("continue_: a trajectory has neither new tokens nor next-token logits")
                    empty = torch.tensor([c == 0 for c in counts], device=device)[:, None]
                    logits = torch.where(empty, first, logits)
            else:
                logits = first
            after = list(kv.suffix_len)
            out_ids, out_logp, stopped = self._decode(kv, logits, budgets, sampling, self._stop_ids(sampling, device), uniforms, gen, head)
        # the last sampled token of each row is run at the start of the next turn
        kv.suffix_len = [s + len(c) - 1 for s, c in zip(after, out_ids)]
        for t, a, c in zip(ids, appended, out_ids):
            state.history[t].extend(a)
            state.history[t].extend(c)
            state.pending[t] = [c[-1]]
        state.prefill_tokens.append(sum(len(a) for a in appended))
        state.forward_tokens.append(sum(counts) + sum(len(c) - 1 for c in out_ids))
        state.first_logits = None
        state.turn += 1
        return [TurnOutput(c, [float(x) for x in lp.tolist()], st) for c, lp, st in zip(out_ids, out_logp, stopped)]

    def close(self, state: MultiTurnState | None = None) -> None:
        """Release a multi-turn rollout's keys/values. Without a state it does nothing (the
        sampler itself holds nothing between calls; samplers are closed that way by the trainer)."""
        if state is None:
            return
        kv = state.kv
        for ts in (kv.prefix_k, kv.prefix_v, kv.suffix_k, kv.suffix_v):
            for layer in range(len(ts)):
                ts[layer] = None
        state.first_logits = None
        state.head = None
        state.live = []
        state.closed = True

