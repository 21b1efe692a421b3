"""Analytical training FLOPs of a masked batch (forward + backward = 3x forward), for MFU and compute budgets.

Per layer: the projections and feed-forward 2 * (4 H^2 + 2 H I) per row (2 * (4 H^2 + 3 H I) for a gated one, whose
input projection makes 2 I); attention 4 H per (query, key) pair of a sequence (QK^T and AV): every pair in a global
layer, the pairs within the window of original positions in a local one (`window_pairs`: exact on the full stream;
on a shortened stream, whose kept positions the host does not know, the full stream's scaled by the kept share
squared, its expected value under uniform removal). Layers [0, k) run on the visible rows, [k, L + d) on all
rows; a `cross` decoder layer runs its query, output and feed-forward projections on the predicted rows only, its
key/value projections on all rows, and attends from each predicted row to its whole sequence. The head (dense + tied
projection) runs on predicted rows only. Embedding lookups, norms, softmaxes and the loss are ignored, as usual;
`tests/test_flops.py` checks the count against torch's FlopCounterMode.

A run with a FLOP budget (`train.flops_budget`, what `fastmae study` compares objectives under) needs its step count
before the first step, because the learning-rate schedule decays to it: `plan_budget` reads the run's own batches on
the host (every rank's, in order) and adds up their FLOPs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .batch import PackedBatch
from .config import ModelConfig
from .masking import MaskCounts, MaskedBatch
from .schedule import MaskRates


def layer_flops(config: ModelConfig, tokens: int, pairs: int) -> int:
    """Forward FLOPs of one self-attention layer over `tokens` rows whose queries attend to `pairs` keys in all."""
    h = config.hidden_size
    return 2 * tokens * (4 * h * h + h * (config.ffn_input_size + config.intermediate_size)) + 4 * h * pairs


def cross_layer_flops(config: ModelConfig, tokens: int, queries: int, query_key_pairs: int) -> int:
    """Forward FLOPs of one `cross` decoder layer: `queries` predicted rows attending to their sequences' rows."""
    h = config.hidden_size
    ffn = h * (config.ffn_input_size + config.intermediate_size)
    return 2 * queries * (2 * h * h + ffn) + 2 * tokens * 2 * h * h + 4 * h * query_key_pairs


def window_pairs(lengths: np.ndarray, half_window: int) -> np.ndarray:
    """(query, key) pairs per sequence of `lengths` consecutive positions when each query sees the keys within
    `half_window` of its position: n (2w + 1) - w (w + 1) once n > w, every pair (n^2) below."""
    n = np.asarray(lengths, dtype=np.int64)
    w = half_window
    return np.where(n > w, n * (2 * w + 1) - w * (w + 1), n * n)


def head_flops(config: ModelConfig, predicted: int) -> int:
    h = config.hidden_size
    return 2 * predicted * (h * h + h * config.vocab_size)


def training_flops(config: ModelConfig, seqlens: torch.Tensor, visible_seqlens: torch.Tensor,
                   predicted_seqlens: torch.Tensor) -> int:
    """Forward + backward FLOPs of one batch from its host counts ([B] int tensors or arrays: tokens, visible tokens
    and predicted tokens of each sequence), in numpy: host arithmetic, no device op, no sync."""
    seqlens, visible_seqlens, predicted_seqlens = (
        np.asarray(counts, dtype=np.int64) for counts in (seqlens, visible_seqlens, predicted_seqlens))
    k, n_dec, kinds = config.insert_layer, config.decoder_layers, config.layer_kinds
    tokens, visible_tokens, predicted = int(seqlens.sum()), int(visible_seqlens.sum()), int(predicted_seqlens.sum())
    full = {"global": layer_flops(config, tokens, int((seqlens**2).sum()))}
    visible = {"global": layer_flops(config, visible_tokens, int((visible_seqlens**2).sum()))}
    if "local" in kinds:
        local = window_pairs(seqlens, config.local_half_window)
        full["local"] = layer_flops(config, tokens, int(local.sum()))
        kept = visible_seqlens / np.maximum(seqlens, 1)
        visible["local"] = layer_flops(config, visible_tokens, round(float((local * kept**2).sum())))
    if config.decoder_kind == "cross":
        decoder = cross_layer_flops(config, tokens, predicted, int((predicted_seqlens * seqlens).sum()))
    else:
        decoder = full["global"]
    encoder = sum(visible[kind] for kind in kinds[:k]) + sum(full[kind] for kind in kinds[k:])
    return 3 * (encoder + n_dec * decoder + head_flops(config, predicted))


