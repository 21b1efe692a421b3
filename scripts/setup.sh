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
# is found by pip, whose configuration names the machine's wheels (uv reads none of it), and installed by uv from where
# pip found it (a wheel that stays put: uv's cache keeps it unpacked, 0.7 s against 4.4 s for a copy); torch, already
# there, satisfies fastmae's bound, so no requirement fetches another build of it.
if python -m uv --version > /dev/null 2>&1 \
    || "$base_python" -m pip --python "$venv/bin/python" install uv >> "$log" 2>&1; then
  python -m pip --version > /dev/null 2>&1 || quietly python -m uv pip install --python "$venv/bin/python" pip
  if ! python -c "import torch" 2> /dev/null; then
    found="$venv/torch-found.json"
    quietly python -m pip install --dry-run --no-deps --ignore-installed --quiet --report "$found" \
      "torch==$torch_version"
    url="$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["install"][0]["download_info"]["url"])' \
      "$found")"
    quietly python -m uv pip install --python "$venv/bin/python" "torch @ $url"
    rm -f "$found"
  fi
  DS_BUILD_OPS=0 quietly python -m uv pip install --python "$venv/bin/python" -e ".[dev]"
else
  python -m pip --version > /dev/null 2>&1 || quietly python -m ensurepip
  python -c "import torch" 2> /dev/null || quietly python -m pip install --no-compile "torch==$torch_version"
  DS_BUILD_OPS=0 quietly python -m pip install --no-compile -e ".[dev]"
fi
# byte-compiled on every core (pip compiles on one, uv not at all). The .pyc files must exist before the first import:
# where PYTHONDONTWRITEBYTECODE is set, imports never write them. What nothing here imports is left out (27 s against
# 37 s): transformers' models but the architectures fastmae reads and writes, packaging tools, test suites, and the
# packages and folders of which the whole suite read no .pyc (their access times after a run on a fresh clone: ~25 of
# 145 MB of .pyc, ~2 s of a 2-core machine's set-up). Leaving one out that something does import costs only its compile
# in the process that imports it.
unread='torch/(testing/_internal/(opinfo|generated|distributed/(rpc|_tensor|_shard|nn)|common_methods_invocations)|_vendor/'
unread+='|utils/(benchmark|hipify)/|distributed/pipelining/|_inductor/fx_passes/serialized_patterns/)|torchgen/'
unread+='|sympy/(polys/benchmarks|stats|physics|parsing|vector|codegen|holonomic|categories|testing)/|numpy/(distutils'
unread+='|f2py|polynomial)/|transformers/(exporters|pipelines|cli)/|huggingface_hub/(cli|inference)/|deepspeed/'
unread+='(inference|sequence)/|pydantic/v1/|rich/|fsspec/|anyio/|typer/|click/|markdown_it/'
python -m compileall -q -j 0 \
  -x "/(transformers/models/(?!(auto|bert|roberta|modernbert|roformer)/)|pip/|setuptools/|pygments/|fontTools/|[^/]+/tests?/|$unread)" \
  "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >> "$log" 2>&1 || true  # a few packages ship files for other Python versions that do not compile; pip skips them too
# and this tree's own modules (an editable install is not in site-packages): each process of the suite otherwise
# compiles fastmae's modules again (0.8 s a process on a 2-core machine)
python -m compileall -q -j 0 fastmae kernels benchmarks scripts tests >> "$log" 2>&1
python -c "import fastmae, fastmae.kernels" # fail here, not in the tests, if the install is broken
