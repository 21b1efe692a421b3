"""The one place that picks an implementation for each fastmae.kernels op the model calls.

CUDA tensors use the Triton kernels, CPU tensors the plain-torch references. FASTMAE_KERNELS forces one side:
`triton` (on CPU that needs TRITON_INTERPRET=1 set before fastmae is imported) or `torch`; `auto` is the default.
"""

from __future__ import annotations

import os

import torch

from . import kernels

KERNEL_MODES = ("auto", "triton", "torch")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether ops on `tensor` go to the Triton kernels."""
    mode = os.environ.get("FASTMAE_KERNELS", "auto")
    if mode not in KERNEL_MODES:
        raise ValueError(f"FASTMAE_KERNELS={mode!r}: choose one of {KERNEL_MODES}")
    return mode == "triton" or (mode == "auto" and tensor.is_cuda)


def _dispatch(kernel, reference):
    """An op that runs `kernel` when its first tensor argument goes to Triton, else `reference` (same signature)."""

    def op(first: torch.Tensor, *args, **kwargs):
        return (kernel if use_triton(first) else reference)(first, *args, **kwargs)

    op.__name__ = kernel.__name__
    op.__doc__ = f"fastmae.kernels.{kernel.__name__} (Triton) or {reference.__name__} (torch); see their docstrings."
    return op


select_masked = _dispatch(kernels.select_masked, kernels.select_masked_reference)
embed_rows = _dispatch(kernels.embed_rows, kernels.embed_rows_reference)
insert_rows = _dispatch(kernels.insert_rows, kernels.insert_rows_reference)
linear_cross_entropy = _dispatch(kernels.linear_cross_entropy, kernels.linear_cross_entropy_reference)