def batch_training_flops(config: ModelConfig, batch: PackedBatch, counts: MaskCounts | None = None) -> int:
    """Forward + backward FLOPs of training on `batch` under `config`'s masking, from host counts only: `counts` as
    `masking.mask_batch` made them (the trainer has them), else computed the same way (the plan, before any step)."""
    if counts is None:
        counts = MaskCounts.for_batch(batch, config.mask_rate, config.mask_token_prob, config.random_token_prob)
    return _sequences_flops(config, batch.seqlens, counts)


def masked_training_flops(config: ModelConfig, masked: MaskedBatch) -> int:
    """`batch_training_flops` of a masked batch's own sequences: a padded batch's fillers are not the model's work."""
    return _sequences_flops(config, *masked.own_sequences())


def _sequences_flops(config: ModelConfig, seqlens: torch.Tensor, counts: MaskCounts) -> int:
    return training_flops(config, seqlens, seqlens - counts.removed, counts.predicted)


PLAN_EXACT_MICRO_BATCHES = 5000
"""`plan_budget` adds up the FLOPs of the steps within this many micro-batches (all ranks) exactly and extrapolates
beyond at their mean: a few seconds of host work, and with `full` packing steps differ only in their mask counts."""


@dataclass(frozen=True)
class BudgetPlan:
    """The optimizer steps that fit a FLOP budget, and the steps after which evaluations fall."""

    steps: int
    """The most steps whose cumulative FLOPs (all ranks) stay within the budget."""
    planned_flops: float
    """Cumulative FLOPs of those steps (exact if `exact`, else extrapolated past PLAN_EXACT_STEPS)."""
    flops_per_step: float
    """Mean FLOPs of one step (all ranks) over the planned batches."""
    eval_steps: tuple[int, ...]
    """For each multiple m * eval_every_flops up to the budget, the last step whose cumulative FLOPs <= it; and the
    last step."""
    exact: bool
    """Whether every planned step's FLOPs were added up (else the tail is extrapolated)."""


