"""The learning-rate schedule of a pretraining run, and when a checkpoint may continue under another plan
(ARCHITECTURE.md section 5).

Schedules (`train.schedule`): fairseq's `linear` / `polynomial` (linear warm-up, then decay to a total fixed before
the first step), and warmup-stable-decay, `wsd` (linear warm-up, the peak rate held, then a separate decay over the
last `train.decay_steps`, or `train.decay_fraction` of the run (0: none), shaped `linear`, `1-sqrt` or `cosine`,
to min_lr_ratio x lr; Hägele et al. 2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations").

A run continues exactly from a checkpoint of step N under a plan whose learning rate at every step up to N, the step
the restored optimizer takes first included, is the one it had (`first_difference`): a `wsd` run still in its stable
phase may be extended (a larger `train.steps` or budget), or branched into a run of its own that decays from it
(`train.branch_from`, `branch_plan`). Anything else (a schedule already decaying, another peak rate, another global
batch) is refused naming both values (`check_continuation`).

The masking rate may follow a schedule too (`MaskRates`: model.mask_rate to model.mask_rate_end, linearly in whole
percents or in one step), over the run's steps; a continuation keeps the rate of every step already taken.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import saved_step
from .config import ModelConfig, RunConfig, TrainConfig
from .data.order import StepSizes
from .errors import FastmaeError


def lr_multiplier(step: int, warmup: int, total: int, power: float = 1.0, min_ratio: float = 0.0) -> float:
    """Learning rate at optimizer step `step` as a fraction of the peak.

    Linear warm-up from 1/warmup to 1 over `warmup` steps, then (1 - progress)^power decay to `min_ratio` at
    `total` (power 1 is linear decay).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * (1.0 - progress) ** power


