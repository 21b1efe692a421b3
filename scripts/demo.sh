#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default pretraining demo: tiny-cpu on two CPU ranks with DeepSpeed ZeRO-2 on
# the embedded corpus (prepared on the first run). Extra arguments are config overrides, e.g. model.preset=mlm.
# Writes runs/tiny-cpu/: metrics.jsonl, checkpoints/, model.safetensors and curves.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. "${FASTMAE_VENV:-.venv}/bin/activate"
# Where no GPU is visible DeepSpeed is told the CPU is its accelerator (else it warns so in every process); its
# launcher logs warnings, not its INFO lines (the command it runs, CUDA_VISIBLE_DEVICES, each process it spawns).
command -v nvidia-smi > /dev/null 2>&1 || export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec deepspeed --log_level warning --num_gpus "${FASTMAE_DEMO_RANKS:-2}" fastmae/train.py \
  --config configs/tiny-cpu.yaml "$@"
