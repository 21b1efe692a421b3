#!/usr/bin/env bash
# Regenerate the training runs behind README.md's demo and study figures, and copy what the README quotes into
# benchmarks/results/ (then `python benchmarks/readme_table.py --write` puts the numbers into README.md):
#   benchmarks/results/demo/          metrics.jsonl, curves.png, config.yaml, run_info.json of `bash scripts/demo.sh`
#   benchmarks/results/study_cpu_30min/   report.md, study.json, loss_vs_flops.png, ranks.png of the cpu-30min study
#   benchmarks/results/study_cpu_1h/      the same of the cpu-1h study (base's depth, learning rates from a grid)
#   benchmarks/results/mae_lm_diagnosis/  mae-lm against its variants with 3ml's decoder depth and 3ml's mask rate
#   benchmarks/results/diagnosis_3ml_positions/  3ml on rotary and on learned absolute positions against mlm, one seed each
#   benchmarks/results/study_mask_more_or_later/  mlm at 15/30/50% and 30% -> 15%, 3ml at 50% and 50% -> 30%, WSD
# Usage: bash benchmarks/readme_runs.sh [demo] [study] [study-1h] [mae-lm-diagnosis] [3ml-positions]
#        [mask-more-or-later]
#        (demo and study by default; the studies take 30-60 minutes on 2 cores, the diagnosis about 20, the
#        masking study over two hours, its 72 fine-tunes included)
set -euo pipefail
cd "$(dirname "$0")/.."
. "${FASTMAE_VENV:-.venv}/bin/activate"
results=benchmarks/results
parts=("${@:-demo study}")

describe_run() {  # RUN_DIR SECONDS: where and how a run was measured, as Markdown
  python - "$1" "$2" <<'PY'
import json, os, subprocess, sys, torch
from datetime import datetime, timezone
run, seconds = sys.argv[1], int(sys.argv[2])
bf16 = json.load(open(os.path.join(run, "deepspeed_config.json")))["bf16"]["enabled"]
sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# {run}\n\n{datetime.now(timezone.utc):%Y-%m-%d}, git {sha}, {os.cpu_count()} CPU cores "
      f"(capability {torch.backends.cpu.get_cpu_capability()}), trained in {'bf16' if bf16 else 'fp32'}; "
      f"{seconds // 60} min {seconds % 60} s from the command to its end.")
PY
}
for part in ${parts[*]}; do
  case "$part" in
    demo)
      rm -rf runs/tiny-cpu
      started=$SECONDS
      bash scripts/demo.sh 2>&1 | tee runs/demo.log   # README's command, set-up included
      mkdir -p "$results/demo"
      cp runs/tiny-cpu/{metrics.jsonl,curves.png,config.yaml,run_info.json} "$results/demo/"
      describe_run runs/tiny-cpu $((SECONDS - started)) > "$results/demo/run.md"
      ;;
    study|study-1h)
      preset=$([ "$part" = study ] && echo cpu-30min || echo cpu-1h)
      data=runs/data/builtin-v1000   # what the demo's config prepares on its first run
      [ -f "$data/meta.json" ] || fastmae prepare --format builtin --output "$data" --vocab-size 1000 \
        --valid-fraction 0.1
      rm -rf "runs/study-$preset"
      started=$SECONDS
      grid=()  # the base-depth study first picks each objective's learning rate, so none trains at another's
      if [ "$part" = study-1h ]; then grid=(--lr-grid 5e-4,1e-3,2e-3 --lr-grid-fraction 0.3); fi
      fastmae study --data "$data" --budget "$preset" --task generated "${grid[@]}" --out "runs/study-$preset"
      kept="$results/study_${preset//-/_}"
      mkdir -p "$kept"
      cp "runs/study-$preset"/{report.md,study.json,loss_vs_flops.png,ranks.png} "$kept/"
      describe_run "runs/study-$preset/runs/mlm-seed0" $((SECONDS - started)) > "$kept/run.md"
      ;;
    mae-lm-diagnosis)  # why mae-lm stays on the plateau at base's depth: its decoder depth or its mask rate?
      data=runs/data/builtin-v1000
      [ -f "$data/meta.json" ] || fastmae prepare --format builtin --output "$data" --vocab-size 1000 \
        --valid-fraction 0.1
      rm -rf runs/mae-lm-diagnosis
      started=$SECONDS
      fastmae study --data "$data" --budget cpu-1h --seeds 1 --out runs/mae-lm-diagnosis \
        --objectives mlm,mae-lm,mae-lm:decoder_layers=2,mae-lm:mask_rate=0.5
      kept="$results/mae_lm_diagnosis"
      mkdir -p "$kept"
      cp runs/mae-lm-diagnosis/{report.md,study.json,loss_vs_flops.png,ranks.png} "$kept/"
      describe_run runs/mae-lm-diagnosis/runs/mlm-seed0 $((SECONDS - started)) > "$kept/run.md"
      ;;
    3ml-positions)  # does 3ml's late start off the plateau come from its rotary positions? (docs/study.md)
      data=runs/data/builtin-v1000
      [ -f "$data/meta.json" ] || fastmae prepare --format builtin --output "$data" --vocab-size 1000 \
        --valid-fraction 0.1
      rm -rf runs/pos-diagnosis
      started=$SECONDS
      fastmae study --data "$data" --budget cpu-1h --seeds 1 --out runs/pos-diagnosis \
        --objectives mlm,3ml,3ml:position_embedding=learned
      kept="$results/diagnosis_3ml_positions"
      mkdir -p "$kept"
      cp runs/pos-diagnosis/{report.md,study.json,loss_vs_flops.png,ranks.png} "$kept/"
      describe_run runs/pos-diagnosis/runs/mlm-seed0 $((SECONDS - started)) > "$kept/run.md"
      ;;
    mask-more-or-later)  # how much of 3ml's saving is masking more, how much masking later (docs/study.md)
      data=runs/data/builtin-v1000
      [ -f "$data/meta.json" ] || fastmae prepare --format builtin --output "$data" --vocab-size 1000 \
        --valid-fraction 0.1
      started=$SECONDS  # no rm: a study cut short resumes from its finished runs
      fastmae study --data "$data" --budget cpu-1h --task generated --out runs/study-mask-more-or-later \
        --objectives "mlm,mlm:mask_rate=0.3,mlm:mask_rate=0.5,mlm:mask_rate=0.3:mask_rate_end=0.15,3ml,3ml:mask_rate_end=0.3" \
        train.schedule=wsd train.decay_fraction=0.2 train.decay_shape=1-sqrt
      kept="$results/study_mask_more_or_later"
      mkdir -p "$kept"
      cp runs/study-mask-more-or-later/{report.md,study.json,loss_vs_flops.png,ranks.png} "$kept/"
      describe_run runs/study-mask-more-or-later/runs/mlm-seed0 $((SECONDS - started)) > "$kept/run.md"
      ;;
    *) echo "readme_runs.sh: unknown part $part (demo, study, study-1h, mae-lm-diagnosis, 3ml-positions," \
            "mask-more-or-later)" >&2
       exit 2 ;;
  esac
done
