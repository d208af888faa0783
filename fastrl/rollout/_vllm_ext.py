"""Classes that run inside vLLM's engine for ``fastrl.rollout.vllm.VLLMGroupSampler``.

They import vLLM at module level and are named to vLLM by their qualified names, so the
engine's worker process (when vLLM runs with multiprocessing) can import them too.

- ``GreedyTemperedLogits``: a logits processor that makes vLLM's greedy log-probs those of
  the tempered, top-k/top-p filtered distribution (``SamplingConfig.greedy`` contract).
- ``WeightSyncExtension``: a worker extension that reloads weights sent as bytes.
"""

from __future__ import annotations

import io

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, process_dict_updates
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

GREEDY_KEY = "fastrl_greedy"
"""``SamplingParams.extra_args`` key: ``(temperature, top_k, top_p)`` for a greedy request."""

GREEDY_PROCESSOR = f"{__name__}:GreedyTemperedLogits"
WORKER_EXTENSION = f"{__name__}.WeightSyncExtension"


class GreedyTemperedLogits(LogitsProcessor):
    """Divide a greedy request's logits by its temperature and apply its top-k/top-p mask.

    vLLM's greedy path (temperature 0) takes the argmax of the logits after the
    non-argmax-invariant logits processors, and its ``processed_logprobs`` are the
    log-softmax of those same logits. Declaring this processor argmax-*variant* puts it
    in that stage, so the returned log-prob becomes log_softmax(filter(logits / T)) at the
    argmax. Neither operation moves the argmax (ties aside), so the tokens are unchanged.
    Rows without the ``extra_args`` key are left alone.
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[float, int, float]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        args = (sampling_params.extra_args or {}).get(GREEDY_KEY)
        if args is not None:
            temperature, top_k, top_p = args
            if not (temperature > 0 and top_k >= 0 and 0 < top_p <= 1):
                raise ValueError(f"bad {GREEDY_KEY} extra_args {args!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def state(params, _prompt, _output):
            args = (params.extra_args or {}).get(GREEDY_KEY)
            return None if args is None else (float(args[0]), int(args[1]), float(args[2]))

        process_dict_updates(self.rows, batch_update, state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(self.rows)
        idx = torch.tensor(index, dtype=torch.long, device=logits.device)
        params = [self.rows[i] for i in index]
        vocab = logits.shape[-1]
        temperature = torch.tensor([p[0] for p in params], dtype=logits.dtype, device=logits.device)
        rows = logits.index_select(0, idx) / temperature[:, None]
        k = [p[1] if 0 < p[1] < vocab else vocab for p in params]
        p = [p[2] for p in params]
        k_t = torch.tensor(k, dtype=torch.long, device=logits.device) if any(x < vocab for x in k) else None
        p_t = torch.tensor(p, dtype=logits.dtype, device=logits.device) if any(x < 1.0 for x in p) else None
        rows = apply_top_k_top_p_pytorch(rows, k_t, p_t)
        logits.index_copy_(0, idx, rows)
        return logits


class WeightSyncExtension:
    """Worker extension (``LLM(worker_extension_cls=WORKER_EXTENSION)``) for engines that
    run in a separate process: the weights arrive as ``torch.save`` bytes of a list of
    ``(name, tensor)`` pairs and go through the worker's ``reload_weights`` (which, unlike
    raw ``model.load_weights``, re-runs the CPU backend's weight repacking)."""

    def fastrl_reload_weights(self, payload: bytes) -> None:
        named = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        self.reload_weights(weights_iterator=iter(named))  # type: ignore[attr-defined]
