"""Analytical training FLOPs of a masked batch (forward + backward = 3x forward), for MFU and compute budgets.

Per layer: the projections and feed-forward 2 * (4 H^2 + 2 H I) per row; attention 4 H per (query, key) pair of a
sequence (QK^T and AV). Layers [0, k) run on the visible rows, [k, L + d) on all rows; a `cross` decoder layer runs
its query, output and feed-forward projections on the predicted rows only, its key/value projections on all rows,
and attends from each predicted row to its whole sequence. The head (dense + tied projection) runs on predicted rows
only. Embedding lookups, norms, softmaxes and the loss are ignored, as usual; `tests/test_flops.py` checks the count
against torch's FlopCounterMode.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def layer_flops(config: ModelConfig, tokens: int, sum_sq_lengths: int) -> int:
    """Forward FLOPs of one self-attention layer over `tokens` rows whose sequences have squared lengths summing to
    sum_sq_lengths."""
    h, i = config.hidden_size, config.intermediate_size
    return 2 * tokens * (4 * h * h + 2 * h * i) + 4 * h * sum_sq_lengths


def cross_layer_flops(config: ModelConfig, tokens: int, queries: int, query_key_pairs: int) -> int:
    """Forward FLOPs of one `cross` decoder layer: `queries` predicted rows attending to their sequences' rows."""
    h, i = config.hidden_size, config.intermediate_size
    return 2 * queries * (2 * h * h + 2 * h * i) + 2 * tokens * 2 * h * h + 4 * h * query_key_pairs


def head_flops(config: ModelConfig, predicted: int) -> int:
    h = config.hidden_size
    return 2 * predicted * (h * h + h * config.vocab_size)


def training_flops(config: ModelConfig, seqlens: torch.Tensor, visible_seqlens: torch.Tensor,
                   predicted_seqlens: torch.Tensor) -> int:
    """Forward + backward FLOPs of one batch from its host counts ([B] int tensors: tokens, visible tokens and
    predicted tokens of each sequence). No device sync."""
    seqlens, visible_seqlens, predicted_seqlens = seqlens.long(), visible_seqlens.long(), predicted_seqlens.long()
    k, n_enc, n_dec = config.insert_layer, config.encoder_layers, config.decoder_layers
    tokens, predicted = int(seqlens.sum()), int(predicted_seqlens.sum())
    full = layer_flops(config, tokens, int((seqlens**2).sum()))
    visible = layer_flops(config, int(visible_seqlens.sum()), int((visible_seqlens**2).sum()))
    if config.decoder_kind == "cross":
        decoder = cross_layer_flops(config, tokens, predicted, int((predicted_seqlens * seqlens).sum()))
    else:
        decoder = full
    return 3 * (k * visible + (n_enc - k) * full + n_dec * decoder + head_flops(config, predicted))
