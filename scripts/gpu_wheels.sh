#!/usr/bin/env bash
# Fetch (and build) into .whl/ the wheels a lent GPU machine lacks, so that each gpu_check phase installs them in
# seconds with no registry in reach: DeepSpeed (published only as a source archive: built here without its ops, a
# ~2 MB pure-Python wheel) and the modules it and fastmae import that the GPU image has not got (hjson, pydantic and
# its parts, zstandard, ...), for the image's Python 3.12 on x86_64. .whl/ is ignored by git; carry it with the tree
# (the device tool's `carry: [".whl"]`). Run once per session; it replaces .whl/.
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
. "${FASTMAE_VENV:-.venv}/bin/activate"
version=${1:-3.12}
abi=cp${version/./}
rm -rf .whl && mkdir .whl
log=$(mktemp)
quietly() {  # pip's notes go to a log, shown only when the step fails
  "$@" >> "$log" 2>&1 || { cat "$log" >&2; echo "gpu_wheels.sh: '$*' failed" >&2; exit 1; }
}
# binary wheels for the image's interpreter, with their own dependencies (pydantic pins its pydantic-core)
quietly python -m pip download --only-binary=:all: --python-version "$version" --implementation cp --abi "$abi" \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  hjson pydantic zstandard einops msgpack py-cpuinfo ninja setuptools wheel pytest-xdist execnet
deepspeed=$(python -c 'from importlib.metadata import version; print(version("deepspeed"))')
DS_BUILD_OPS=0 quietly python -m pip wheel --no-deps -w .whl "deepspeed==$deepspeed"
du -sh .whl
ls .whl
