"""One supervised warm-up step (forward, backward, AdamW) in the two layouts of
``fastrl.train.sft``: padded rows ``[B, T]`` vs the trie of the batch's sequences, on the
batches the warm-up of each built-in task draws (the default arithmetic task, and the oracle
demonstrations of calculator, sql and frozenlake), each on its own ``fastrl train`` model
(the embedded defaults' sizes). Reports the tokens each layout runs, the trie's saving (the
``sft_layout=auto`` rule's input, ``SFT_TRIE_MIN_SAVING``), the step seconds (interleaved,
best of ``--rounds``) and their ratio, and the largest loss difference between the layouts.

    python benchmarks/bench_sft_layout.py --out benchmarks/results/sft_layout_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl.bench.harness import environment, write_payload  # noqa: E402

TASKS = ("default", "calculator", "sql", "frozenlake")


def _batches(task: str, tokenizer, batch_size: int, count: int, seed: int):
    """``count`` padded warm-up batches ``(input_ids, attention_mask, loss_mask)`` of ``task``,
    and the model size of its ``fastrl train`` run ``(hidden, layers, heads, positions)``."""
    from fastrl.agents.batch import collate_samples
    from fastrl.train.sft import collate_sft, encode_sft_example
    from fastrl.train.task import DefaultTask

    g = torch.Generator().manual_seed(seed)
    if task == "default":
        d = DefaultTask()
        rows = d.task.train_rows()
        examples = [encode_sft_example(tokenizer, r["prompt"], r["answer"]) for r in rows[: 50 * batch_size]]
        pick = lambda: [examples[i] for i in torch.randperm(len(examples), generator=g)[:batch_size].tolist()]  # noqa: E731
        batches = [collate_sft(pick(), pad_token_id=tokenizer.pad_token_id) for _ in range(count)]
        return batches, (d.hidden_size, d.layers, d.heads, d.max_position_embeddings)
    from fastrl.agents.envs import BUILTIN_ENVS, synthetic_transcripts
    from fastrl.agents.render import ChatRenderer, demonstration_sample
    from fastrl.train.env_task import ENV_TASKS

    spec = ENV_TASKS[task]
    train, _ = BUILTIN_ENVS[task].rows(num_train=spec.num_train, num_heldout=spec.num_heldout, seed=seed)
    renderer = ChatRenderer(tokenizer, tools=None)
    samples = [demonstration_sample(renderer, p, t) for p, t in synthetic_transcripts(task, train, call_format="compact", seed=seed)]
    pick = lambda: [samples[i] for i in torch.randperm(len(samples), generator=g)[:batch_size].tolist()]  # noqa: E731
    batches = [collate_samples(pick(), pad_token_id=tokenizer.pad_token_id) for _ in range(count)]
    return batches, (spec.hidden_size, spec.layers, spec.heads, spec.agent["max_trajectory_tokens"])


def _step(model, optimizer, batch, layout: str) -> float:
    from fastrl.ops.hf_packed import shared_prefix_attention_enabled
    from fastrl.train.sft import sft_loss, trie_batch, trie_sft_loss

    ids, mask, weights = batch
    if layout == "trie":
        trie = trie_batch(ids, mask, weights)  # built in the step: the warm-up builds it every step
        with shared_prefix_attention_enabled(model):
            loss = trie_sft_loss(model, trie)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
    else:
        loss = sft_loss(model, ids, mask, weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    optimizer.step()
    return float(loss.detach())


def measure(task: str, *, batch_size: int, batches: int, rounds: int, seed: int) -> dict:
    from fastrl.ops.hf_packed import shared_prefix_attention_enabled
    from fastrl.train.sft import sft_loss, trie_batch, trie_sft_loss
    from fastrl.train.task import char_tokenizer, tiny_model

    tok = char_tokenizer()
    data, (hidden, layers, heads, positions) = _batches(task, tok, batch_size, batches, seed)
    base = tiny_model(tok, hidden_size=hidden, layers=layers, heads=heads, max_position_embeddings=positions, seed=seed)
    padded_tokens = [int(b[0].numel()) for b in data]
    real_tokens = [int(b[1].sum()) for b in data]
    tries = [trie_batch(*b) for b in data]
    trie_tokens = [t.tokens for t in tries]
    # loss agreement: the same weights, each batch in both layouts
    check = copy.deepcopy(base)
    loss_gap = 0.0
    with torch.no_grad():
        with shared_prefix_attention_enabled(check):
            trie_losses = [float(trie_sft_loss(check, trie)) for trie in tries]
        for b, t in zip(data, trie_losses):
            loss_gap = max(loss_gap, abs(t - float(sft_loss(check, *b))))
    seconds = {"padded": [], "trie": []}
    models = {k: copy.deepcopy(base) for k in seconds}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    for k in seconds:  # one warm-up step each (allocator, lazy init)
        _step(models[k], optimizers[k], data[0], k)
    for r in range(rounds):
        order = ("padded", "trie") if r % 2 == 0 else ("trie", "padded")
        for k in order:
            t0 = time.perf_counter()
            for b in data:
                _step(models[k], optimizers[k], b, k)
            seconds[k].append((time.perf_counter() - t0) / len(data))
    best = {k: min(v) for k, v in seconds.items()}
    return {
        "task": task, "model": {"hidden": hidden, "layers": layers, "heads": heads}, "batch_size": batch_size,
        "batches": batches, "padded_tokens_mean": sum(padded_tokens) / batches, "real_tokens_mean": sum(real_tokens) / batches,
        "trie_tokens_mean": sum(trie_tokens) / batches,
        "trie_saving": 1.0 - sum(trie_tokens) / sum(padded_tokens),
        "padded_step_s": best["padded"], "trie_step_s": best["trie"], "speed_trie_vs_padded": best["padded"] / best["trie"],
        "all_step_s": seconds, "max_loss_diff": loss_gap,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--batch-size", type=int, default=64, help="the warm-up's sft_batch_size (64 for every built-in task)")
    ap.add_argument("--batches", type=int, default=4, help="batches timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = []
    for task in args.tasks:
        rows.append(measure(task, batch_size=args.batch_size, batches=args.batches, rounds=args.rounds, seed=args.seed))
        r = rows[-1]
        print(f"{task}: tokens padded {r['padded_tokens_mean']:.0f} trie {r['trie_tokens_mean']:.0f} "
              f"(saving {r['trie_saving']:.2f}); step padded {r['padded_step_s']:.3f} s trie {r['trie_step_s']:.3f} s "
              f"-> {r['speed_trie_vs_padded']:.2f}x", flush=True)
    payload = {
        "benchmark": "sft_layout_cpu",
        "command": "python benchmarks/bench_sft_layout.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(torch.device("cpu")),
        "threads": torch.get_num_threads(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": "seconds per warm-up step (forward, backward, AdamW), best of the interleaved rounds; the trie is built inside the step",
        "shapes": {"batch_size": args.batch_size},
        "results": rows,
    }
    write_payload(payload, args.out, stem="sft-layout-cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
