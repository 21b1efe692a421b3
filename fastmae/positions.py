"""Positions in attention that survive dropped rows: rotary tables and MAE-LM's relative position bias, both looked up
with each row's original position id (ARCHITECTURE.md section 4)."""

from __future__ import annotations

import math

import torch

from .kernels import apply_rotary_reference


# ---------------------------------------------------------------------------------------------------- rotary
def rotary_inverse_frequencies(head_dim: int, base: float, device=None) -> torch.Tensor:
    """[head_dim / 2] fp32: the angle per position of each rotated feature pair."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def rotary_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim / 2] (fp32) of each row's original position id."""
    inv_freq = rotary_inverse_frequencies(head_dim, base, positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


apply_rotary = apply_rotary_reference  # one row's rotation; the layers rotate q and k at once (ops.rotary_qk)


# ------------------------------------------------------------------------------------ relative position bias
def relative_position_buckets(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """MAE-LM's buckets of `relative` = key position - query position (its fairseq `relative_position_bucket`, shifted
    to start at 0 as the reference does): distances below num_buckets / 4 get a bucket each, longer ones
    log-spaced buckets (rounded up) up to max_distance - 1, beyond which all share the last one; the sign picks the
    side, so distance 0 is the middle bucket num_buckets / 2 - 1 and the table's last row is never read.

    A T5 variant: T5 rounds down, spaces up to max_distance and gives each direction num_buckets / 2 buckets of
    its own (0 included); the reference's exact scheme is kept so that its recipes mean the same here."""
    half = num_buckets // 2
    exact = half // 2
    distance = relative.abs()
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log((max_distance - 1) / exact)
    far = (exact + torch.ceil(log_ratio * (half - 1 - exact)).long()).clamp(max=half - 1)
    return torch.where(distance < exact, distance, far) * relative.sign() + (half - 1)


def window_by_distance(half_window: int, heads: int, device=None) -> torch.Tensor:
    """[2 * (half_window + 1) + 1, heads] fp32: a local window as a relative position bias (0 for distances within
    half_window, -inf beyond: looked up with the distance clamped to the table's ends, every farther key gets -inf).
    Built from original positions like any such bias, so a shortened stream keeps the window of the full one."""
    far = half_window + 1
    distances = torch.arange(-far, far + 1, device=device)
    inside = torch.zeros((), device=device).expand(distances.shape[0], heads)
    return torch.where((distances.abs() <= half_window)[:, None], inside, -math.inf).float()


def relative_bias_by_distance(table: torch.Tensor, max_distance: int) -> torch.Tensor:
    """[2 * max_distance + 1, heads] fp32: the bias of every relative position in [-max_distance, max_distance]
    (farther ones share the end buckets), gathered from `table` [num_buckets, heads] once per forward pass, so that
    the gradients of every lookup reach the table. In fp32 whatever the table's dtype: a bucket's gradient sums one
    term per query-key pair and head, millions per step, which bf16 accumulation would drown (tested)."""
    distances = torch.arange(-max_distance, max_distance + 1, device=table.device)
    return table.float()[relative_position_buckets(distances, table.shape[0], max_distance)]
