"""The one place that picks an implementation for each fastmae.kernels op the model calls.

CUDA tensors use the Triton kernels, CPU tensors the plain-torch references. FASTMAE_KERNELS forces one side:
`triton` (on CPU that needs TRITON_INTERPRET=1 set before fastmae is imported) or `torch`; `auto` is the default.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import kernels
from .dropout import dropout

KERNEL_MODES = ("auto", "triton", "torch")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether ops on `tensor` go to the Triton kernels."""
    mode = os.environ.get("FASTMAE_KERNELS", "auto")
    if mode not in KERNEL_MODES:
        raise ValueError(f"FASTMAE_KERNELS={mode!r}: choose one of {KERNEL_MODES}")
    return mode == "triton" or (mode == "auto" and tensor.is_cuda)


def _dispatch(name: str):
    """An op that runs the Triton kernel `name` when its first tensor argument goes to Triton, else
    `name_reference` (same signature). The kernel is looked up at call time: Triton is imported only when used.
    Traced by train.compile (the layers), the reference: inductor fuses its pointwise passes itself."""
    reference = getattr(kernels, f"{name}_reference")

    def op(first: torch.Tensor, *args, **kwargs):
        triton = use_triton(first) and not torch.compiler.is_compiling()
        return (getattr(kernels, name) if triton else reference)(first, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = f"fastmae.kernels.{name} (Triton) or {reference.__name__} (torch); see their docstrings."
    return op


select_masked = _dispatch("select_masked")
embed_rows = _dispatch("embed_rows")
insert_rows = _dispatch("insert_rows")
linear_cross_entropy = _dispatch("linear_cross_entropy")
rotary_qk = _dispatch("rotary_qk")  # q and k rotated by their rows' rotary tables
geglu = _dispatch("geglu")  # a gated feed-forward's gelu(x) * gate from the rows [x | gate]


def dropout_keys(x: torch.Tensor, count: int, dropout_p: float) -> torch.Tensor | None:
    """[count] int64 keys for `add_layer_norm`'s hashed dropout on rows like `x`, drawn in one op from torch's
    generator of x's device (so seeds, saved RNG states and CUDA graphs reproduce them): a stack of layers draws once
    instead of once a norm. None where no norm hashes its dropout (p = 0, torch's references, compiled graphs)."""
    if not dropout_p or not use_triton(x) or torch.compiler.is_compiling():
        return None
    return torch.randint(0, 2**32, (count,), dtype=torch.int64, device=x.device)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float = 1e-5, keep_sum: bool = False, dropout_p: float = 0.0,
                   projection: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                   residual_grad: kernels.ResidualGrad | None = None,
                   key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's norm(dropout(x') + residual), x' = x or, with `projection` (weight, bias), x W^T + b, and the sum
    where it is kept: one Triton kernel where `x` goes to Triton, its dropout hashed under `key` (one of
    `dropout_keys`; without one, a key drawn here from torch's generator of x's device), the projection's bias added
    and its gradient summed in it (the projection itself without its bias: no separate bias-gradient sum), and the
    residual's gradient handed to the projection that claimed `residual_grad`; else fastmae's `dropout` (cheap on
    CPU, fused by inductor when compiled) and the torch reference after torch's linear."""
    triton = use_triton(x) and not torch.compiler.is_compiling()
    x_bias = None
    if projection is not None:
        p_weight, p_bias = projection
        x_bias = p_bias if triton else None
        # the Triton path's projection without its bias (the norm's kernel adds it): fastmae's, whose weight
        # gradient goes in place into a flat gradient (kernels/pending.py)
        x = kernels.project(x, p_weight) if triton else F.linear(x, p_weight, p_bias)
    if triton:
        if dropout_p and key is None:
            key = dropout_keys(x, 1, dropout_p)
        return kernels.add_layer_norm(x, residual, weight, bias, eps, keep_sum, dropout_p, key, x_bias=x_bias,
                                      residual_grad=residual_grad)
    return kernels.add_layer_norm_reference(dropout(x, dropout_p), residual, weight, bias, eps, keep_sum)


def layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """`norm`(x) for rows x: `kernels.layer_norm` (add_layer_norm's kernels without a residual) where `x` goes to
    Triton in the norm's dtype, else the module itself (and under autocast, where it runs in fp32)."""
    if x.dim() == 2 and x.dtype == norm.weight.dtype and _fused_projection(x):
        return kernels.layer_norm(x, norm.weight, norm.bias, norm.eps)
    return norm(x)


def project_qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int,
                residual_grad: kernels.ResidualGrad | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of `heads` heads each from the rows x and the attention's input projection, q and k rotated by the
    rows' `rotary` tables (cos, sin) where given: where `x` goes to Triton and the projection has a bias or a
    rotary, torch's GEMM forward (the rotation in one kernel) and a backward that gathers the three gradients,
    rotates q's and k's back and sums the bias's in one kernel (`kernels.project_qkv`), its input-gradient GEMM adding
    the residual's gradient where it claims `residual_grad`; else, and under autocast, torch's linear split in three,
    then `rotary_qk`."""
    if (bias is not None or rotary is not None) and _fused_projection(x):
        return kernels.project_qkv(x, weight, bias, heads, residual_grad, rotary)
    q, k, v = kernels.project_qkv_reference(x, weight, bias, heads)
    return (q, k, v) if rotary is None else (*rotary_qk(q, k, *rotary, *rotary), v)


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """`layer`(x): where `x` goes to Triton and the layer has no bias, fastmae's projection (`kernels.project`, whose
    weight gradient goes in place into a flat gradient, kernels/pending.py); else the module (torch's linear, its
    bias added in the GEMM)."""
    if layer.bias is None and _fused_projection(x):
        return kernels.project(x, layer.weight)
    return layer(x)


def _fused_projection(x: torch.Tensor) -> bool:
    """Whether a projection of `x` takes fastmae's autograd functions (kernels/projection.py)."""
    return use_triton(x) and not torch.compiler.is_compiling() and not torch.is_autocast_enabled(x.device.type)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual_grad: kernels.ResidualGrad | None = None) -> torch.Tensor:
    """gelu(x W^T + b), a feed-forward's input projection and activation: where `x` goes to Triton, the projection
    without its bias (`kernels.project`, its input-gradient GEMM adding the residual's gradient where it claims
    `residual_grad`) and the bias + GELU in one kernel each way (`kernels.bias_gelu`: the bias gradient summed with
    the GELU's); else, and under autocast (where the bias's dtype and the projection's differ), torch's linear and
    GELU."""
    if bias is not None and _fused_projection(x):
        return kernels.bias_gelu(kernels.project(x, weight, residual_grad), bias)
    return F.gelu(F.linear(x, weight, bias))
