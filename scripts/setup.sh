#!/usr/bin/env bash
# Create .venv (once) and install fastmae with its dev tools. torch goes first, pinned to the CPU wheel this machine
# carries, so that no requirement can pull a multi-GB CUDA build. Override the venv path with FASTMAE_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FASTMAE_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${FASTMAE_TORCH_VERSION:-2.13.0}"
DS_BUILD_OPS=0 python -m pip install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import fastmae, fastmae.kernels" # fail here, not in the tests, if the install is broken
