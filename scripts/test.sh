#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${FASTMAE_VENV:-.venv}/bin/activate"
ruff check .
python -m pytest -q "$@" tests
