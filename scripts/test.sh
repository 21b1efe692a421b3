#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${FASTMAE_VENV:-.venv}/bin/activate"
ruff check .
# two workers: the suite waits on process starts and DeepSpeed launches as much as it computes; tests that share an
# expensive run stay on one worker (xdist_group)
python -m pytest -q -n 2 --dist loadgroup "$@" tests
