"""Peak memory and time of a TRL GRPO loss step with and without fastrl (CPU, fresh processes).

Each implementation runs in its own fresh Python process: build TRL's ``GRPOTrainer`` (or
fastrl's drop-in subclass) on a small Llama built from a config with a large vocabulary,
generate one batch, then measure one training micro-step (``compute_loss`` + ``backward``):

- peak memory: the process's peak resident set size (Linux ``VmHWM``), reset just before
  the step (``/proc/self/clear_refs``), minus the resident size at that moment;
- time: the best of ``--repeats`` steps.

Results go to ``benchmarks/results/trl_memory_cpu.json`` with the versions and shapes.

    python benchmarks/bench_trl_memory.py            # default shapes
    python benchmarks/bench_trl_memory.py --quick    # smaller, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "integrations"))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def child(opts: argparse.Namespace) -> None:
    import gc
    import warnings

    import torch
    from trl import GRPOConfig, GRPOTrainer

    from trl_tiny import count_a_reward, prompt_dataset

    torch.set_num_threads(opts.threads)
    cls = GRPOTrainer
    if opts.impl == "fastrl":
        from fastrl.integrations.trl import FastRLGRPOTrainer as cls  # noqa: N813
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=opts.batch,
        num_generations=opts.batch,
        max_completion_length=opts.completion,
        loss_type=opts.loss_type,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        model_init_kwargs={"dtype": torch.float32},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=opts.model, reward_funcs=count_a_reward, args=args, train_dataset=prompt_dataset(8))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model = trainer.model
    n_tokens = int(inputs["completion_mask"].sum())
    times, peaks = [], []
    for _ in range(opts.repeats):
        model.zero_grad(set_to_none=True)
        gc.collect()
        rss0 = _status_kib("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        times.append(time.perf_counter() - t0)
        peaks.append(_status_kib("VmHWM") - rss0)
        del loss
    print(
        "RESULT "
        + json.dumps(
            {
                "impl": opts.impl,
                "step_peak_mib": min(peaks) / 1024,
                "step_peak_mib_first": peaks[0] / 1024,
                "step_time_s": min(times),
                "step_time_s_median": statistics.median(times),
                "completion_tokens": n_tokens,
                "completion_shape": list(inputs["completion_ids"].shape),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 32768, quick 8192)")
    p.add_argument("--batch", type=int, default=None, help="completions per step (default 16, quick 8)")
    p.add_argument("--completion", type=int, default=None, help="max completion length (default 128, quick 32)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "trl_memory_cpu.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    opts = p.parse_args()
    opts.vocab = opts.vocab or (8192 if opts.quick else 32768)
    opts.batch = opts.batch or (8 if opts.quick else 16)
    opts.completion = opts.completion or (32 if opts.quick else 128)
    if opts.child:
        child(opts)
        return

    from trl_tiny import CHARS, build_tiny_llama

    model_dir = build_tiny_llama(
        tempfile.mkdtemp(prefix="fastrl_bench_llama_"), hidden_size=opts.hidden, vocab_pad=opts.vocab - len(CHARS) - 3
    )
    results = {}
    for impl in ("trl", "fastrl"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--impl", impl, "--model", model_dir]
        for k in ("vocab", "batch", "completion", "hidden", "repeats", "threads"):
            cmd += [f"--{k}", str(getattr(opts, k))]
        cmd += ["--loss-type", opts.loss_type]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"{impl} run failed")
        results[impl] = json.loads(line[0][len("RESULT ") :])

    import torch
    import transformers
    import trl

    trl_r, fr = results["trl"], results["fastrl"]
    record = {
        "benchmark": "TRL GRPO loss step (compute_loss + backward), peak RSS increase and time",
        "device": "cpu",
        "platform": platform.platform(),
        "threads": opts.threads,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "shapes": {
            "vocab": opts.vocab,
            "hidden": opts.hidden,
            "completions": opts.batch,
            "max_completion_length": opts.completion,
            "completion_tokens": trl_r["completion_tokens"],
            "loss_type": opts.loss_type,
        },
        "results": results,
        "ratios": {
            "peak_memory_fastrl_over_trl": fr["step_peak_mib"] / max(trl_r["step_peak_mib"], 1e-9),
            "time_fastrl_over_trl": fr["step_time_s"] / trl_r["step_time_s"],
        },
    }
    os.makedirs(os.path.dirname(opts.out), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"{'impl':8s} {'peak MiB':>10s} {'step s':>8s}")
    for impl, r in results.items():
        print(f"{impl:8s} {r['step_peak_mib']:10.1f} {r['step_time_s']:8.3f}")
    print(json.dumps(record["ratios"]))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
