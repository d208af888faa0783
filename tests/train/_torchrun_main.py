"""Run under ``torchrun`` by tests/train/test_distributed.py: ``fastrl train`` (the CLI entry
point, in this process) once per named configuration, plus the bad-input cases, each rank
recording what it saw in ``<out>/rank<r>.json``.

Usage: torchrun --nproc-per-node 2 tests/train/_torchrun_main.py OUT_DIR CASES_JSON
CASES_JSON: {"name": [cli args...]}; names starting with "bad_" are expected to fail.
"""

import contextlib
import io
import json
import os
import sys
import traceback

import torch.distributed as dist

from fastrl.cli import main


def run() -> None:
    out, cases = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")  # the trainer joins it (and leaves it to us to close)
    rank = dist.get_rank()
    seen: dict[str, str] = {}
    for name, args in cases.items():
        args = [a.replace("{rank}", str(rank)) for a in args]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                code = main(["train", *args])
            seen[name] = f"exit {code}" + (f": {err.getvalue().strip()}" if code else "")
        except SystemExit as e:
            seen[name] = f"exit {e.code}"
        except Exception as e:  # recorded; the test decides whether it was expected
            seen[name] = f"{type(e).__name__}: {e}"
            if not name.startswith("bad_"):
                traceback.print_exc()
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    run()
