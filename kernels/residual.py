"""The residual stream's gradient handed from a norm's backward to the projection that reads the same rows, so that
the projection's input-gradient GEMM adds it (`addmm`, beta 1) instead of autograd adding the two afterwards.

In a post-LN layer the sublayer's input x feeds two ops: the projection at the sublayer's start (the QKV projection,
the feed-forward's input projection) and, as the residual, the norm at its end. Autograd sums their gradients of x with
an add over all rows (two a layer). Here the projection, running first, `claim`s the handoff; the norm then returns
no gradient for its residual and `put`s it here instead; the projection's backward, which always runs after the
norm's (it needs the sublayer's gradient, which passes through the norm), `take`s it into its GEMM, which adds into
the handed tensor in place (the norm made it for the handoff alone). A handoff nobody claimed is never used: the norm
then returns its residual's gradient as usual. No Triton here.
"""

from __future__ import annotations

import torch


class ResidualGrad:
    """One handoff of a residual's gradient (see the module's docstring)."""

    def __init__(self):
        self.claimed = False
        self._grad: torch.Tensor | None = None

    def claim(self) -> None:
        """Called by the projection's forward: its backward will add the gradient."""
        self.claimed = True

    def put(self, grad: torch.Tensor) -> None:
        """Called by the norm's backward with the residual's gradient."""
        self._grad = grad

    def take(self) -> torch.Tensor | None:
        """The gradient put here (None if none was), released."""
        grad, self._grad = self._grad, None
        return grad
