"""Analytical training FLOPs of a masked batch (forward + backward = 3x forward), for MFU and compute budgets.

Per layer and token: the projections and feed-forward 2 * (4 H^2 + 2 H I); attention 4 H per key of the token's
sequence (QK^T and AV). The head (dense + tied projection) runs on predicted rows only. Embedding lookups, norms
and softmaxes are ignored, as usual.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def layer_flops(config: ModelConfig, tokens: int, sum_sq_lengths: int) -> int:
    """Forward FLOPs of one layer over `tokens` rows whose sequences have squared lengths summing to sum_sq_lengths."""
    h, i = config.hidden_size, config.intermediate_size
    return 2 * tokens * (4 * h * h + 2 * h * i) + 4 * h * sum_sq_lengths


def head_flops(config: ModelConfig, predicted: int) -> int:
    h = config.hidden_size
    return 2 * predicted * (h * h + h * config.vocab_size)


def training_flops(config: ModelConfig, seqlens: torch.Tensor, visible_seqlens: torch.Tensor,
                   num_predicted: int) -> int:
    """Forward + backward FLOPs of one batch: layers [0, k) on the visible rows, the rest on full rows (the cross
    decoder is counted as full-width), the head on predicted rows. Host tensors in, no device sync."""
    k, total = config.insert_layer, config.num_layers
    full = layer_flops(config, int(seqlens.sum()), int((seqlens.long() ** 2).sum()))
    visible = layer_flops(config, int(visible_seqlens.sum()), int((visible_seqlens.long() ** 2).sum()))
    return 3 * (k * visible + (total - k) * full + head_flops(config, num_predicted))
