"""The optimizer (fused AdamW that clips on the device), its parameter groups, and the learning-rate schedule
(fairseq's polynomial decay with linear warm-up)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ClippingAdamW(torch.optim.AdamW):
    """torch's fused AdamW that first scales the gradients it steps to a global norm of at most `max_norm`, on the
    device: nothing is read back to the host (DeepSpeed's clipping reads the norm to decide; ARCHITECTURE.md
    section 5).

    `partitioned`: each rank steps only its ZeRO partition, so the squared norms are summed over ranks (an
    all-reduce the host does not wait for); otherwise every rank holds the whole, already averaged gradient. A
    non-finite norm sets `found_inf` (the run's skip flag, a device fp32 scalar), and the fused step then changes
    nothing. The coefficient is DeepSpeed's: max_norm / (norm + 1e-6), applied when below 1.
    """

    def __init__(self, params, *, max_norm: float, found_inf: torch.Tensor | None, partitioned: bool, **kwargs):
        super().__init__(params, fused=True, **kwargs)
        self.max_norm, self.partitioned = max_norm, partitioned
        self.found_inf = found_inf  # read by the fused kernel on every step (None: never skip)
        self.last_norm: torch.Tensor | None = None  # the global norm before clipping, on the device

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if params:
            squares = torch.stack(torch._foreach_norm([p.grad for p in params])).float().square().sum()
            if self.partitioned and dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(squares)  # torch's get_total_norm cannot sum over ranks
            self.last_norm = norm = squares.sqrt()
            if self.found_inf is not None:
                torch.maximum(self.found_inf, (~torch.isfinite(norm)).float(), out=self.found_inf)
            if self.max_norm > 0:  # the clamped coefficient, multiplied without a host read
                torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm, foreach=True)
        return super().step(closure)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: biases, LayerNorm parameters and 1-D tensors get none (as in RoBERTa)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 and "norm" not in name else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_multiplier(step: int, warmup: int, total: int, power: float = 1.0, min_ratio: float = 0.0) -> float:
    """Learning rate at optimizer step `step` as a fraction of the peak.

    Linear warm-up from 1/warmup to 1 over `warmup` steps, then (1 - progress)^power decay to `min_ratio` at
    `total` (power 1 is linear decay).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * (1.0 - progress) ** power
