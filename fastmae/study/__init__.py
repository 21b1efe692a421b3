"""`fastmae study`: the papers' claims, measured on your data under one compute budget (ARCHITECTURE.md section 10).

    fastmae study --data DIR --objectives mlm,mae-lm,3ml --budget cpu-30min --out DIR [--task DIR] [--seeds N]
    fastmae study --data DIR --quick --out DIR          # the CI-sized variant (minutes, shapes only)

Every objective trains through the normal trainer (`python -m fastmae.train`, or `deepspeed` with --ranks > 1) with
the same encoder width and depth, data order (train.seed = the study seed) and optimizer settings, for the most
steps whose training FLOPs (fastmae/flops.py) fit the budget, evaluated under the fixed held-out protocol after the
last step within every budget / eval_points FLOPs. Then, with --task, each encoder is fine-tuned through `fastmae
glue` (a grid of learning rates, each encoder at its best cell, the median over fine-tuning seeds), and `analyze`
measures its effective ranks with and without `<mask>` inputs.

Objectives: `mlm`, `mae-lm`, `3ml` (the presets), `k=N` (3ml's masking, 50% removed, with the insertion at encoder
layer N, 0 < N < L, and no decoder: the "mask later" family; k=L without a decoder is refused, nothing would
run after the insertion), each optionally followed by `:field=value` ModelConfig overrides
(`mae-lm:decoder_layers=2`). `mlm` must be one of them: it is the reference of "percent of mlm's compute".

    OUT/configs/NAME-seedS.yaml   the exact run config of each run (re-running with other settings is refused)
    OUT/runs/NAME-seedS/          each run directory (metrics.jsonl, checkpoints, model.safetensors)
    OUT/glue/                     fine-tuning cells, glue.json, glue.md (with --task)
    OUT/analysis/NAME-seedS/      analyze's output
    OUT/study.json, OUT/report.md, OUT/loss_vs_flops.png, OUT/ranks.png

Re-running with the same arguments reuses every finished run, fine-tuning and analysis, and resumes an interrupted
run from its newest checkpoint.
"""

from .command import build_parser, main, study
from .objectives import STUDY_PRESETS, Objective, StudyPreset, parse_objectives, resolve_budget
from .runs import Run, task_name_of
from .schema import EvalPoint, FinetuneResult, ObjectiveResult, SeedResult
from .summary import compare, findings, flops_to_reach, summarize

__all__ = ["STUDY_PRESETS", "EvalPoint", "FinetuneResult", "Objective", "ObjectiveResult", "Run", "SeedResult",
           "StudyPreset", "build_parser", "compare", "findings", "flops_to_reach", "main", "parse_objectives",
           "resolve_budget", "study", "summarize", "task_name_of"]
