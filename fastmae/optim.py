"""Optimizer parameter groups and the learning-rate schedule (fairseq's polynomial decay with linear warm-up)."""

from __future__ import annotations

from torch import nn


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
