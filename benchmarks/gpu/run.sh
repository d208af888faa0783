#!/usr/bin/env bash
# The GPU session's one call: kernel tests on CUDA, then the benchmark suite.
# Usage (device machine, repo root): bash benchmarks/gpu/run.sh   (results under $OUT)
# Dry run on a CPU machine: OUT=/tmp/out FASTRL_GPU_DRY_RUN=1 bash benchmarks/gpu/run.sh
# Budget: under 8 minutes in all; each stage has its own timeout so a hang cannot eat the lease.
set -uo pipefail
OUT=${OUT:-/tmp/fastrl-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."

# The device has torch and triton; install fastrl itself without touching them.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

python3 - <<'PY' > "$OUT/env.json"
import json, torch, platform
try:
    import triton; tv = triton.__version__
except Exception:
    tv = None
print(json.dumps({"torch": torch.__version__, "triton": tv, "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "python": platform.python_version()}, indent=2))
PY
cat "$OUT/env.json"

if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then
  test_args=(-x -q tests/test_config.py)
  bench_args=(--quick --device cpu)
  export TRITON_INTERPRET=1
else
  unset TRITON_INTERPRET
  # Kernel tests on CUDA: every test module that exercises ops and kernels.
  test_args=(-q tests/ops tests/reference tests/rollout/test_decode_attention.py)
  bench_args=(--device cuda)
fi

echo "== kernel tests"
timeout 200 python3 -m pytest "${test_args[@]}" -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -40
echo "tests exit: ${PIPESTATUS[0]}"

echo "== benchmarks"
# One module at a time with its own timeout, so one slow module cannot cost the others' results.
: > "$OUT/bench.log"
for module in policy_loss advantages scans logprobs rollout; do
  timeout 50 python3 -m fastrl.cli bench "${bench_args[@]}" --only "$module" --out "$OUT/bench-$module.json" 2>&1 | tee -a "$OUT/bench.log"
  echo "bench $module exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
done
ls -la "$OUT"
