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


def select_masked(tokens: torch.Tensor, *args, **kwargs) -> kernels.MaskSelection:
    """See fastmae.kernels.select_masked_reference."""
    impl = kernels.select_masked if use_triton(tokens) else kernels.select_masked_reference
    return impl(tokens, *args, **kwargs)


def embed_rows(table: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """See fastmae.kernels.embed_rows."""
    impl = kernels.embed_rows if use_triton(table) else kernels.embed_rows_reference
    return impl(table, *args, **kwargs)


def insert_rows(visible: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """See fastmae.kernels.insert_rows."""
    impl = kernels.insert_rows if use_triton(visible) else kernels.insert_rows_reference
    return impl(visible, *args, **kwargs)


def linear_cross_entropy(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """See fastmae.kernels.linear_cross_entropy."""
    impl = kernels.linear_cross_entropy if use_triton(x) else kernels.linear_cross_entropy_reference
    return impl(x, *args, **kwargs)
