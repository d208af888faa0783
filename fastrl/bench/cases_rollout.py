"""``fastrl bench`` cases for group rollouts: shared-prefix HF sampling vs ``model.generate``
on G copies of the prompt (tiny Llama from a config). The full sweep with prefill-token and
KV-byte figures is ``benchmarks/bench_rollout.py``.

On CPU both implementations run with one intra-op thread (restored afterwards): token-by-
token decode of a tiny model is a stream of small ops, and with several threads on a
loaded machine the timings measure thread wake-ups rather than the work.
"""

from __future__ import annotations

import torch

from fastrl.bench.harness import BenchCase
from fastrl.bench.rollout_cases import duplicated_fn, random_prompt, shared_prefix_fn, tiny_bench_model


def _on_one_cpu_thread(fn, device: torch.device):
    if device.type != "cpu":
        return fn

    def run():
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return run


def cases(device: torch.device, quick: bool) -> list[BenchCase]:
    model = tiny_bench_model(device=device)
    shapes = [(1024, 8, 32)] if quick else [(512, 8, 64), (2048, 8, 64), (2048, 16, 256)]
    out = []
    for P, G, L in shapes:
        prompt = random_prompt(P, model.config.vocab_size)
        out.append(
            BenchCase(
                op="rollout_group",
                shape=f"P={P} G={G} L={L}",
                impls={
                    "fastrl": _on_one_cpu_thread(shared_prefix_fn(model, prompt, G, L), device),
                    "hf_generate_dup": _on_one_cpu_thread(duplicated_fn(model, prompt, G, L), device),
                },
                note="HFGroupSampler (prompt prefilled once) vs model.generate on G prompt copies",
                repeats=2 if quick else 3,
            )
        )
    return out
