#!/usr/bin/env bash
# Create .venv (once) and install fastmae with its dev tools. torch goes first, pinned to the CPU wheel this machine
# carries, so that no requirement can pull a multi-GB CUDA build. Override the venv path with FASTMAE_VENV.
# pip's own output (its location warnings, setuptools' editable-install banner) goes to $venv/setup.log and is shown
# only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FASTMAE_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
log="$venv/setup.log"
: > "$log"
quietly() {  # run a step with its output in the log; on failure show the log and fail
  if ! "$@" >> "$log" 2>&1; then
    cat "$log" >&2
    echo "setup.sh: '$*' failed (its output is above and in $log)" >&2
    exit 1
  fi
}
python -c "import torch" 2>/dev/null || quietly python -m pip install --no-compile "torch==${FASTMAE_TORCH_VERSION:-2.13.0}"
DS_BUILD_OPS=0 quietly python -m pip install --no-compile -e ".[dev]"
# pip byte-compiles what it installs on one core (~60 s here); compileall does the same on every core. The .pyc files
# must exist before the first import: where PYTHONDONTWRITEBYTECODE is set, imports never write them.
python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >> "$log" 2>&1 || true  # a few packages ship files for other Python versions that do not compile; pip skips them too
python -c "import fastmae, fastmae.kernels" # fail here, not in the tests, if the install is broken
