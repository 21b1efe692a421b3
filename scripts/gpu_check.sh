#!/usr/bin/env bash
# The first thing to run on a new CUDA machine: every GPU path of fastmae, end to end, with its numbers kept.
#
#   bash scripts/gpu_check.sh            # on a CUDA machine, in the set-up .venv (bash scripts/setup.sh first)
#   bash scripts/gpu_check.sh --dry-run  # anywhere: print what it would run, run nothing
#
# Steps (each runs even if an earlier one failed; the summary lists every exit status):
#   1. the device: nvidia-smi, torch / triton / flash-attn / deepspeed versions
#   2. the Triton kernel tests compiled for this GPU, realistic shapes included (-m large)
#   3. the attention backend tests (flash, torch_varlen, flex, padded, nested against the naive reference), and the
#      model with the relative position bias on FlexAttention inside compiled layers
#   4. the training step under torch.cuda.set_sync_debug_mode("error"): no host-device sync in a steady-state step,
#      DeepSpeed's optimizer step included (bf16 ZeRO-2); CUDA graphs of the forward and backward compute what the
#      eager model computes (tests/test_graphs.py); fine-tuning under bf16 autocast scores like fp32
#      (tests/test_finetune.py -k bf16); benchmarks/host_overhead.py: ops, launches, syncs
#   5. benchmarks/kernels.py: each kernel against its torch reference, GB/s against the device's memory bandwidth
#   6. benchmarks/attention.py: every attention backend, with and without dropout
#   7. benchmarks/throughput.py --size base: mlm, 3ml, mae-lm with and without the relative bias (eager and
#      compiled; CUDA graphs replayed and eager), 3ml on the embedded corpus packed `full` (separators inside),
#      Hugging Face RoBERTa; tokens/s, MFU;
#      again at the base recipes' micro-batch (128 x 512 tokens), and benchmarks/micro_batch.py refits the recipes'
#      micro-batch to the peaks measured at both sizes
#   8. a 50-step 3ml base-shaped training run on 1 GPU (configs/3ml-base.yaml on the embedded corpus)
# Everything lands in benchmarks/results/gpu/DEVICE/ (logs, the benchmarks' JSON + Markdown, the run's metrics),
# small enough to commit; the training run's checkpoints stay in runs/gpu-check/.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
case "${1:-}" in
    --dry-run) dry_run=1 ;;
    "") ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

python=${PYTHON:-python}
if (( dry_run )); then
    device=DEVICE
else
    if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: no CUDA device visible to torch (is this a GPU machine, with a CUDA build of torch?)" >&2
        exit 1
    fi
    device=$("$python" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9.-]+', '_', torch.cuda.get_device_name(0)))")
fi
out=benchmarks/results/gpu/$device
run_dir=runs/gpu-check/3ml-base
statuses=()

# step NAME COMMAND...: run (or print) one step, its output teed into OUT/NAME.log, its exit status remembered
step() {
    local name=$1 line
    shift
    printf -v line '%q ' "$@"  # quoted, so the line can be pasted back into a shell
    echo "+ [$name] ${line% }"
    if (( dry_run )); then
        return
    fi
    "$@" 2>&1 | tee "$out/$name.log"
    statuses+=("$name: exit ${PIPESTATUS[0]}")
}

# keep NAME...: copy benchmarks/results/NAME.{json,md} (what a benchmark just wrote) into OUT
keep() {
    for name in "$@"; do
        echo "+ cp benchmarks/results/$name.{json,md} $out/"
        (( dry_run )) || cp "benchmarks/results/$name.json" "benchmarks/results/$name.md" "$out/" 2>/dev/null || true
    done
}

# device_report: the GPU and the versions that matter
device_report() {
    nvidia-smi
    "$python" - <<'PY'
import importlib

for name in ("torch", "triton", "flash_attn", "deepspeed"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError:
        print(name, "not installed")
import torch

print("cuda", torch.version.cuda, "device", torch.cuda.get_device_name(0))
PY
}

(( dry_run )) || mkdir -p "$out"
step device device_report
# pytest-xdist, where installed, compiles the kernels of several tests at once; the large shapes (up to 14 GB each)
# run one at a time
parallel=()
(( dry_run )) || ! "$python" -c "import xdist" 2>/dev/null || parallel=(-n 8)
step kernel_tests "$python" -m pytest -q "${parallel[@]}" -m "not large" tests/kernels
step kernel_tests_large "$python" -m pytest -q -m large tests/kernels
step attention_tests "$python" -m pytest -q -m "large or not large" tests/test_attention.py
step relative_bias_tests "$python" -m pytest -q tests/test_model.py -k relative_bias
step sync_tests "$python" -m pytest -q tests/test_train.py -k steady_state
step graph_tests "$python" -m pytest -q tests/test_graphs.py
step finetune_tests "$python" -m pytest -q tests/test_finetune.py -k bf16
step host_overhead_benchmark "$python" benchmarks/host_overhead.py
keep host_overhead
step host_overhead_graphs_benchmark "$python" benchmarks/host_overhead.py --zero-stage 2 --cuda-graphs \
    --name host_overhead_zero2_graphs
keep host_overhead_zero2_graphs
step kernel_benchmark "$python" benchmarks/kernels.py
keep kernels
step attention_benchmark "$python" benchmarks/attention.py
keep attention
step throughput_benchmark "$python" benchmarks/throughput.py --size base --sequences 32 \
    --systems hf-roberta,mlm,3ml,mae-lm,mae-lm-relbias,mae-lm-relbias-no-dropout --compile --eager --real-data
keep throughput
step throughput_recipe_benchmark "$python" benchmarks/throughput.py --size base --sequences 128 \
    --systems hf-roberta,mlm,3ml --name throughput_recipe
keep throughput_recipe
step micro_batch "$python" benchmarks/micro_batch.py --device-dir "$out"
keep micro_batch
step train_3ml_base deepspeed --num_gpus 1 fastmae/train.py --config configs/3ml-base.yaml --resume none \
    data.path=builtin data.builtin_vocab_size=8000 \
    train.steps=50 train.tokens_per_step=131072 train.warmup_steps=10 eval.every=50 eval.sequences=256 \
    checkpoint.every=50 checkpoint.keep=1 log.every=5 "log.dir=$run_dir"
echo "+ cp $run_dir/{metrics.jsonl,curves.png,config.yaml,deepspeed_config.json} $out/"
if (( ! dry_run )); then
    for file in metrics.jsonl curves.png config.yaml deepspeed_config.json; do
        cp "$run_dir/$file" "$out/train_3ml_base.$file" 2>/dev/null || true
    done
    printf '%s\n' "# gpu_check on $device" "" "git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" "" \
        "${statuses[@]/#/- }" > "$out/summary.md"
    cat "$out/summary.md"
    for status in "${statuses[@]}"; do
        [[ $status == *"exit 0" ]] || exit 1
    done
fi