def plan_budget(batches: Iterable[PackedBatch], config: ModelConfig, micro_batches_per_step: int, budget: float,
                eval_every_flops: float = 0.0, exact_micro_batches: int = PLAN_EXACT_MICRO_BATCHES) -> BudgetPlan:
    """Plan a run of `budget` training FLOPs from the micro-batches all data-parallel ranks together will draw, in
    training order (`PackedLoader.every_rank()`), `micro_batches_per_step` per optimizer step. Host-side, over batches,
    not tokens. A masking-rate schedule (model.mask_rate_end) is planned with its steps (`_plan_scheduled`)."""
    it: Iterator[PackedBatch] = iter(batches)
    exact_steps = max(1, exact_micro_batches // micro_batches_per_step)
    if not MaskRates.of(config, 1).constant:
        return _plan_scheduled(_SampledSteps(it, config, micro_batches_per_step, exact_steps), config, budget,
                               eval_every_flops)
    cumulative = [0.0]
    while len(cumulative) <= exact_steps and cumulative[-1] <= budget:
        step = sum(batch_training_flops(config, next(it)) for _ in range(micro_batches_per_step))
        cumulative.append(cumulative[-1] + step)
    measured = len(cumulative) - 1
    per_step = cumulative[-1] / measured
    exact = cumulative[-1] > budget

    def flops_at(step: int) -> float:
        return cumulative[step] if step <= measured else cumulative[-1] + (step - measured) * per_step

    def last_step_within(limit: float) -> int:
        if limit >= cumulative[-1]:  # past the exactly added-up steps: extrapolate
            return measured + int((limit - cumulative[-1]) // per_step)
        return bisect.bisect_right(cumulative, limit) - 1

    steps = last_step_within(budget)
    return BudgetPlan(steps=steps, planned_flops=flops_at(steps), flops_per_step=per_step,
                      eval_steps=_eval_steps(last_step_within, steps, budget, eval_every_flops), exact=exact)


def _eval_steps(last_step_within, steps: int, budget: float, eval_every_flops: float) -> tuple[int, ...]:
    """For each multiple of eval_every_flops up to the budget, the last step within it; and the last step."""
    if eval_every_flops <= 0:
        return ()
    limits = [m * eval_every_flops for m in range(1, int(budget // eval_every_flops) + 1)]
    return tuple(sorted({s for s in map(last_step_within, limits) if s > 0} | {steps}))


class _SampledSteps:
    """The FLOPs of a run's first `exact_steps` steps at any masking rate, read from its batches as asked for and
    kept per (step, rate); beyond them, a rate's mean over the steps read (the budget's tail is extrapolated)."""

    def __init__(self, batches: Iterator[PackedBatch], config: ModelConfig, per_step: int, exact_steps: int):
        self.batches, self.config, self.per_step, self.exact_steps = batches, config, per_step, exact_steps
        self.steps: list[list[PackedBatch]] = []
        self.flops: dict[tuple[int, float], int] = {}
        self.means: dict[float, float] = {}

    def at(self, step: int, rate: float) -> float:
        """Forward + backward FLOPs of step `step` (0-based) masked at `rate` (all ranks)."""
        while len(self.steps) <= min(step, self.exact_steps - 1):
            self.steps.append([next(self.batches) for _ in range(self.per_step)])
        if step >= self.exact_steps:
            if rate not in self.means:
                self.means[rate] = sum(self.at(s, rate) for s in range(self.exact_steps)) / self.exact_steps
            return self.means[rate]
        if (step, rate) not in self.flops:
            config = self.config.replace(mask_rate=rate, mask_rate_end=-1.0)
            self.flops[step, rate] = sum(batch_training_flops(config, batch) for batch in self.steps[step])
        return self.flops[step, rate]


def _plan_scheduled(sampled: _SampledSteps, config: ModelConfig, budget: float, eval_every_flops: float) -> BudgetPlan:
    """`plan_budget` under a masking-rate schedule, which runs over the run's steps while the steps that fit the
    budget depend on the masking: the most steps S whose FLOPs, masked as the schedule over S masks them, fit the
    budget (found by iterating S from the plan at the first rate; each step's FLOPs exact within the sampled steps,
    the tail at its rate's mean)."""

    def cumulative(horizon: int) -> list[float]:
        rates, totals = MaskRates.of(config, horizon), [0.0]
        while totals[-1] <= budget:
            totals.append(totals[-1] + sampled.at(len(totals) - 1, rates.rate(len(totals) - 1)))
        return totals  # its last entry is the first over the budget

    first = cumulative(1)  # the plan at the first rate
    steps, tried = len(first) - 2, set()
    if steps == 0:  # not one step fits: the caller says so
        return BudgetPlan(steps=0, planned_flops=0.0, flops_per_step=first[1], eval_steps=(), exact=True)
    while steps not in tried:  # a fixed point, or the cycle's end
        tried.add(steps)
        steps = max(1, len(cumulative(steps)) - 2)
    while steps > 1 and len(cumulative(steps)) - 2 < steps:  # the plan's own steps must fit
        steps -= 1
    totals = cumulative(steps)

    def last_step_within(limit: float) -> int:
        return bisect.bisect_right(totals, limit) - 1

    return BudgetPlan(steps=steps, planned_flops=totals[steps], flops_per_step=totals[steps] / steps,
                      eval_steps=_eval_steps(last_step_within, steps, budget, eval_every_flops),
                      exact=steps <= sampled.exact_steps)
