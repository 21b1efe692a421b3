"""GeGLU in one kernel, forward and backward: a gated feed-forward's `gelu(x) * gate` (ModernBERT's), straight from
the input projection's output.

    a = [x | gate]  [N, 2I] (the projection's rows, as `chunk(2, dim=-1)` splits them)      y = gelu(x) * gate  [N, I]

with the exact (erf) GELU, computed in fp32 and rounded once. Forward reads a once and writes y; backward reads dy
and a once and writes da = [dy * gate * gelu'(x) | dy * gelu(x)] as one [N, 2I] tensor, the projection's output
gradient as it is. Unfused, torch runs the GELU, the product, the product's two gradients, the GELU's gradient and
the concatenation of the halves' gradients (`chunk`'s backward): six passes over the rows where this makes two.
Reference: `geglu_reference` in reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rows import tile_launch

COLUMNS_PER_PROGRAM = 1024  # a program's block of the I columns (at most): wide rows take several programs


@triton.jit
def _gelu_parts(x):
    """(gelu(x), gelu'(x)) in fp32: x Phi(x) and Phi(x) + x phi(x)."""
    cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return x * cdf, cdf + x * pdf


@triton.jit
def _tile(n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(offsets of the tile's x elements in a [N, 2 n_cols] row-major tensor, of its y elements in [N, n_cols], its
    mask)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None] * (2 * n_cols) + cols[None, :], rows[:, None] * n_cols + cols[None, :], mask


@triton.jit
def _geglu_fwd_kernel(A, Y, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    a_offsets, y_offsets, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    x = tl.load(A + a_offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(A + a_offsets + n_cols, mask=mask, other=0.0).to(tl.float32)
    gelu, _ = _gelu_parts(x)
    tl.store(Y + y_offsets, (gelu * gate).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_bwd_kernel(DY, A, DA, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    a_offsets, y_offsets, mask = _tile(n_rows, n_cols, BLOCK_R, BLOCK_C)
    dy = tl.load(DY + y_offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(A + a_offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(A + a_offsets + n_cols, mask=mask, other=0.0).to(tl.float32)
    gelu, slope = _gelu_parts(x)
    tl.store(DA + a_offsets, (dy * gate * slope).to(DA.dtype.element_ty), mask=mask)
    tl.store(DA + a_offsets + n_cols, (dy * gelu).to(DA.dtype.element_ty), mask=mask)


def launch_shape(columns: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) for rows of `columns` outputs: `tile_launch`'s tile of a column block."""
    block_c = min(triton.next_power_of_2(columns), COLUMNS_PER_PROGRAM)
    block_r, warps = tile_launch(block_c)
    return block_r, block_c, warps


def _grid(rows: int, columns: int, block_r: int, block_c: int) -> tuple[int, int]:
    return triton.cdiv(rows, block_r), triton.cdiv(columns, block_c)


class _GeGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        rows, columns = a.shape[0], a.shape[1] // 2
        y = torch.empty(rows, columns, device=a.device, dtype=a.dtype)
        block_r, block_c, warps = launch_shape(columns)
        if rows and columns:
            _geglu_fwd_kernel[_grid(rows, columns, block_r, block_c)](a, y, rows, columns, BLOCK_R=block_r,
                                                                       BLOCK_C=block_c, num_warps=warps)
        ctx.save_for_backward(a)
        return y

    @staticmethod
    def backward(ctx, dy):
        (a,) = ctx.saved_tensors
        rows, columns = a.shape[0], a.shape[1] // 2
        da = torch.empty_like(a)
        block_r, block_c, warps = launch_shape(columns)
        if rows and columns:
            _geglu_bwd_kernel[_grid(rows, columns, block_r, block_c)](dy.contiguous(), a, da, rows, columns,
                                                                       BLOCK_R=block_r, BLOCK_C=block_c,
                                                                       num_warps=warps)
        return da


def geglu(a: torch.Tensor) -> torch.Tensor:
    """gelu(x) * gate for rows a = [x | gate] [N, 2I] (contiguous; exact GELU): [N, I] in a's dtype. Differentiable
    in a."""
    if a.dim() != 2 or a.shape[1] % 2 or not a.is_contiguous():
        raise ValueError(f"geglu: a must be contiguous rows [N, 2I]; got shape {tuple(a.shape)}, strides {a.stride()}")
    return _GeGLU.apply(a)
