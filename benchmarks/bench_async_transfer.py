"""What moving weights and rollouts between the trainer and the ``--async_steps`` sampler
process costs the trainer, per step, on the embedded default's model and rollout shape:
before (the weights' ``state_dict`` serialised with ``torch.save`` and the rollout
deserialised with ``torch.load``, as ``fastrl/rollout/process.py`` did) and now
(``ProcessSampler.put_weights``' copy into a shared-memory slot, ``decode_batch`` of the raw
tensor bytes).

    python benchmarks/bench_async_transfer.py --out benchmarks/results/async_transfer_cpu.json

One process pinned to one core, torch at one thread; each operation timed ``--repeats``
times in ``--rounds`` interleaved rounds (before, now, before, ...), best round's mean kept
(other processes only add time), CPU seconds (``time.process_time``) beside wall. The
1-minute load average is recorded at the start and the end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMAND = "python benchmarks/bench_async_transfer.py --out benchmarks/results/async_transfer_cpu.json"
CORE = 0


def timed(fn, repeats: int) -> tuple[float, float]:
    """Mean (wall, CPU) seconds of ``fn()`` over ``repeats`` calls (one warm-up call first)."""
    fn()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - w0) / repeats, (time.process_time() - c0) / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    os.sched_setaffinity(0, {CORE})
    import torch

    torch.set_num_threads(1)
    from fastrl.bench.harness import write_payload
    from fastrl.rollout.base import SamplingConfig
    from fastrl.rollout.hf import HFGroupSampler
    from fastrl.rollout.process import WeightSlots, decode_batch, encode_batch
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    load_start = os.getloadavg()[0]
    task, tokenizer = DefaultTask(), char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=task.hidden_size, layers=task.layers)
    prompts = [tokenizer(f"<|user|>{10 + 3 * i}+{20 + 5 * i}=<|assistant|>")["input_ids"] for i in range(task.grpo_prompts_per_step)]
    batch = HFGroupSampler(model, pad_token_id=tokenizer.pad_token_id).generate(
        prompts, group_size=task.grpo_group_size, sampling=SamplingConfig(max_new_tokens=task.max_new_tokens, seed=0),
        prompt_seeds=list(range(len(prompts))))
    slots = WeightSlots(model, count=2)

    def saved_weights() -> bytes:  # before: a state_dict snapshot, torch.save'd
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
        return buffer.getvalue()

    def saved_batch() -> bytes:
        buffer = io.BytesIO()
        torch.save(batch, buffer)
        return buffer.getvalue()

    old_batch, new_batch = saved_batch(), encode_batch(batch)
    ops = {
        "weights": {"before": saved_weights, "now": lambda: slots.write(0, model)},
        "receive": {"before": lambda: torch.load(io.BytesIO(old_batch), map_location="cpu", weights_only=False),
                    "now": lambda: decode_batch(new_batch)},
    }
    best: dict[str, dict[str, dict[str, float]]] = {op: {} for op in ops}
    for _ in range(args.rounds):
        for op, ways in ops.items():
            for way, fn in ways.items():
                wall, cpu = timed(fn, args.repeats)
                kept = best[op].get(way)
                if kept is None or wall < kept["wall_ms"]:
                    best[op][way] = {"wall_ms": round(wall * 1e3, 3), "cpu_ms": round(cpu * 1e3, 3)}
    payload = {
        "what": "per-step transfer cost on the trainer's side of --async_steps 1, embedded default model "
                f"({sum(p.numel() for p in model.parameters())} parameters, {len(model.state_dict())} tensors) and "
                f"rollout ({len(batch.completion_ids)} samples): before (torch.save of the state dict; torch.load of "
                "the rollout) vs now (copy into a shared-memory slot; decode_batch)",
        "command": COMMAND,
        "machine": "the project's 2-core CPU, shared with other sessions",
        "pinning": f"core {CORE}, torch at 1 thread",
        "load_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "date": time.strftime("%Y-%m-%d"),
        "bytes": {"weights_before": len(saved_weights()), "weights_now_through_the_pipe": 0,
                  "rollout_before": len(old_batch), "rollout_now": len(new_batch)},
        "best_of": f"{args.rounds} interleaved rounds of {args.repeats} calls each",
        "ms": best,
    }
    write_payload(payload, args.out, stem="async-transfer-cpu")
    print(json.dumps(payload["ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
