"""What a run continues: the checkpoint `--resume` names (or a decay branch's), the global batch an elastic resume
keeps, and the check that this run continues it exactly (its schedules, its batch) before its state is loaded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from . import checkpoint
from .config import RunConfig
from .data import PackedLoader
from .data.order import StepSizes
from .distributed import checkpoint_to_resume
from .errors import ConfigError
from .schedule import MaskRates, Schedule, check_continuation


def checkpoint_to_continue(config: RunConfig, resume: str | None) -> Path | None:
    """Collective: the checkpoint this run continues: the one `--resume` names, else a decay branch's
    (train.branch_from), else None."""
    root = Path(config.log.dir) / "checkpoints"
    found = checkpoint_to_resume(root, resume)
    if found is None and config.train.branch_from:  # a decay branch starts where its checkpoint stopped
        found = checkpoint_to_resume(root, config.train.branch_from)
    return found


def kept_batch(config: RunConfig, directory: Path | None, world: int) -> RunConfig:
    """`config` for `world` ranks (`RunConfig.for_world`); continuing the checkpoint in `directory` with neither
    train.tokens_per_step nor train.grad_accum set, at the checkpoint's global batch: accumulation follows the rank
    count, so an elastic resume continues the same run."""
    saved = checkpoint.saved_batch(directory) if directory is not None else None
    train = config.train
    if saved is None or train.tokens_per_step or train.grad_accum != 1:
        return config.for_world(world)
    tokens = saved["micro_batches_per_step"] * saved["tokens_per_micro_batch"]
    try:
        return dataclasses.replace(config, train=dataclasses.replace(train, tokens_per_step=tokens)).for_world(world)
    except ConfigError as err:
        raise ConfigError(f"{directory}: trained with global batches of {tokens} tokens, which a resume keeps when "
                          f"train.tokens_per_step is not set; on {world} rank(s): {err}") from None


def continue_from(engine, directory: Path, config: RunConfig, schedule: Schedule, mask_rates: MaskRates,
                  loader: PackedLoader) -> list[dict]:
    """Collective: the trainer states of every rank of the checkpoint in `directory`, loaded into `engine`, once
    `check_continuation` agrees that this run (its schedules, the batches of its `loader`) continues it exactly."""
    states = checkpoint.load(engine, directory, dataclasses.asdict(config.model))
    check_continuation(directory, states[0], schedule, global_batch(loader), mask_rates)
    return states


def global_batch(loader: PackedLoader) -> dict:
    """A step's global batch, as checkpoints keep it (a run continues exactly only with the same), with its warm-up's
    settings where it has one (`data.order.StepSizes`)."""
    tokens, start = loader.step_sizes.warmup
    warmup = {"warmup": {"tokens": tokens, "from": start}} if tokens else {}
    return {"micro_batches_per_step": loader.micro_batches_per_step, "tokens_per_micro_batch": loader.tokens_per_batch,
            **warmup}


def elastic_batches(sizes: StepSizes, step: int) -> str:
    """What a resume on another number of ranks at step `step` keeps of the run's batches, for the log."""
    kept = f"the same micro-batches follow, {sizes.full} per step"
    if step >= (sizes.ends or (0,))[-1]:
        return kept
    return (f"{kept} from step {sizes.ends[-1]:,}; the batch warm-up's steps until then take this rank count's sizes "
            f"({sizes.count(step)} micro-batches at step {step + 1:,})")
