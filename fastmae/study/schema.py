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
    """Fine-tuned scores of an objective's encoders on one task: every (pretraining seed, fine-tuning seed) pair at
    each encoder's best cell of the fine-tuning grid (`fastmae glue`)."""

    task: str | None
    metric: str
    median: float
    spread: float | None  # max - min over the runs; None with one run
    runs: int
    scores: list[float]
    did_not_train: list[str] = dataclasses.field(default_factory=list)  # per fine-tune that did not: which and why


@dataclass
class Ranks:
    """Epsilon ranks (MAE-LM's definition) of an objective's encoders per layer, by input group
    (`real_unmasked_input`, `real_masked_input`, ...): seed means per layer, uncentred and centred, and the last
    layer's per seed."""

    epsilon_rank: dict[str, list[float]]
    centred_epsilon_rank: dict[str, list[float]]
    last_layer_per_seed: dict[str, list[float]]
    centred_last_layer_per_seed: dict[str, list[float]]


@dataclass
class MatchedRanks:
    """Ranks at one held-out loss level for every objective: each seed's weights kept at the evaluation nearest the
    level (`steps`, `losses`). `excluded` says why an objective has none (it never left the unigram plateau)."""

    level: float | None
    excluded: str | None = None
    steps: list[int] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    ranks: Ranks | None = None


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
    ranks_at_matched_loss: MatchedRanks | None = None
    finetune: list[FinetuneResult] = dataclasses.field(default_factory=list)  # one per task fine-tuned
    neighbour_probe: list[dict] = dataclasses.field(default_factory=list)  # per seed, at the end (fastmae analyze)

    def to_json(self) -> dict:
        """study.json's entry (no `finetune` key without a task)."""
        out = dataclasses.asdict(self)
        if not self.finetune:
            del out["finetune"]
        return out

    @classmethod
    def from_json(cls, entry: dict) -> ObjectiveResult:
        """The inverse of `to_json`: study.json's entry as the types the findings and the report read."""
        fields = {**entry}
        fields["per_seed"] = [SeedResult(**{**s, "curve": [EvalPoint(**p) for p in s["curve"]]})
                              for s in entry["per_seed"]]
        fields["finetune"] = [FinetuneResult(**f) for f in entry.get("finetune", [])]
        matched = entry.get("ranks_at_matched_loss")
        if matched is not None:
            ranks = matched.get("ranks")
            fields["ranks_at_matched_loss"] = MatchedRanks(**{**matched, "ranks": Ranks(**ranks) if ranks else None})
        return cls(**fields)
