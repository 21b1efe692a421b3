#!/usr/bin/env bash
# The GPU check, phase by phase (scripts/gpu_check.py says how): the first thing to run on a lent CUDA machine.
#   bash scripts/gpu_check.sh --plan                 # the phases in order: name, estimated minutes, command
#   bash scripts/gpu_check.sh smoke                  # one phase: at most 8 minutes, its set-up included
#   bash scripts/gpu_check.sh --dry-run headline     # what a phase runs and writes, anywhere
#   bash scripts/gpu_check.sh --collect FILES_AT     # back here: what $OUT brought back, into benchmarks/results/gpu/
# On a lent machine: bash scripts/gpu_wheels.sh here first, carry .whl/, and pass FASTMAE_COMMIT=<the commit>.
set -uo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
