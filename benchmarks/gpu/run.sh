#!/usr/bin/env bash
# The GPU session's one call: kernel tests on CUDA, then the benchmarks (each timed only
# after its correctness check passed).
# Usage (device machine, repo root): bash benchmarks/gpu/run.sh   (results: $OUT/gpu_results.tgz)
# Dry run on a CPU machine: OUT=/tmp/out FASTRL_GPU_DRY_RUN=1 bash benchmarks/gpu/run.sh
# Every stage writes under $RESULTS; at the end they go to $OUT as one archive, since the device
# returns at most 8 files from $OUT (the first H200 run wrote 16).
# Budget: under 8 minutes (470 s) in all; each stage has its own timeout so a hang cannot eat the lease,
# cut to what is left of the budget: tests 200 s + kernels (check, then time decode attention) 70 s
# + the log-prob loss stage (bench_logprob_loss.py: fastrl's paths vs naive, torch.compile, Liger,
# Cut Cross-Entropy, forward + backward and no-grad, the issue's four shapes) 150 s
# + 4 bench modules x 40 s; then, each only with time left: the sampler's decode modes vs
# generate/vLLM (at most 100 s), the step-wise tree case (at most 90 s), and the long GRPO step.
# + the decode cascade (bench_decode.py, at most 60 s) and the training attention
# (bench_train_attention.py, at most 90 s) after the loss; the memory-bound kernels last.
# FASTRL_GPU_STAGES=loss (a comma list of tests,kernels,loss,decode,trainattn,bench,sampler,tree,long,memory)
# runs only those stages, e.g. a session that measures the log-prob loss alone (issue 36), or the
# attention and the step (issue 37: tests gate the attention benches):
#   FASTRL_GPU_STAGES=loss bash benchmarks/gpu/run.sh
#   FASTRL_GPU_STAGES=tests,decode,trainattn,long,sampler,memory bash benchmarks/gpu/run.sh
# The baselines' wheels come in .whl/ (bash benchmarks/gpu/fetch_wheels.sh; gitignored, carried).
set -uo pipefail
OUT=${OUT:-/tmp/fastrl-gpu-out}
RESULTS=${RESULTS:-$(mktemp -d /tmp/fastrl-gpu-results.XXXX)}
mkdir -p "$OUT" "$RESULTS"
pack() { tar -czf "$OUT/gpu_results.tgz" -C "$RESULTS" . && echo "packed $(ls "$RESULTS" | wc -l) files into $OUT/gpu_results.tgz"; }
trap pack EXIT
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
BUDGET_S=470  # the whole call: under 8 minutes of the session's 15 (start-up and transfers come on top)
stage_timeout() {  # a stage's timeout: its own cap, or what is left of the budget if less (at least 1 s)
  local left=$(( BUDGET_S - SECONDS ))
  if [ "$left" -lt "$1" ]; then echo $(( left > 1 ? left : 1 )); else echo "$1"; fi
}
want() {  # is stage $1 asked for (FASTRL_GPU_STAGES unset: every stage)
  [ -z "${FASTRL_GPU_STAGES:-}" ] || [[ ",${FASTRL_GPU_STAGES}," == *",$1,"* ]]
}

# The device has torch and triton; install fastrl itself without touching them.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/benchmarks/gpu:${PYTHONPATH:-}  # benchmarks/gpu: the stream_outcomes plugin

python3 - <<'PY' > "$RESULTS/env.json"
import json, torch, platform
try:
    import triton; tv = triton.__version__
except Exception:
    tv = None
