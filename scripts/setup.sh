#!/usr/bin/env bash
# Create .venv (once) and install fastmae with its dev tools. torch goes first, pinned to the CPU wheel this machine
# carries, so that no requirement can pull a multi-GB CUDA build. Override the venv path with FASTMAE_VENV.
# The installers' own output (pip's location warnings, setuptools' editable-install banner) goes to $venv/setup.log
# and is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${FASTMAE_VENV:-.venv}"
torch_version="${FASTMAE_TORCH_VERSION:-2.13.0}"
# without pip: venv's own pip install byte-compiles pip on one core (7 s of a fresh 2-core machine's set-up); uv puts
# pip in below
base_python="$(command -v python3)"  # the system's, with pip: uv comes from it
[ -x "$venv/bin/python" ] || "$base_python" -m venv --without-pip "$venv"
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
# Everything through uv where it installs (66 packages: 14 s against pip's 50 s on a fresh 2-core machine; torch's
# wheel 5 s against 11), uv itself put in the venv by the system's pip (its --python, pip 22.3 and later). torch's wheel
# is found by pip, whose configuration names the machine's wheels (uv reads none of it), then installed by uv; torch,
# already there, satisfies fastmae's bound, so no requirement fetches another build of it.
if python -m uv --version > /dev/null 2>&1 \
    || "$base_python" -m pip --python "$venv/bin/python" install uv >> "$log" 2>&1; then
  python -m pip --version > /dev/null 2>&1 || quietly python -m uv pip install --python "$venv/bin/python" pip
  if ! python -c "import torch" 2> /dev/null; then
    wheels="$venv/wheels"
    quietly python -m pip download --no-deps --dest "$wheels" "torch==$torch_version"
    quietly python -m uv pip install --python "$venv/bin/python" "$wheels"/torch-*.whl
    rm -rf "$wheels"
  fi
  DS_BUILD_OPS=0 quietly python -m uv pip install --python "$venv/bin/python" -e ".[dev]"
else
  python -m pip --version > /dev/null 2>&1 || quietly python -m ensurepip
  python -c "import torch" 2> /dev/null || quietly python -m pip install --no-compile "torch==$torch_version"
  DS_BUILD_OPS=0 quietly python -m pip install --no-compile -e ".[dev]"
fi
# byte-compiled on every core (pip compiles on one, uv not at all). The .pyc files must exist before the first import:
# where PYTHONDONTWRITEBYTECODE is set, imports never write them. What nothing here imports is left out (27 s against
# 37 s): transformers' models but the architectures fastmae reads and writes, packaging tools, test suites.
python -m compileall -q -j 0 \
  -x '/(transformers/models/(?!(auto|bert|roberta|modernbert|roformer)/)|pip/|setuptools/|pygments/|fontTools/|[^/]+/tests?/)' \
  "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >> "$log" 2>&1 || true  # a few packages ship files for other Python versions that do not compile; pip skips them too
# and this tree's own modules (an editable install is not in site-packages): each process of the suite otherwise
# compiles fastmae's modules again (0.8 s a process on a 2-core machine)
python -m compileall -q -j 0 fastmae kernels benchmarks scripts tests >> "$log" 2>&1
python -c "import fastmae, fastmae.kernels" # fail here, not in the tests, if the install is broken
