"""Dropout that is cheap on CPU too.

torch's CPU dropout draws one Mersenne-twister number per element through `bernoulli_`: ~9 ns per element on a
2-core machine, more than the attention matmuls around it (benchmarks/results/attention.md). Here one 64-bit draw
gives four 16-bit numbers, each compared with round(p * 2^16): ~1.2 ns per element, drop probability p to within
2^-17, and the survivors are scaled by the exact 1 / (1 - p_used) so the expectation is unchanged. The draws come
from torch's global CPU generator, so torch.manual_seed and saved RNG states reproduce them. CUDA keeps F.dropout
(its Philox draws are fused and cheap), and so do compiled graphs (train.compile), where inductor fuses the draws.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_LEVELS = 1 << 16  # 16-bit draws


def _check_probability(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")


def drop_mask(shape: tuple[int, ...], p: float, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """(bool tensor of `shape` on `device`, True where an element is dropped; the scale 1 / (1 - p_used) of the
    survivors), where p_used = round(p * 2^16) / 2^16 is the drop probability."""
    _check_probability(p)
    threshold = round(p * _LEVELS)
    scale = 1.0 / (1.0 - threshold / _LEVELS)
    if torch.device(device).type != "cpu" or torch.compiler.is_compiling():
        return torch.rand(shape, device=device) < threshold / _LEVELS, scale
    count = math.prod(shape)
    # random_() alone stops at 2^63 - 1 (the top 16 bits would never be negative): ask for the whole int64 range
    words = torch.empty((count + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1)
    draws = words.view(torch.int16)[:count].view(shape)
    return draws < threshold - _LEVELS // 2, scale


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Zero elements of `x` with probability p and scale the rest by 1 / (1 - p); identity when not training."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return F.dropout(x, p, training=True)
    dropped, scale = drop_mask(tuple(x.shape), p)
    return x.masked_fill(dropped, 0.0) * scale


class Dropout(nn.Module):
    """nn.Dropout with fastmae's `dropout` (fast on CPU)."""

    def __init__(self, p: float):
        super().__init__()
        _check_probability(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
