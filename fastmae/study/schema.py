"""The study's results as types: what `summary` computes and the findings, plots and report read. study.json holds
their `to_json` (field names are study.json's keys)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class EvalPoint:
    """One held-out evaluation of a run: after `step` optimizer steps and `flops` training FLOPs."""

    step: int
    flops: float
    loss: float
    accuracy: float


@dataclass
class SeedResult:
    """One pretraining seed of an objective: where its budget ended, its curve and its held-out baselines."""

    seed: int
    steps: int
    flops: float
    final_eval_loss: float
    final_eval_accuracy: float
    percent_of_mlm_compute_to_match: float | None  # None: never reached mlm's final loss (of the same seed)
    curve: list[EvalPoint]
    unigram_entropy: float
    unigram_accuracy: float
    seconds: float | None  # wall time of the training run, when the study trained it


@dataclass
class FinetuneResult:
    """Fine-tuned scores of an objective's encoders: every (pretraining seed, fine-tuning seed) pair."""

    task: str | None
    metric: str
    median: float
    spread: float | None  # max - min over the runs; None with one run
    runs: int
    scores: list[float]


@dataclass
class ObjectiveResult:
    """An objective's results over its seeds: means, spreads, per-seed values, effective ranks per layer by input
    group (`real_unmasked_input`, `real_masked_input`, ...), and fine-tuning when the study had a task."""

    flops: float
    final_eval_loss: float
    final_eval_accuracy: float
    percent_of_mlm_compute_to_match: float | None
    seeds_reaching_mlm_loss: int
    final_eval_loss_spread: float | None
    steps: list[int]
    model: dict
    per_seed: list[SeedResult]
    effective_rank: dict[str, list[float]]
    centred_effective_rank: dict[str, list[float]]
    effective_rank_last_layer_per_seed: dict[str, list[float]]
    finetune: FinetuneResult | None = None

    def to_json(self) -> dict:
        """study.json's entry (no `finetune` key without a task)."""
        out = dataclasses.asdict(self)
        if self.finetune is None:
            del out["finetune"]
        return out
