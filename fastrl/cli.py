"""The ``fastrl`` command line: ``fastrl train``, ``fastrl bench`` and ``fastrl env``."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

# Benchmark case modules, each exposing ``cases(device, quick) -> list[BenchCase]``.
BENCH_MODULES = (
    "cases_policy_loss",
    "cases_advantages",
    "cases_rollout",
    "cases_scans",
    "cases_logprobs",
)


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cmd_bench(args: argparse.Namespace) -> int:
    from fastrl.bench.harness import format_header, run_cases, write_results

    device = _device(args.device)
    selected = [m for m in BENCH_MODULES if not args.only or any(s in m for s in args.only)]
    print(f"fastrl bench on {device} ({'quick' if args.quick else 'full'})")
    print(format_header())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    mode = "quick" if args.quick else "full"
    out = Path(args.out) if args.out else Path("benchmarks/results") / f"bench-{device.type}-{mode}-{stamp}.json"
    results = []
    for module_name in selected:
        module = importlib.import_module(f"fastrl.bench.{module_name}")
        results.extend(run_cases(module.cases(device, quick=args.quick), device))
        # Written after every module so a run cut short by a time limit keeps what it measured.
        write_results(results, device, out, extra={"quick": args.quick, "modules": selected})
    print(f"results written to {out}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    import torch

    from fastrl.bench.harness import environment

    print(json.dumps(environment(_device("auto")), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    # `fastrl train` has its own parser generated from TrainConfig (see fastrl/train/cli.py);
    # this entry only lists it in the top-level help.
    sub.add_parser("train", help="train a model with GRPO-family algorithms or PPO (fastrl train --help)", add_help=False)

    bench = sub.add_parser("bench", help="benchmark fastrl ops against the baselines users run today")
    bench.add_argument("--quick", action="store_true", help="small shapes, a few repeats (about a minute on CPU)")
    bench.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda[:N]")
    bench.add_argument("--only", nargs="*", help="run only case modules whose name contains one of these words")
    bench.add_argument("--out", help="JSON output path (default: benchmarks/results/bench-<device>-<mode>-<time>.json)")
    bench.set_defaults(func=cmd_bench)

    from fastrl.train.plan import add_plan_arguments, run_plan

    add_plan_arguments(sub.add_parser("plan", help="peak memory of a GRPO/PPO step per component; longest trajectory that fits")).set_defaults(func=run_plan)

    env = sub.add_parser("env", help="print the device, versions and threads fastrl sees")
    env.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train":
        from fastrl.train.cli import run_train

        return run_train(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
