#!/usr/bin/env bash
# Fill .whl/ (repo root, gitignored) with the wheels run.sh installs on the device, which has no
# network: the log-prob loss stage's baselines (Cut Cross-Entropy, Liger-Kernel) with
# `pip download --no-deps` (the device has torch and triton already). fastrl itself needs no
# wheel: run.sh puts the repository first on PYTHONPATH.
# Usage (repo root, a machine with the package index): bash benchmarks/gpu/fetch_wheels.sh
# Then the device call carries .whl/ (run's `carry: [".whl"]`).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHL=${WHL:-.whl}
mkdir -p "$WHL"
# pinned: the versions the audit read (liger-kernel 0.8.5 ran on the first H200 run)
python3 -m pip download --no-deps --only-binary=:all: -d "$WHL" "cut-cross-entropy==25.1.1" "liger-kernel==0.8.5"
ls -la "$WHL"
