"""The study's objective grammar (`mlm`, `mae-lm`, `3ml`, `k=N`, each with `:field=value` overrides) and its
budget presets."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import yaml

from ..config import PRESETS as MODEL_PRESETS
from ..errors import FastmaeError
from ..finetune import FinetuneConfig


# ------------------------------------------------------------------------------------------------ objectives
@dataclass(frozen=True)
class Objective:
    """One objective of the study: a model preset plus ModelConfig overrides, named as on the command line."""

    label: str
    preset: str
    overrides: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        """The label as a file name."""
        return re.sub(r"[^A-Za-z0-9.-]+", "_", self.label)


def parse_objectives(text: str) -> list[Objective]:
    """`mlm,mae-lm,3ml,k=1,mae-lm:decoder_layers=2` -> Objectives (errors name the bad item)."""
    objectives = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, *fields = item.split(":")
        overrides = {}
        for entry in fields:
            key, sep, value = entry.partition("=")
            if not sep or not key:
                raise FastmaeError(f"--objectives {item!r}: expected NAME[:field=value...], got {entry!r}")
            overrides[key] = yaml.safe_load(value)
        layer = re.fullmatch(r"k=(\d+)", name)
        if layer:
            name, overrides = "3ml", {"insert_layer": int(layer.group(1)), "decoder_layers": 0, **overrides}
        elif name not in MODEL_PRESETS:
            raise FastmaeError(f"--objectives {item!r}: unknown objective {name!r}; choose from "
                               f"{sorted(MODEL_PRESETS)} or k=N")
        objectives.append(Objective(item, name, overrides))
    labels = [o.label for o in objectives]
    if len(set(labels)) != len(labels):
        raise FastmaeError(f"--objectives {text!r}: an objective is named twice")
    if "mlm" not in labels:
        raise FastmaeError(f"--objectives {text!r}: must include mlm (the reference of the compute comparison)")
    return objectives


# --------------------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class StudyPreset:
    """A budget with the settings that make it meaningful: per-run FLOPs and the run config every objective shares."""

    budget: float
    """Training FLOPs of each run (fastmae/flops.py's count)."""
    run: tuple[str, ...]
    """dotted.key=value run-config overrides shared by every objective (model size, data, optimizer)."""
    eval_points: int
    """Held-out evaluations over the budget."""
    seeds: int
    """Pretraining seeds per objective (the spread between them is the noise every comparison is held to)."""
    finetune: FinetuneConfig
    analyze_sequences: int
    what: str
    generated_task: tuple[int, int]
    """(train, dev) examples of `--task generated` (fastmae.tasks.write_word_order_task)."""
    mlm_steps: int = 0
    """If > 0, the budget is this many of mlm's optimizer steps on the study's data instead (any vocabulary fits)."""
    task_train_examples: int = 0
    """If > 0, a real task (--task DIR) is fine-tuned on this many of its training rows, drawn at random (seed 0);
    its dev set stays whole."""


SMALL_CPU_RUN = (
    # the tiny-cpu demo's recipe (configs/tiny-cpu.yaml says why each value), 6 layers deep: with 2 layers a 2-layer
    # decoder costs as much as the encoder and no objective can save compute
    "model.hidden_size=128", "model.num_heads=2", "model.encoder_layers=6", "model.max_seq_len=64",
    "model.position_embedding=rotary", "model.norm_position=pre", "model.dropout=0.0", "model.attention_dropout=0.0",
    "data.packing=full", "data.tokens_per_micro_batch=1024", "train.lr=1.0e-3", "train.warmup_steps=100",
    "train.schedule=polynomial", "train.clip=2.0", "train.zero_stage=2", "train.precision=auto",
    "eval.sequences=1024", "checkpoint.keep=1", "checkpoint.every=500", "log.every=50",
)
BASE_PROPORTIONS_CPU_RUN = (
    # RoBERTa-base's depth at a CPU's width: with 12 encoder layers 3ml's 2-layer decoder and mae-lm's 4-layer one
    # cost about what they cost at base size (per step against mlm's, 64-token sequences, vocabulary 1,000: 3ml
    # 0.69x, mae-lm 1.18x; at base 0.75x and 1.16x), which a 6-layer encoder cannot show (3ml 0.87x, mae-lm 1.51x)
    *(setting for setting in SMALL_CPU_RUN if not setting.startswith("model.encoder_layers=")),
    "model.encoder_layers=12",
)
ONE_GPU_RUN = (
    # RoBERTa-base (Liu et al. 2019) at a GPU-hour: the base network with learned positions and post-LN, dropout 0.1,
    # Adam(0.9, 0.98, 1e-6), weight decay 0.01, no clipping, linear decay after warm-up; the 2K-sequence batch with
    # its lr 7e-4 (the paper's Table 3); micro-batches from benchmarks/results/micro_batch.md
    "model.hidden_size=768", "model.num_heads=12", "model.encoder_layers=12", "model.intermediate_size=3072",
    "model.max_seq_len=512", "model.position_embedding=learned", "model.norm_position=post", "model.dropout=0.1",
    "model.attention_dropout=0.1", "data.packing=full", "data.tokens_per_micro_batch=65536",
    "train.tokens_per_step=1048576", "train.lr=7.0e-4", "train.warmup_steps=100", "train.schedule=linear",
    "train.betas=[0.9, 0.98]", "train.eps=1.0e-6", "train.weight_decay=0.01", "train.clip=0.0",
    "train.zero_stage=2", "train.precision=auto", "eval.sequences=2048", "checkpoint.keep=1",
    "checkpoint.every=500", "log.every=20",
)
ONE_GPU_COMMAND_RUN = (
    # base's proportions at 8e15 FLOPs a run: 12 layers keep 3ml's 2-layer decoder a sixth of the encoder's depth, so
    # per step against mlm's (flops.py, 128-token sequences, 32K pieces) 3ml costs 0.86x and mae-lm 1.16x (at base
    # 0.80x and 1.16x); 8 layers would leave 3ml no saving (1.03x: its 32K-piece head on 50% of the rows). Near
    # compute-optimal: 21M weights outside the embeddings (33M with them) against Chinchilla's sqrt(C / 120) = 8M,
    # within the flat part of its iso-FLOP curves, and mlm at 15% sees 55M tokens (2.0 passes over the shared English
    # corpus's 27M). Fills the GPU: 512 sequences of 128 tokens a micro-batch and a step. lr 1e-3 with Adam (0.9,
    # 0.98) is the small-BERT range (ELECTRA-small: 5e-4 at batch 128); warmup-stable-decay, so a run's schedule has
    # one shape at every budget.
    "model.hidden_size=384", "model.num_heads=6", "model.encoder_layers=12", "model.intermediate_size=1536",
    "model.max_seq_len=128", "model.position_embedding=rotary", "model.norm_position=pre", "model.dropout=0.0",
    "model.attention_dropout=0.0", "data.packing=full", "data.tokens_per_micro_batch=65536",
    "train.tokens_per_step=65536", "train.lr=1.0e-3", "train.warmup_steps=100", "train.schedule=wsd",
    "train.decay_fraction=0.2", "train.decay_shape=1-sqrt", "train.betas=[0.9, 0.98]", "train.eps=1.0e-6",
    "train.weight_decay=0.01", "train.clip=1.0", "train.zero_stage=2", "train.precision=auto",
    "eval.sequences=2048", "checkpoint.keep=1", "checkpoint.every=100000", "log.every=50",
)
CPU_30MIN = StudyPreset(
    budget=9.0e12, run=SMALL_CPU_RUN, eval_points=10, seeds=2,
    finetune=FinetuneConfig(seeds=2, epochs=4, batch_size=32, lr=1e-3), analyze_sequences=256,
    generated_task=(1500, 500),
    what="6 x 128 encoder, 64-token sequences, 1,024 tokens per step, lr 1e-3; fits 2 CPU cores in 30 minutes "
         "for mlm, mae-lm and 3ml with 2 seeds each and --task generated")
STUDY_PRESETS = {
    "cpu-1h": dataclasses.replace(
        CPU_30MIN, budget=1.8e13, run=BASE_PROPORTIONS_CPU_RUN,
        what="12 x 128 encoder (base's depth: 3ml's step 0.69x mlm's), 64-token sequences, lr 1e-3; about an "
             "hour on 2 CPU cores for mlm, mae-lm and 3ml with 2 seeds each (48 minutes with --task generated)"),
    "gpu-1h": StudyPreset(
        budget=8.0e17, run=ONE_GPU_RUN, eval_points=10, seeds=2,
        finetune=FinetuneConfig(seeds=3, epochs=3, batch_size=32, lr=2e-5), analyze_sequences=512,
        generated_task=(8000, 1000),
        what="RoBERTa-base's network and optimisation (batch 2K x 512, lr 7e-4) for about an hour per run on one "
             "H100 (8e17 FLOPs: mlm's measured 242 TFLOP/s); for your --data"),
    "gpu-10min": StudyPreset(
        # 8e15: three runs trained at once on an H100 ran at ~7 steps/s each after ~50 s of start-up and evaluation
        # (benchmarks/results/gpu/NVIDIA_H100_80GB_HBM3/study_3e15/), so the last of them (3ml) trains in ~200 s and
        # the phase's 9 minutes keep room for preparing, fine-tuning and analysis (1e16 left under a minute)
        budget=8.0e15, run=ONE_GPU_COMMAND_RUN, eval_points=8, seeds=2,
        # fine-tuning sized to fit beside the training: 3 rates x 1 seed x 2 tasks per encoder, 2 epochs of 2,000
        # rows at batch 32 (each pretraining seed its own runs; a GPU runs such a cell in seconds)
        finetune=FinetuneConfig(seeds=1, epochs=2, batch_size=32), analyze_sequences=512,
        generated_task=(2000, 872), task_train_examples=2000,
        what="12 x 384 encoder, 128-token sequences, 65,536 tokens per step, WSD, 8e15 FLOPs per run: a 10-minute GPU "
             "command (scripts/gpu_check.sh study) for mlm 15%, mlm 30% and 3ml, trained --parallel on one GPU; "
             "real tasks fine-tuned on 2,000 of their training rows"),
    "cpu-30min": CPU_30MIN,
    "quick": StudyPreset(
        budget=0.0, run=(
            "model.hidden_size=64", "model.num_heads=2", "model.encoder_layers=2", "model.max_seq_len=64",
            "model.position_embedding=rotary", "model.norm_position=pre", "model.dropout=0.0",
            "model.attention_dropout=0.0", "data.packing=full", "data.tokens_per_micro_batch=512", "train.lr=3.0e-3",
            "train.warmup_steps=5", "train.zero_stage=2", "train.precision=fp32", "eval.sequences=32",
            "checkpoint.keep=1", "checkpoint.every=1000", "log.every=5", "log.tensorboard=false"),
        eval_points=3, seeds=1, finetune=FinetuneConfig(seeds=1, epochs=1, batch_size=16, lr=1e-3),
        analyze_sequences=16, generated_task=(64, 32), mlm_steps=40, task_train_examples=32,
        what="the CI-sized check of the pipeline: a 2 x 64 encoder for 40 mlm steps' FLOPs; its numbers mean "
             "nothing"),
}


def resolve_budget(text: str) -> tuple[float, StudyPreset]:
    """`--budget`: a preset name, or a FLOP count (then the cpu-30min preset's other settings). A preset that counts
    in mlm steps returns 0 (`study` measures it on the data)."""
    if text in STUDY_PRESETS:
        return STUDY_PRESETS[text].budget, STUDY_PRESETS[text]
    try:
        budget = float(text)
    except ValueError:
        raise FastmaeError(f"--budget {text!r}: expected a FLOP count (e.g. 3e15) or a preset: "
                           f"{sorted(STUDY_PRESETS)}") from None
    if not budget > 0 or not math.isfinite(budget):
        raise FastmaeError(f"--budget {text!r}: must be a positive FLOP count")
    return budget, STUDY_PRESETS["cpu-30min"]
