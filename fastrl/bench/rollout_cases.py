"""Shared-prefix group sampling vs the duplicated-prompt baseline (helpers for the benchmarks).

Baseline: ``model.generate`` on G copies of the prompt (a standard ``DynamicCache``
decode) -- it prefills ``G * P`` tokens and keeps ``G * (P + L)`` token slots of keys and
values. ``HFGroupSampler`` prefills ``P`` tokens and keeps ``P + G * (L - 1)`` slots.
Both sample exactly ``L`` tokens per completion (the bench model has no eos) at
temperature 1 without top-k/top-p, in the same process.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fastrl.rollout.base import SamplingConfig
from fastrl.rollout.hf import HFGroupSampler


def tiny_bench_model(*, vocab: int = 512, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     max_positions: int = 4096, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     seed: int = 0):
    """A small Llama built from a config (no download), without an eos so lengths are fixed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def kv_slot_bytes(model) -> int:
    """Bytes of keys + values of one token over all layers."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * next(model.parameters()).element_size()


def random_prompt(P: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (P,), generator=g).tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shared_prefix_fn(model, prompt: list[int], G: int, L: int, *, backend: str = "auto"):
    """Zero-argument callable: one ``HFGroupSampler.generate`` call; returns its batch."""
    sampler = HFGroupSampler(model, backend=backend)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=L, seed=0)
    return lambda: sampler.generate([prompt], group_size=G, sampling=cfg)


def duplicated_fn(model, prompt: list[int], G: int, L: int):
    """Zero-argument callable: ``model.generate`` on G copies of the prompt."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device).repeat(G, 1)

    def run():
        return model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=L, min_new_tokens=L,
            temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, return_dict_in_generate=True,
        )

    return run


def cache_bytes(past_key_values) -> int:
    total = 0
    for layer in getattr(past_key_values, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _median_seconds(fn, repeats: int, device: torch.device) -> tuple[float, Any]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], out


def compare(model, *, P: int, G: int, L: int, repeats: int = 3, backend: str = "auto") -> dict[str, Any]:
    """One row: prefill tokens, KV bytes, wall time of both paths and their ratios."""
    device = next(model.parameters()).device
    prompt = random_prompt(P, model.config.vocab_size)
    t_shared, batch = _median_seconds(shared_prefix_fn(model, prompt, G, L, backend=backend), repeats, device)
    t_dup, out = _median_seconds(duplicated_fn(model, prompt, G, L), repeats, device)
    assert batch.stats.generated_tokens == G * L and out.sequences.shape == (G, P + L)
    slot = kv_slot_bytes(model)
    kv_shared = batch.stats.peak_kv_cache_bytes
    kv_dup = cache_bytes(out.past_key_values)
    return {
        "P": P, "G": G, "L": L,
        "prefill_tokens_shared": batch.stats.prefill_tokens_computed,
        "prefill_tokens_duplicated": G * P,
        "kv_bytes_shared": kv_shared,
        "kv_bytes_duplicated": kv_dup,
        "kv_bytes_ideal_P_plus_GL": (P + G * L) * slot,
        "kv_shared_over_ideal": kv_shared / ((P + G * L) * slot),
        "kv_duplicated_over_shared": kv_dup / kv_shared,
        "seconds_shared": t_shared,
        "seconds_duplicated": t_dup,
        "speedup": t_dup / t_shared,
    }


def qwen2_bench_model(*, vocab: int = 151_936, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                      intermediate: int | None = None, max_positions: int = 4096, seed: int = 0):
    """A seeded random Qwen2 built from a config (no download), without an eos (fixed lengths).
    The default is issue 20's "real shape": vocabulary 151,936, hidden 256, 4 layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=0, use_sliding_window=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def load_sampler_from_git(revision: str, *, tag: str):
    """``HFGroupSampler`` as it was at a git revision (``git show REV:fastrl/rollout/hf.py``,
    with ``fastrl/ops/decode_attention.py`` of that revision), imported as a module of its own; its attention-interface names get ``tag`` appended so it
    does not replace the current sampler's registration."""
    import importlib.util
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    src = subprocess.run(["git", "show", f"{revision}:fastrl/rollout/hf.py"], cwd=root, check=True, capture_output=True, text=True).stdout
    src = src.replace('"fastrl_shared_prefix"', f'"fastrl_shared_prefix_{tag}"').replace('"fastrl_shared_prefix_kv"', f'"fastrl_shared_prefix_kv_{tag}"')
    tmp = Path(tempfile.mkdtemp())
    # its decode attention as it was then too (the sampler's CPU attention lives in fastrl/ops)
    ops = subprocess.run(["git", "show", f"{revision}:fastrl/ops/decode_attention.py"], cwd=root, capture_output=True, text=True)
    if ops.returncode == 0 and "from fastrl.ops.decode_attention import" in src:
        ops_name = f"decode_attention_{tag}"
        (tmp / f"{ops_name}.py").write_text(ops.stdout)
        ops_spec = importlib.util.spec_from_file_location(ops_name, tmp / f"{ops_name}.py")
        ops_module = importlib.util.module_from_spec(ops_spec)
        sys.modules[ops_name] = ops_module
        ops_spec.loader.exec_module(ops_module)
        src = src.replace("from fastrl.ops.decode_attention import", f"from {ops_name} import")
    path = tmp / f"hf_sampler_{tag}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"hf_sampler_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through it
    spec.loader.exec_module(module)
    return module.HFGroupSampler
