#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default pretraining demo on the CPU. Extra arguments go to the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${FASTMAE_VENV:-.venv}/bin/activate"
python -m fastmae.train "$@"
