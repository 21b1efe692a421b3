"""Varlen row scatter: the insertion that puts masked slots back between the visible rows (DESIGN.md section 3.2)."""

from __future__ import annotations

import torch


def insert_rows_reference(visible: torch.Tensor, visible_index: torch.Tensor, removed_index: torch.Tensor,
                          fill: torch.Tensor) -> torch.Tensor:
    """Full-length stream from the visible rows and one fill row (plain torch).

    visible: [T_v, H] states of the visible rows. visible_index: [T_v] int32, their rows in the full stream.
    removed_index: [T_r] int32, the other rows (T_v + T_r = T, the two sets disjoint). fill: [H], the row placed at
    every removed row (the <mask> embedding). Returns [T, H] in visible's dtype. Gradients flow to `visible`
    (gathered at visible_index) and to `fill` (summed over removed rows).
    """
    total = visible.shape[0] + removed_index.shape[0]
    out = visible.new_empty(total, visible.shape[1])
    out = out.index_copy(0, visible_index.long(), visible)
    return out.index_copy(0, removed_index.long(), fill.to(visible.dtype).expand(removed_index.shape[0], -1))
