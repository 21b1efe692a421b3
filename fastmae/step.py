"""One optimizer step: the function the trainer, benchmarks/throughput.py and (through the trainer) the study run,
and the counters (`RunCounters`) the trainer keeps of its steps.

    mask every micro-batch (host counts give w), then
    for each micro-batch:  forward -> backward (loss x its predicted tokens x w) -> engine.step
    (DeepSpeed steps the optimizer after the last micro-batch of the step; w makes the step's gradient the mean over
    every predicted token of the step, on every rank and micro-batch)

`train_step` reads no device value back: the statistics stay on the device until the trainer logs them, and every
count that decides a shape or a weight is a host count of the batch (`RunCounters` reads its bad-step streak on
checkpoint steps only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .batch import PackedBatch
from .data.order import DIGEST_MODULUS, sequences_digest
from .distributed import agree_on_flag, log_line
from .errors import FastmaeError
from .flops import masked_training_flops
from .masking import MaskedBatch, mask_batch


@dataclass
class StepStats:
    """What one optimizer step did on this rank.

    sums: [4] fp64 on the device: loss sum (each micro-batch's mean loss x its predicted tokens), predicted tokens,
    correct predictions and scored predictions (the last two only when the step computed accuracy).
    non_finite: fp32 device scalar, 1.0 when any rank saw a non-finite loss (the step was then skipped).
    tokens, flops, digest: host counts of this rank's micro-batches (tokens, model FLOPs, a digest of the sequences).
    """

    sums: torch.Tensor
    non_finite: torch.Tensor
    tokens: int
    flops: int
    digest: int


def per_token_weight(masked: list[MaskedBatch], device: torch.device) -> torch.Tensor | float:
    """Scalar w such that the micro-batch losses (means over their own predicted tokens) times num_predicted * w add
    up, after DeepSpeed's 1/grad_accum scaling and its mean over ranks, to the mean over every predicted token of the
    step. The counts are the masks' host counts; their sum over ranks is one all-reduce that the host does not wait
    for (w a device scalar), and in a world of one w is a host number."""
    local = sum(m.num_predicted for m in masked)
    if dist.get_world_size() == 1:
        return len(masked) / max(local, 1)
    total = torch.full((), float(local), dtype=torch.float32, device=device)
    dist.all_reduce(total)
    return (len(masked) * dist.get_world_size()) / total.clamp(min=1.0)


def train_step(engine, micro_batches: list[PackedBatch | MaskedBatch], *, seed: int, non_finite: torch.Tensor,
               compute_accuracy: bool = False) -> StepStats:
    """Run one optimizer step of `engine` (a DeepSpeed engine around a MaskedLM) on this rank's micro-batches.

    Each micro-batch is masked for (seed, its index in the run), so masks do not depend on the rank count: the
    trainer's come masked already (`pipeline.masked_ahead`, on the host), a PackedBatch is masked here, on its device.
    `non_finite` is the engine's skip flag (`build_engine(found_inf=...)`): it is set on the device when any rank's
    loss is not finite, and the optimizer then leaves the weights as they were.
    """
    model_config = engine.module.config
    if len(micro_batches) != engine.gradient_accumulation_steps():  # a batch warm-up's step (data.order.StepSizes)
        engine.set_train_batch_size(len(micro_batches) * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
    batches = [b.batch if isinstance(b, MaskedBatch) else b for b in micro_batches]
    if any(batch.index is None for batch in batches):
        raise ValueError("train_step: every micro-batch needs its index in the run (PackedBatch.index), which "
                         "keys its masks; the data loader sets it")
    device = non_finite.device
    masks = [b if isinstance(b, MaskedBatch) else mask_batch(b, model_config, seed, b.index) for b in micro_batches]
    weight = per_token_weight(masks, device)
    non_finite.zero_()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, predicted, correct, scored
    tokens = flops = digest = 0
    for i, (batch, masked) in enumerate(zip(batches, masks)):
        last = i + 1 == len(masks)
        engine.set_gradient_accumulation_boundary(last)  # the step's own count, not DeepSpeed's count of all so far
        out = engine(masked, compute_accuracy=compute_accuracy)
        loss = out.loss.detach()
        torch.maximum(non_finite, (loss * 0).ne(0), out=non_finite)  # inf or NaN times 0 is NaN: 3 ops, no isfinite
        if last:  # before the last backward: DeepSpeed's optimizer step follows it
            agree_on_flag(non_finite)
        engine.backward(out.loss * (out.num_predicted * weight))
        engine.step()
        sums[0].add_(loss, alpha=out.num_predicted)  # in fp64; the product of an fp32 loss and a count is exact
        sums[1].add_(out.num_predicted)
        if compute_accuracy:
            sums[2].add_(out.num_correct)
            sums[3].add_(out.num_predicted)
        tokens += masked.num_tokens
        if batch.dataset_ids is not None:
            digest = (digest + sequences_digest(batch.dataset_ids)) % DIGEST_MODULUS
        flops += masked_training_flops(model_config, masked)
    return StepStats(sums=sums, non_finite=non_finite, tokens=tokens, flops=flops, digest=digest)


@dataclass
class RunCounters:
    """Where the run stands: optimizer steps done, this rank's shares of the tokens and FLOPs, and the skipped steps
    (total and the current streak, counted on the device so the flag is never read back; `skipped_logged` is the
    count the last train record reported)."""

    skipped_device: torch.Tensor
    bad_streak_device: torch.Tensor
    step: int = 0
    tokens_seen: int = 0
    flops_done: int = 0
    skipped_logged: int = 0

    def add(self, stats: StepStats) -> None:
        self.skipped_device += stats.non_finite
        self.bad_streak_device.mul_(stats.non_finite).add_(stats.non_finite)
        self.step += 1
        self.tokens_seen += stats.tokens
        self.flops_done += stats.flops

    def state(self) -> dict:
        """What a checkpoint keeps of the counters (the device's counts read back)."""
        return {"step": self.step, "tokens_seen": self.tokens_seen, "flops_done": self.flops_done,
                "bad_streak": int(self.bad_streak_device.item()), "skipped": int(self.skipped_device.item())}

    def restore(self, saved: dict, shares: bool) -> None:
        """Continue from a checkpoint's `state()`; `shares`: this rank's token and FLOP shares too."""
        self.step, self.skipped_logged = saved["step"], saved["skipped"]
        self.bad_streak_device.fill_(saved["bad_streak"])
        self.skipped_device.fill_(saved["skipped"])
        if shares:
            self.tokens_seen, self.flops_done = saved["tokens_seen"], saved["flops_done"]

    def check_bad_streak(self, bad_streak: int, skipped: int, max_bad_steps: int) -> None:
        """On logged steps, with the counts read back: report skipped steps, and stop after `max_bad_steps` of
        them in a row."""
        if skipped > self.skipped_logged:
            log_line(f"non-finite loss: {skipped - self.skipped_logged} step(s) skipped up to step {self.step} "
                     f"({skipped} so far)")
        self.skipped_logged = skipped
        if bad_streak >= max_bad_steps:
            raise FastmaeError(f"{bad_streak} optimizer steps in a row with a non-finite loss (steps "
                               f"{self.step - bad_streak + 1}-{self.step}): stopping; the checkpoints written before "
                               "them are kept (lower train.lr, check the data, or raise train.max_bad_steps)")

    def inside_bad_streak(self) -> bool:
        """Whether the last step was skipped (non-finite loss), read back (checkpoint steps ask): no periodic
        checkpoint is written then, since its weights are the newest checkpoint's and rotating by checkpoint.keep
        could drop the last one from before the streak before train.max_bad_steps stops the run."""
        streak = int(self.bad_streak_device.item())  # agreed over ranks: every rank reads the same
        if streak:
            log_line(f"step {self.step}: no checkpoint written inside a streak of {streak} skipped step(s)")
        return streak > 0
