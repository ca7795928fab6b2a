#!/usr/bin/env bash
# Builds the two Python environments the interop suite uses, under $K3MINI_CACHE/venvs (default
# ~/.cache/k3mini/venvs), once: `hf` (torch 2.9.0 + transformers 5.24.0, the CPU-capable PyPI
# build) and `llama` (llama-cpp-python 0.3.36 compiled from source: ~20 min on 2 cores; AMX is
# advertised but faults on these VMs, hence GGML_NATIVE=OFF). scripts/interop/run.sh and .ci/run
# use them when they exist.
set -euo pipefail
VENVS="${K3MINI_CACHE:-${HOME:-}/.cache/k3mini}/venvs"
mkdir -p "$VENVS"
if [ ! -x "$VENVS/hf/bin/python" ]; then
  python3 -m venv "$VENVS/hf"
  "$VENVS/hf/bin/pip" install -q torch==2.9.0 transformers==5.24.0 safetensors numpy
fi
if [ ! -x "$VENVS/llama/bin/python" ]; then
  python3 -m venv "$VENVS/llama"
  CMAKE_ARGS="-DGGML_NATIVE=OFF" "$VENVS/llama/bin/pip" install -q llama-cpp-python==0.3.36 numpy safetensors
fi
echo "interop environments ready in $VENVS"
