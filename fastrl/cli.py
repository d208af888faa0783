"""The fastrl command line: `fastrl train`, `fastrl compare`, `fastrl plan`, `fastrl bench` and `fastrl env`.

Each subcommand is a `cmd_<name>(args) -> int` function registered in `build_parser()`;
`fastrl train` has its own parser, generated from `TrainConfig` (fastrl/train/cli.py).
A command reports a user mistake (unknown case name, a device this machine lacks) by
raising `UsageError`: `main` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

# `fastrl bench` case names -> (module in fastrl.bench exposing `cases(device, quick)`, what it measures).
BENCH_CASES = {
    "policy_loss": ("cases_policy_loss", "policy_loss and kl_penalty fwd+bwd vs TRL's and verl's eager losses"),
    "advantages": ("cases_advantages", "group advantages, value loss, masked whitening vs loop/eager baselines"),
    "rollout": ("cases_rollout", "shared-prefix HF group sampling vs model.generate on G prompt copies"),
    "scans": ("cases_scans", "GAE and discounted returns vs the Python loop over time"),
    "turns": ("cases_turn_advantages", "GiGPO turn advantages vs a Python loop over turns and step groups"),
    "logprobs": ("cases_logprobs", "GRPO loss from hidden states vs logits + log_softmax, TRL, Liger (time, peak memory)"),
}
BENCH_MODULES = tuple(module for module, _ in BENCH_CASES.values())

# Where `fastrl bench` writes its JSON when no --out is given: $FASTRL_HOME/bench, else
# $XDG_CACHE_HOME/fastrl/bench, else ~/.cache/fastrl/bench.
RESULTS_LOCATION_HELP = "$FASTRL_HOME/bench, else ~/.cache/fastrl/bench"


class UsageError(Exception):
    """A mistake in the command line or a request this machine cannot serve (exit status 2)."""


def fastrl_home() -> Path:
    """fastrl's folder for what it writes by default: $FASTRL_HOME, else the user cache."""
    if os.environ.get("FASTRL_HOME"):
        return Path(os.environ["FASTRL_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "fastrl"


def bench_results_dir() -> Path:
    return fastrl_home() / "bench"


def resolve_device(name: str):
    """`auto`, `cpu`, `cuda` or `cuda:N` as a torch.device this machine has, else UsageError."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: fastrl bench runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "torch sees no CUDA device"
            raise UsageError(f"--device {name}: CUDA is not available ({why}, torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def select_bench_cases(words: list[str] | None) -> list[str]:
    """Case names matching `--only` (each word selects the names that contain it; no words: all)."""
    if not words:
        return list(BENCH_CASES)
    unknown = [w for w in words if not any(w in name for name in BENCH_CASES)]
    if unknown:
        raise UsageError(f"--only: no benchmark case matches {', '.join(map(repr, unknown))}; "
                         f"valid names: {', '.join(BENCH_CASES)}")
    return [name for name in BENCH_CASES if any(w in name for w in words)]


def _missing_optional_package(exc: ModuleNotFoundError) -> str | None:
    """The third-party top-level package a case module could not import, or None when the
    missing module is fastrl's own (a bug, not a missing extra)."""
    top = (exc.name or "").split(".")[0]
    return None if top in ("", "fastrl", "csrc_triton") else top


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from fastrl.bench.harness import NOISE_LEGEND, format_header, run_cases, write_results

    names = select_bench_cases(args.only)
    device = resolve_device(args.device)
    mode = "quick" if args.quick else "full"
    threads = args.threads
    if threads is None and args.quick and device.type == "cpu":
        threads = 1  # quick mode: one intra-op thread, so other processes' load cannot stall barriers
    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    thread_note = (f"{torch.get_num_threads()} intra-op thread(s), "
                   + ("pinned" if threads is not None else "torch's default; --threads N pins them"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else bench_results_dir() / f"bench-{device.type}-{mode}-{stamp}.json"

    print(f"fastrl bench on {device} ({mode}): {thread_note}; ratios use best-of-n times")
    print(format_header())
    results, skipped = [], {}
    extra = {"quick": args.quick, "modules": [BENCH_CASES[n][0] for n in names], "threads": torch.get_num_threads(),
             "threads_pinned": threads is not None, "skipped": skipped}
    for name in names:
        module_name = BENCH_CASES[name][0]
        try:
            module = importlib.import_module(f"fastrl.bench.{module_name}")
            cases = module.cases(device, quick=args.quick)
        except ModuleNotFoundError as exc:
            package = _missing_optional_package(exc)
            if package is None:
                raise
            skipped[name] = f"needs {package}"
            print(f"-- {name}: skipped, {package} is not installed (the `dev` extra installs every baseline)")
            continue
        missing = getattr(module, "missing_baselines", dict)()
        if missing:  # said, not silently dropped
            rows = ", ".join(f"{impl} ({package} is not installed)" for impl, package in missing.items())
            print(f"-- {name}: without the baseline rows {rows}; pip install -e '.[dev]' adds them")
            extra.setdefault("missing_baselines", {})[name] = missing
        results.extend(run_cases(cases, device))
        # Written after every module so a run cut short by a time limit keeps what it measured.
        write_results(results, device, out, extra=extra)
    if not results:
        print("no benchmark ran: nothing written", file=sys.stderr)
        return 1
    write_results(results, device, out, extra=extra)
    compared = [r for r in results if r.within_noise is not None]
    noisy = sum(r.within_noise for r in compared)
    print(f"noise check: {noisy} of {len(compared)} ratios marked ~ ({NOISE_LEGEND})" if noisy
          else f"noise check: all {len(compared)} ratios lie outside the spread (median/best) of their rows")
    print(f"results written to {out.resolve()}")
    return 0


def environment_report() -> dict:
    """What `fastrl env` prints: versions, the device and backend `auto` picks, threads."""
    import platform

    import torch

    import fastrl
    from fastrl._checks import resolve_backend, triton_available
    from fastrl.bench.harness import package_versions

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend("auto", device)
    if backend == "triton":
        why = "Triton kernels on CUDA tensors"
    elif device.type == "cuda":
        why = "PyTorch path: triton is not importable"
    else:
        why = "PyTorch path: the Triton kernels run on CUDA tensors only"
    report = {
        "fastrl": fastrl.__version__,
        "fastrl_path": str(Path(fastrl.__file__).parent),
        "python": f"{platform.python_version()} ({platform.system()} {platform.machine()})",
        "versions": package_versions(),
        "tested_triton": tested_triton_range(),
        "triton_importable": triton_available(),
        "torch_cuda_build": torch.version.cuda,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "backend_auto": f"{backend} ({why})",
        "threads": {
            "intra_op": torch.get_num_threads(),
            "inter_op": torch.get_num_interop_threads(),
            "cpu_cores": os.cpu_count(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
        "bench_results_dir": str(bench_results_dir()),
    }
    report["threads"].update(train_thread_rule(device.type))
    return report


def train_thread_rule(device_type: str) -> dict:
    """What `fastrl train`'s thread rule (fastrl/train/run/threads.py) picks on this machine now
    (the free cores; a run re-reads them every half second)."""
    from fastrl.train.run.threads import builtin_model_parameters, machine_threads

    builtin = machine_threads(parameters=builtin_model_parameters(), device_type=device_type)  # the machine read once
    return {"usable_cores": builtin.cores, "other_running": builtin.load, "train_threads_now": builtin.threads,
            "train_rule": builtin.describe()}


def tested_triton_range() -> str | None:
    """The Triton requirement of the `triton` extra (installed metadata, else this checkout's
    pyproject.toml), e.g. ``>=3.6,<3.9``; None when neither can be read."""
    import importlib.metadata
    import re

    try:
        requirements = importlib.metadata.requires("fastrl-kernels") or []
    except importlib.metadata.PackageNotFoundError:
        requirements = []
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        if pyproject.is_file():
            requirements = re.findall(r'"(triton[^"]*)"', pyproject.read_text())
    for req in requirements:
        match = re.match(r"\s*triton\s*([<>=!~][^;]*)", req)
        if match:  # lower bound first, however the metadata orders them
            parts = match.group(1).replace(" ", "").split(",")
            return ",".join(sorted(parts, key=lambda part: not part.startswith(">")))
    return None


def _triton_status(version: str | None, tested: str | None) -> str:
    if version is None:
        return "not installed (fine: the PyTorch paths run without it; the CUDA kernels need it)"
    if tested is None:
        return version
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return f"{version} (tested: {tested})"
    inside = Version(version.split("+")[0]) in SpecifierSet(tested)
    return f"{version} ({'inside' if inside else 'OUTSIDE'} the tested range {tested})"


def cmd_env(args: argparse.Namespace) -> int:
    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    versions = report["versions"]
    cuda = report["torch_cuda_build"]
    print(f"fastrl        {report['fastrl']}  ({report['fastrl_path']})")
    print(f"python        {report['python']}")
    print(f"torch         {versions['torch']}  ({f'CUDA {cuda} build' if cuda else 'CPU-only build'})")
    importable = "" if report["triton_importable"] or versions["triton"] is None else ", but it does not import"
    print(f"triton        {_triton_status(versions['triton'], report['tested_triton'])}{importable}")
    for name in ("transformers", "trl", "vllm", "liger-kernel", "verl", "openrlhf"):
        print(f"{name:<13} {versions[name] or 'not installed'}")
    print(f"device        {report['device']}" + (f"  ({report['gpu']})" if report["gpu"] else ""))
    print(f"backend auto  {report['backend_auto']}")
    t = report["threads"]
    print(f"threads       intra-op {t['intra_op']}, inter-op {t['inter_op']}, cores {t['cpu_cores']} "
          f"({t['usable_cores']} usable, {t['other_running']:g} other processes running), "
          f"OMP_NUM_THREADS={t['OMP_NUM_THREADS'] or 'unset'}")
    now = "torch's default" if t["train_threads_now"] is None else t["train_threads_now"]
    print(f"train threads {now} now ({t['train_rule']})")
    if report["TRITON_INTERPRET"]:
        print(f"TRITON_INTERPRET={report['TRITON_INTERPRET']}  (kernels run in the Triton interpreter: tests only, slow)")
    print(f"bench results {report['bench_results_dir']}")
    return 0


def _version() -> str:
    from fastrl import __version__

    return f"fastrl {__version__} (distribution fastrl-kernels)"


EXAMPLES = (
    ("fastrl train", "the embedded default: GRPO on a built-in task, offline, minutes on a CPU"),
    ("fastrl train --help", "every training option with its doc (also settable from --config run.yaml)"),
    ("fastrl compare", "PPO vs GRPO, 3 seeds, equal budget: success, stability, cost, verdicts"),
    ("fastrl plan --model qwen2.5-7b --compare", "peak memory per component, PPO vs GRPO, longest trajectory that fits"),
    ("fastrl vllm-server --model DIR", "one vLLM engine that trainers share: fastrl train --sampler vllm-server URL"),
    ("fastrl bench --quick", "the benchmark table on this machine (minutes on a CPU)"),
    ("fastrl bench --only scans", "one group of cases (fastrl bench --help lists them)"),
    ("fastrl env", "versions, device, the backend `auto` picks, threads"),
    ("python -m fastrl --version", "the same CLI through the interpreter"),
)

CONVENTION = ("options: underscores (--group_size 8), dashes accepted (--group-size 8); no prefix matching;\n"
              "--debug (or FASTRL_DEBUG=1) anywhere shows the traceback of an input error.\n")


def build_parser() -> argparse.ArgumentParser:
    from fastrl.cli_style import ArgumentParser

    parser = ArgumentParser(
        prog="fastrl",
        description="fastrl: fused kernels and a lean orchestrator for LLM reinforcement learning.",
        epilog="examples:\n" + "".join(f"  {command:<27} {what}\n" for command, what in EXAMPLES) + "\n" + CONVENTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # listed here for the top-level help; main() hands `train` to its own parser
    sub.add_parser("train", help="train a model with GRPO-family algorithms or PPO (fastrl train --help)", add_help=False)
    sub.add_parser("compare", help="algorithms side by side at equal budget over seeds (fastrl compare --help)", add_help=False)

    case_list = "\n".join(f"  {name:<12} {what}" for name, (_, what) in BENCH_CASES.items())
    bench = sub.add_parser(
        "bench",
        help="benchmark fastrl ops against the baselines users run today",
        description="Benchmark fastrl ops beside the code users run today, in one process. Prints best-of-n\n"
                    "and median times, the ratio (baseline time / fastrl time, > 1: fastrl is faster) and\n"
                    "peak memory (CUDA; on CPU for the cases measured in fresh processes).",
        epilog=f"case names (for --only):\n{case_list}\n\nresults: JSON in {RESULTS_LOCATION_HELP}, unless --out\n"
               "is given; the path is printed at the end.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--quick", action="store_true",
                       help="small shapes, a few repeats (a few minutes on a 2-core CPU); pins one intra-op thread on CPU")
    bench.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda or cuda:N")
    bench.add_argument("--only", nargs="+", metavar="NAME",
                       help=f"run only the cases whose name contains one of these words ({', '.join(BENCH_CASES)})")
    bench.add_argument("--threads", type=int, default=None, metavar="N",
                       help="torch intra-op threads (default: 1 with --quick on CPU, torch's default otherwise)")
    bench.add_argument("--out", metavar="PATH",
                       help=f"JSON output path (default: bench-<device>-<mode>-<time>.json in {RESULTS_LOCATION_HELP})")
    bench.set_defaults(func=cmd_bench)

    from fastrl.commands.plan import add_plan_arguments, run_plan

    plan = sub.add_parser("plan", help="peak memory of a GRPO/PPO step per component; longest trajectory that fits")
    add_plan_arguments(plan).set_defaults(func=run_plan)

    from fastrl.rollout.vllm_server import add_server_arguments, run_server

    server = sub.add_parser(
        "vllm-server", help="serve a vLLM engine that trainers share (fastrl train --sampler vllm-server URL)",
        description="One vLLM engine behind HTTP for `fastrl train --sampler vllm-server URL` (every torchrun rank\n"
                    "shares it). Trainers push their weights before the first rollout and after each update.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_arguments(server).set_defaults(func=run_server)

    env = sub.add_parser("env", help="print versions, the device, the backend `auto` picks and threads",
                         description="What a report of a slow or failing run needs: versions, device, backend, threads.")
    env.add_argument("--json", action="store_true", help="print the same as JSON")
    env.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fastrl import cli_style

    argv, debug = cli_style.pop_debug(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] == "train":
        from fastrl.train.cli import run_train

        return cli_style.run_reporting_input_errors("train", lambda: run_train(argv[1:]), debug=debug)
    if argv and argv[0] == "compare":
        from fastrl.commands.compare import run_compare

        return cli_style.run_reporting_input_errors("compare", lambda: run_compare(argv[1:]), debug=debug)
    parser = build_parser()
    args = parser.parse_args(argv)

    def run() -> int:
        try:
            return args.func(args)
        except UsageError as exc:
            if debug:
                raise
            print(f"fastrl {args.command}: error: {exc}", file=sys.stderr)
            return 2

    try:
        return cli_style.run_reporting_input_errors(args.command, run, debug=debug)
    except BrokenPipeError:  # the reader of our output (`| head`) closed it: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