@dataclass(frozen=True)
class Schedule:
    """One run's learning rate, step by step: `kind` (config.run.SCHEDULES), the peak `lr`, `warmup` and total `steps`;
    `power` for polynomial decay; for wsd the decay's resolved length `decay_steps` and `decay_shape`; every decay
    ends at `min_ratio` x lr."""

    kind: str
    lr: float
    warmup: int
    steps: int
    power: float = 1.0
    min_ratio: float = 0.0
    decay_steps: int = 0
    decay_shape: str = "linear"

    @classmethod
    def of(cls, train: TrainConfig) -> Schedule:
        """The schedule `train` asks for, over its (planned) `steps`. Raises FastmaeError where a wsd decay leaves
        no stable phase after the warm-up."""
        if train.schedule != "wsd":
            return cls(train.schedule, train.lr, train.warmup_steps, train.steps,
                       train.power if train.schedule == "polynomial" else 1.0, train.min_lr_ratio)
        decay = train.decay_steps or round(train.decay_fraction * train.steps)
        if train.steps - decay < train.warmup_steps:
            given = (f"train.decay_steps={train.decay_steps}" if train.decay_steps
                     else f"train.decay_fraction={train.decay_fraction:g} ({decay} steps)")
            raise FastmaeError(f"{given} and train.warmup_steps={train.warmup_steps} exceed train.steps="
                               f"{train.steps}: a wsd schedule needs its decay after the warm-up")
        return cls("wsd", train.lr, train.warmup_steps, train.steps, 1.0, train.min_lr_ratio, decay,
                   train.decay_shape)

    @property
    def decay_start(self) -> int:
        """The first step whose rate may fall below the peak (the end of the warm-up, or of wsd's stable phase)."""
        return self.steps - self.decay_steps if self.kind == "wsd" else self.warmup

    def multiplier(self, step: int) -> float:
        """The learning rate at optimizer step `step` (0-based) as a fraction of the peak."""
        if self.kind != "wsd":
            return lr_multiplier(step, self.warmup, self.steps, self.power, self.min_ratio)
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step < self.decay_start or not self.decay_steps:  # stable (to the end, without a decay)
            return 1.0
        progress = min(1.0, (step - self.decay_start) / self.decay_steps)
        remaining = {"linear": 1.0 - progress, "1-sqrt": 1.0 - math.sqrt(progress),
                     "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[self.decay_shape]
        return self.min_ratio + (1.0 - self.min_ratio) * remaining

    def describe(self) -> str:
        """One line for the log and the model card."""
        end = f"{self.min_ratio:g} x lr" if self.min_ratio else "0"
        if self.kind != "wsd" and self.warmup >= self.steps:  # a run shorter than its warm-up never decays
            return (f"lr {self.lr:g}: {self.warmup} warm-up steps, cut by the run's end at step {self.steps}: the "
                    f"last step at {self.multiplier(self.steps - 1):.2g} x lr, no decay")
        if self.kind != "wsd":
            shape = "linear" if self.kind == "linear" else f"polynomial (power {self.power:g})"
            return (f"lr {self.lr:g}: {self.warmup} warm-up steps, then {shape} decay to {end} at step {self.steps}")
        if not self.decay_steps:
            return f"lr {self.lr:g}: {self.warmup} warm-up steps, then stable to step {self.steps} (wsd, no decay)"
        return (f"lr {self.lr:g}: {self.warmup} warm-up steps, stable to step {self.decay_start}, then "
                f"{self.decay_shape} decay over {self.decay_steps} steps to {end} at step {self.steps} (wsd)")

    def record(self) -> dict:
        """The schedule as checkpoints keep it (`Schedule(**record)` rebuilds it)."""
        return dataclasses.asdict(self)

    def first_difference(self, other: Schedule, through: int) -> int | None:
        """The first step in 0..through whose learning rate differs between the two schedules, or None."""
        return next((step for step in range(through + 1)
                     if self.lr * self.multiplier(step) != other.lr * other.multiplier(step)), None)


@dataclass(frozen=True)
class MaskRates:
    """The masking rate step by step (model.mask_rate, mask_rate_end, mask_rate_shape, mask_rate_switch) over a run
    of `steps`. A linear schedule moves in whole percents, so that a run sees a few rates (|end - start| x 100 + 1),
    each a fixed set of per-sequence counts: the shapes recorded CUDA graphs replay stay few. Masking stays exact on
    the host: a sequence's count is round(rate(step) x maskable)."""

    start: float
    end: float
    shape: str = "linear"
    switch: float = 0.5
    steps: int = 1

    @classmethod
    def of(cls, model: ModelConfig, steps: int) -> MaskRates:
        """The schedule `model` asks for over `steps` (a constant rate without mask_rate_end)."""
        end = model.mask_rate if model.mask_rate_end == -1.0 else model.mask_rate_end
        return cls(model.mask_rate, end, model.mask_rate_shape, model.mask_rate_switch, steps)

    @property
    def constant(self) -> bool:
        return self.start == self.end

    def rate(self, step: int) -> float:
        """The masking rate of optimizer step `step` (0-based)."""
        if self.constant:
            return self.start
        progress = min(1.0, step / max(1, self.steps - 1))
        if self.shape == "step":
            return self.start if progress < self.switch else self.end
        return round(100 * (self.start + (self.end - self.start) * progress)) / 100

    def by_index(self, micro_batches_per_step: int) -> Callable[[int], float] | None:
        """The rate of a micro-batch by its index in the run (None for a constant rate: the model's own)."""
        return None if self.constant else lambda index: self.rate(index // micro_batches_per_step)

    def describe(self) -> str:
        """One line for the log."""
        if self.constant:
            return f"masking rate {self.start:g}"
        levels = round(abs(self.end - self.start) * 100) + 1
        how = f"linearly in steps of 1% ({levels} rates)" if self.shape == "linear" else f"at {self.switch:g} of it"
        return f"masking rate {self.start:g} -> {self.end:g} {how} over {self.steps} steps"

    def record(self) -> dict:
        """The schedule as checkpoints keep it (`MaskRates(**record)` rebuilds it)."""
        return dataclasses.asdict(self)


def schedules_line(schedule: Schedule, mask_rates: MaskRates, sizes: StepSizes, micro_tokens: int) -> str:
    """The log's line of a run's schedules (and `fastmae train --plan`'s): learning and masking rates, batch warm-up."""
    return (f"learning rate: {schedule.describe()}; {mask_rates.describe()}"
            f"{sizes.describe(micro_tokens, schedule.steps)}")


def check_continuation(source: Path, saved: dict, schedule: Schedule, batch: dict,
                       mask_rates: MaskRates | None = None) -> None:
    """Refuse to continue the checkpoint at `source` (its trainer state `saved`, of step saved["step"]) under
    `schedule` and the global `batch` ({micro_batches_per_step, tokens_per_micro_batch}) where the run would not
    continue exactly: a step already taken (or the next, which the restored optimizer takes at its saved rate) at
    another learning rate, a step already taken at another masking rate (`mask_rates`), or another batch.
    Checkpoints from before these were recorded are not checked."""
    step = saved["step"]
    if "batch" in saved and saved["batch"] != batch:
        micro, count = saved["batch"]["tokens_per_micro_batch"], saved["batch"]["micro_batches_per_step"]
        raise FastmaeError(f"{source}: trained with global batches of {_batch(saved['batch'])}, this run's are "
                           f"{_batch(batch)}: resume or branch it with the batch it was trained with "
                           f"(data.tokens_per_micro_batch={micro} and train.tokens_per_step={micro * count}, or "
                           "train.tokens_per_step and train.grad_accum left unset: a resume keeps its batch"
                           + ("; and its train.batch_warmup_tokens and train.batch_warmup_from"
                              if "warmup" in saved["batch"] or "warmup" in batch else "") + ")")
    if "mask_rates" in saved and mask_rates is not None:
        before = MaskRates(**saved["mask_rates"])
        differs = next((s for s in range(step) if before.rate(s) != mask_rates.rate(s)), None)
        if differs is not None:
            raise FastmaeError(f"{source}: step {step} was reached under {before.describe()}; this run's plan, "
                               f"{mask_rates.describe()}, masks step {differs} at {mask_rates.rate(differs):g} where "
                               f"it was masked at {before.rate(differs):g}: resume or branch it with the masking it "
                               "was trained with")
    if "schedule" not in saved:
        return
    before = Schedule(**saved["schedule"])
    differs = before.first_difference(schedule, step)
    if differs is not None:
        raise FastmaeError(
            f"{source}: step {step} was reached under {before.describe()}; this run's plan, {schedule.describe()}, "
            f"gives step {differs} a learning rate of {schedule.lr * schedule.multiplier(differs):.6g} where it was "
            f"{before.lr * before.multiplier(differs):.6g}. A run continues exactly only where every step taken keeps "
            "its rate: extend or branch a wsd run while it is still stable, or resume with the plan it was trained "
            "with")


def _batch(batch: dict) -> str:
    warmup = batch.get("warmup")
    grows = f", growing from {warmup['from']} tokens over the first {warmup['tokens']}" if warmup else ""
    return f"{batch['micro_batches_per_step']} micro-batches of {batch['tokens_per_micro_batch']} tokens{grows}"


def branch_plan(config: RunConfig) -> RunConfig:
    """`config` itself, or for a decay branch (train.branch_from, a checkpoint of step N) with train.steps N +
    train.decay_steps, so the branch decays over its own length from where it starts. Raises FastmaeError for what a
    branch cannot be (another schedule, no decay length, a FLOP budget, init_from too)."""
    train = config.train
    if not train.branch_from:
        return config
    where = f"train.branch_from={train.branch_from}"
    if train.schedule != "wsd":
        raise FastmaeError(f"{where}: a branch decays from a stable phase, so it needs train.schedule=wsd (not "
                           f"{train.schedule!r})")
    if train.decay_steps <= 0:
        raise FastmaeError(f"{where}: give the branch's decay length as train.decay_steps (it is "
                           f"{train.decay_steps})")
    for key, value in (("flops_budget", train.flops_budget), ("init_from", train.init_from)):
        if value:
            raise FastmaeError(f"{where} with train.{key}={value!r}: a branch continues its checkpoint's run "
                               f"for train.decay_steps; drop train.{key}")
    steps = saved_step(Path(train.branch_from), "train.branch_from") + train.decay_steps
    return dataclasses.replace(config, train=dataclasses.replace(train, steps=steps))