print(json.dumps({"torch": torch.__version__, "triton": tv, "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "python": platform.python_version()}, indent=2))
PY
cat "$RESULTS/env.json"

if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then
  test_args=(-x -q tests/test_config.py tests/ops/test_no_host_sync.py)
  kernel_args=(--dry-run)
  loss_args=(--dry-run --impls fastrl_chunked,fastrl_triton,naive,liger,cce --shapes 64:32:300)
  bench_args=(--quick --device cpu)
  bench_timeout=120  # a shared CPU is slow; the 8-minute budget is the device's
  export TRITON_INTERPRET=1
else
  unset TRITON_INTERPRET
  # Kernel tests on CUDA: every test module that exercises ops and kernels, including
  # tests/ops/test_no_host_sync.py (CUDA's sync debug mode on every op). The sm_90
  # compile checks (test_compile_*.py) are CPU-side CI checks.
  test_args=(-q tests/ops tests/reference tests/rollout/test_decode_attention.py tests/rollout/test_decode_attention_precision.py
             tests/rollout/test_hf_static_decode.py tests/rollout/test_decode_cascade.py
             --ignore=tests/ops/test_compile_sm90.py --ignore=tests/ops/test_compile_keys.py)
  # ~1280 tests, each kernel specialisation compiled on first use: across 15 processes (Triton's
  # on-disk cache is shared; 8 reached 95% in 170 s, 14 reached 99% in 250 s on the first H200
  # runs), outcomes streamed (stream_outcomes.py) so a stage cut at its timeout still gates the
  # benchmarks; a test that hangs fails alone (pytest-timeout).
  if python3 -c "import xdist" 2>/dev/null; then test_args+=(-n 15); fi
  if python3 -c "import pytest_timeout" 2>/dev/null; then test_args+=(--timeout 90); fi
  kernel_args=()
  loss_args=()
  bench_args=(--device cuda)
  bench_timeout=40
fi

: > "$RESULTS/tests_outcomes.tsv"
if want tests; then
  echo "== kernel tests"
  FASTRL_OUTCOMES="$RESULTS/tests_outcomes.tsv" FASTRL_FAILURES="$RESULTS/test_failures.txt" \
    timeout "$(stage_timeout 200)" python3 -m pytest "${test_args[@]}" -p stream_outcomes -p no:cacheprovider --junitxml="$RESULTS/tests.xml" 2>&1 \
    | tee "$RESULTS/tests.log" | tail -40
  echo "tests exit: ${PIPESTATUS[0]}"
fi

if want kernels; then
  echo "== kernels: check against the reference, then time against the baselines"
  timeout "$(stage_timeout 70)" python3 benchmarks/gpu/kernels.py "${kernel_args[@]}" --out "$RESULTS/kernels.json" 2>&1 | tee "$RESULTS/kernels.log"
  echo "kernels exit: ${PIPESTATUS[0]}"
fi

if want loss; then
  echo "== log-prob loss: each implementation checked, then timed; the floor and its share (benchmarks/gpu/logprob_floor.py)"
  # the script stops starting new measurements 10 s before its timeout (it writes after each row)
  loss_timeout=$(stage_timeout 150)
  timeout "$loss_timeout" python3 benchmarks/gpu/bench_logprob_loss.py "${loss_args[@]}" --budget-s $(( loss_timeout > 20 ? loss_timeout - 10 : 10 )) \
    --out "$RESULTS/logprob_loss.json" 2>&1 | tee "$RESULTS/logprob_loss.log" | tail -40
  echo "loss exit: ${PIPESTATUS[0]}"
  python3 benchmarks/gpu/logprob_floor.py --results "$RESULTS/logprob_loss.json" 2>&1 | tee "$RESULTS/logprob_floor.txt" | tail -40
fi

if want decode; then
  echo "== decode attention: cascade (plan, CUDA graph, checked call, split sweep) vs SDPA over the expanded prefix (and flash_attn), each timed after its check"
  if python3 benchmarks/gpu/tests_passed.py "$RESULTS/tests_outcomes.tsv" rollout; then
    if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then decode_args=(--dry-run); else decode_args=(); fi
    timeout "$(stage_timeout 60)" python3 benchmarks/gpu/bench_decode.py "${decode_args[@]}" --out "$RESULTS/decode_gpu.json" 2>&1 | tee "$RESULTS/decode.log" | tail -8
    echo "decode exit: ${PIPESTATUS[0]}"
  else
    echo "decode skipped: its correctness tests failed"
  fi
fi
if want trainattn; then
  echo "== training attention: shared-prefix and tree fwd+bwd, Triton vs Flex vs SDPA over the repeated prompt (each timed after its check)"
  if python3 benchmarks/gpu/tests_passed.py "$RESULTS/tests_outcomes.tsv" tree_attention; then
    if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then ta_args=(--dry-run); else ta_args=(); fi
    timeout "$(stage_timeout 90)" python3 benchmarks/gpu/bench_train_attention.py "${ta_args[@]}" --out "$RESULTS/train_attention.json" 2>&1 | tee "$RESULTS/train_attention.log" | tail -16
    echo "train attention exit: ${PIPESTATUS[0]}"
  else
    echo "train attention skipped: its correctness tests failed"
  fi
fi

: > "$RESULTS/bench.log"
# One module at a time with its own timeout, so one slow module cannot cost the others' results.
# A module is timed only if the tests of its kernels passed on this device (the log-prob loss
# is timed by bench_logprob_loss.py above, after its own checks).
want bench && echo "== benchmarks"
for module in $(want bench && echo policy_loss advantages scans rollout); do
  if ! python3 benchmarks/gpu/tests_passed.py "$RESULTS/tests_outcomes.tsv" "$module" 2>&1 | tee -a "$RESULTS/bench.log"; then
    echo "bench $module skipped: its correctness tests failed" | tee -a "$RESULTS/bench.log"
    continue
  fi
  timeout "$(stage_timeout "$bench_timeout")" python3 -m fastrl.cli bench "${bench_args[@]}" --only "$module" --out "$RESULTS/bench-$module.json" 2>&1 | tee -a "$RESULTS/bench.log"
  echo "bench $module exit: ${PIPESTATUS[0]}" | tee -a "$RESULTS/bench.log"
done
if want sampler; then
  echo "== sampler: decode eager / static / CUDA graph vs HF generate (and vLLM), each timed after its check"
  if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then sampler_args=(--dry-run); else sampler_args=(); fi
  timeout "$(stage_timeout 100)" python3 benchmarks/gpu/bench_sampler.py "${sampler_args[@]}" --out "$RESULTS/sampler_gpu.json" 2>&1 | tee "$RESULTS/sampler.log" | tail -20
  echo "sampler exit: ${PIPESTATUS[0]}"
fi
if want tree; then
  echo "== step-wise samples of an 8-turn trajectory (1.5B shape): padded vs prefix-tree packed"
  # Only if the tree-attention tests passed on this device; its own timeout (the rest goes to the next stage).
  if python3 benchmarks/gpu/tests_passed.py "$RESULTS/tests_outcomes.tsv" tree_attention; then
    if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then tree_args=(--dry-run --templates strip-thinking --repeats 1); else tree_args=(--templates strip-thinking); fi
    timeout "$(stage_timeout 90)" python3 benchmarks/gpu/bench_stepwise_tree_gpu.py "${tree_args[@]}" --out "$RESULTS/tree_stepwise_gpu.json" 2>&1 | tee "$RESULTS/tree_stepwise.log" | tail -12
    echo "tree step-wise exit: ${PIPESTATUS[0]}"
  else
    echo "tree step-wise skipped: its correctness tests failed"
  fi
fi
if want long; then
  echo "== long-trajectory GRPO step (1.5B shape): shared prefix on/off, attention backends"
  # Last and only with time left in the budget (the script writes after every case).
  left=$(( BUDGET_S - SECONDS ))
  if [ "$left" -gt 30 ]; then
    if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then long_args=(--dry-run); else
      long_args=(--tokens 8192,32768 --modes repeated,shared:triton,shared:flex --repeats 2); fi
    timeout "$left" python3 benchmarks/gpu/bench_long_grpo.py "${long_args[@]}" --out "$RESULTS/long_grpo_gpu.json" 2>&1 | tee "$RESULTS/long_grpo.log" | tail -20
    echo "long grpo exit: ${PIPESTATUS[0]}"
  else
    echo "long grpo skipped: ${left}s left of the budget"
  fi
fi
if want memory; then
  echo "== memory-bound kernels vs the PyTorch path and torch.compile, bandwidth vs a copy (each timed after its check)"
  if [ -n "${FASTRL_GPU_DRY_RUN:-}" ]; then mb_args=(--dry-run --no-compile); else mb_args=(); fi
  timeout "$(stage_timeout 120)" python3 benchmarks/gpu/bench_memory_bound.py "${mb_args[@]}" --out "$RESULTS/memory_bound_gpu.json" 2>&1 | tee "$RESULTS/memory_bound.log" | tail -16
  echo "memory bound exit: ${PIPESTATUS[0]}"
fi
ls -la "$RESULTS"
