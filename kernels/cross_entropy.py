"""Masked-row linear cross-entropy: the tied LM projection and the loss (DESIGN.md section 3.3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                   labels: torch.Tensor, ignore_index: int = -100,
                                   label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of `x @ weight.T + bias` against `labels` (plain torch; materialises the logits).

    x: [N, H] (masked rows only). weight: [V, H] (the tied token embeddings). bias: [V] or None.
    labels: [N] integer ids, `ignore_index` rows skipped. Logits are computed in x's dtype and the loss in fp32.
    Returns a scalar fp32 tensor (0 with no rows, not NaN).
    """
    if x.shape[0] == 0:
        return (x.sum() + weight.sum() * 0).float()  # keeps the graph, so backward still reaches the weights
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(logits.float(), labels.long(), ignore_index=ignore_index, label_smoothing=label_smoothing)
