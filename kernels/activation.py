"""The feed-forward's activation in one kernel each way, straight from the input projection's output: GeGLU (a gated
feed-forward's `gelu(x) * gate`, ModernBERT's) and bias + GELU (RoBERTa's `gelu(x W^T + b)`), the exact (erf) GELU
computed in fp32 and rounded once. These kernels are bound by the instructions they issue, not by memory (an H200
moves a bf16 element in and out in the time it issues about 28 a thread): the GELU is an erfc formula without a
branch (`ERFC`; libdevice's erf selects between two polynomials a coefficient at a time), through the GPU's
approximate exp2 and reciprocal square root. `python -m fastmae.kernels.aot` counts each kernel's instructions.

    geglu:      a = [x | gate]  [N, 2I] (the projection's rows, as `chunk(2, dim=-1)` splits them)  ->  gelu(x) * gate
    bias_gelu:  a = x W^T  [N, I] (the projection without its bias), b [I]                         ->  gelu(a + b)

GeGLU's forward reads a once and writes y; its backward reads dy and a once and writes da = [dy * gate * gelu'(x) |
dy * gelu(x)] as one [N, 2I] tensor, the projection's output gradient as it is. Unfused, torch runs the GELU, the
product, the product's two gradients, the GELU's gradient and the concatenation of the halves' gradients (`chunk`'s
backward): six passes over the rows where this makes two. bias + GELU's backward writes da and, from the same
registers, each program's partial column sums of it (the bias gradient, summed in a fixed order): unfused, the
bias's gradient reads da once more. References: `geglu_reference`, `bias_gelu_reference` in reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    LOG2_E,
    ROWS_PER_BIAS_PROGRAM,
    TILED_KERNELS,
    RowTiles,
    carve_sums,
    cdiv,
    column_block,
    sum_parts,
    tile_launch,
    tiled_pair,
)
from .pending import defer_sums

# erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), for z >= 0, P's coefficients from the lowest power: Numerical
# Recipes' erfcc (Press et al., section 6.2), fractional error below 1.2e-7 everywhere. Exact GELU as libdevice's erf
# gives it (Phi's error in fp32 within 2e-6 of its value for x > -3, where torch's 0.5 (1 + erf) errs by 1.2e-5, and
# cancels to nothing below -5) in fewer instructions: bias + GELU's forward issues 31 an element where it issued 43,
# its backward 40 where 56 (kernels_static.md; sm_90).
ERFC = tl.constexpr((-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
                     1.48851587, -0.82215223, 0.17087277))


@triton.jit
def _gelu_parts(x):
    """(gelu(x), gelu'(x)) in fp32: x Phi(x) and Phi(x) + x phi(x), Phi(x) = erfc(-x / sqrt 2) / 2 by ERFC's
    formula (no branch, no cancellation where x < 0)."""
    z = tl.abs(x) * 0.7071067811865476
    root = tl.math.rsqrt(1.0 + 0.5 * z)  # t = root^2: the GPU's approximate reciprocal square root, no range checks
    t = root * root
    poly = ERFC[9]
    for k in tl.static_range(8, -1, -1):
        poly = poly * t + ERFC[k]
    half_erfc = 0.5 * t * tl.math.exp2((poly - z * z) * LOG2_E)  # erfc(|x| / sqrt 2) / 2
    cdf = tl.where(x >= 0.0, 1.0 - half_erfc, half_erfc)
    pdf = tl.math.exp2(-z * z * LOG2_E) * 0.3989422804014327
    return x * cdf, cdf + x * pdf


@triton.jit
def _tile(row_block, n_rows, n_cols, WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(offsets of the tile's input elements in a [N, WIDTH * n_cols] row-major tensor, of its outputs in [N, n_cols],
    its mask, its columns) for rows block `row_block` and columns block program_id(1)."""
    rows = row_block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return rows[:, None] * (WIDTH * n_cols) + cols[None, :], rows[:, None] * n_cols + cols[None, :], mask, cols


@triton.jit
def _geglu_fwd_kernel(A, Y, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    a_offsets, y_offsets, mask, _ = _tile(tl.program_id(0), n_rows, n_cols, 2, BLOCK_R, BLOCK_C)
    x = tl.load(A + a_offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(A + a_offsets + n_cols, mask=mask, other=0.0).to(tl.float32)
    gelu, _ = _gelu_parts(x)
    tl.store(Y + y_offsets, (gelu * gate).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _geglu_bwd_kernel(DY, A, DA, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    a_offsets, y_offsets, mask, _ = _tile(tl.program_id(0), n_rows, n_cols, 2, BLOCK_R, BLOCK_C)
    dy = tl.load(DY + y_offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(A + a_offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(A + a_offsets + n_cols, mask=mask, other=0.0).to(tl.float32)
    gelu, slope = _gelu_parts(x)
    tl.store(DA + a_offsets, (dy * gate * slope).to(DA.dtype.element_ty), mask=mask)
    tl.store(DA + a_offsets + n_cols, (dy * gelu).to(DA.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_fwd_kernel(A, B, Y, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    offsets, _, mask, cols = _tile(tl.program_id(0), n_rows, n_cols, 1, BLOCK_R, BLOCK_C)
    bias_offsets = tl.broadcast_to(cols[None, :], offsets.shape)  # loaded in the tile's own layout: no shuffle
    a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
    gelu, _ = _gelu_parts(a + tl.load(B + bias_offsets, mask=mask, other=0.0).to(tl.float32))
    tl.store(Y + offsets, gelu.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, A, B, DA, DB_PART, n_rows, n_cols, tiles, PREFETCH: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr):
    """Program (p, c): `tiles` tiles of BLOCK_R rows from row p * tiles * BLOCK_R, columns block c; its partial bias
    gradient into row p of DB_PART, accumulated per element of the tile and summed over its rows once, at the end (no
    reduction across rows, and its barrier, in the loop). PREFETCH: each step loads the next tile's dy and a before
    the maths of its own (`launch.RowTiles`)."""
    db = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    bias = tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]  # once, not once a tile
    first = tl.program_id(0) * tiles
    end = tl.minimum((first + tiles) * BLOCK_R, n_rows)  # the program's rows end here: a prefetch past it loads none
    if PREFETCH:
        dy_next, a_next = _bwd_tile(DY, A, first, end, n_cols, BLOCK_R, BLOCK_C)
    for tile in range(tiles):
        offsets, _, mask, _ = _tile(first + tile, end, n_cols, 1, BLOCK_R, BLOCK_C)
        if PREFETCH:
            dy, a = dy_next, a_next
            dy_next, a_next = _bwd_tile(DY, A, first + tile + 1, end, n_cols, BLOCK_R, BLOCK_C)
        else:
            dy, a = _bwd_tile(DY, A, first + tile, end, n_cols, BLOCK_R, BLOCK_C)  # both issued before the maths
        _, slope = _gelu_parts(a.to(tl.float32) + bias)
        da = tl.where(mask, dy.to(tl.float32) * slope, 0.0)
        tl.store(DA + offsets, da.to(DA.dtype.element_ty), mask=mask)
        db += da
    tl.store(DB_PART + tl.program_id(0).to(tl.int64) * n_cols + cols, tl.sum(db, axis=0), mask=cols < n_cols)


@triton.jit
def _bwd_tile(DY, A, row_block, end, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(dy, a) of rows block `row_block` (rows from `end` on masked), columns block program_id(1), as loaded."""
    offsets, _, mask, _ = _tile(row_block, end, n_cols, 1, BLOCK_R, BLOCK_C)
    return tl.load(DY + offsets, mask=mask, other=0.0), tl.load(A + offsets, mask=mask, other=0.0)


def launch_shape(columns: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of GeGLU's kernels for rows of `columns` outputs: `tile_launch`'s tile of a
    column block."""
    block_c = column_block(columns)
    tiles = tile_launch(block_c)
    return tiles.rows, block_c, tiles.warps


KERNELS = TILED_KERNELS  # bias + GELU's


def bias_gelu_tiles(columns: int) -> dict[str, RowTiles]:
    """bias + GELU's RowTiles (KERNELS) over its column blocks for rows of `columns` (`launch.tiled_pair`).
    `benchmarks/kernels.py --ops layers` times every BIAS_GELU_CANDIDATE on CUDA."""
    return tiled_pair(column_block(columns))


# What the GPU benchmark times beside the shipped tiles at RoBERTa's feed-forward widths (3,072 and 4,096: column blocks
# of 1,024), one kernel's tiles swapped at a time: the H200's profile had both near half its bandwidth. These hold 16
# and 32 elements a thread (forward: two and four 16-byte loads of the input a thread in flight) and 8 and 16
# (backward, the shipped tile holding 4: 8-byte loads), at the registers and residency kernels_static.md gives; and
# backward tiles that load the next tile before the maths of this one (`RowTiles.prefetch`: 40 to 42 instructions
# an element on sm_90 at the shipped tile). At f6d59b9 and at e63392c none beat the shipped tiles by more than a few
# percent, about the spread of rows that change nothing of the kernel timed.
BIAS_GELU_CANDIDATES = {
    "forward": (RowTiles(1, 4), RowTiles(4, 8), RowTiles(8, 8), RowTiles(8, 16)),
    "backward": (RowTiles(2, 8), RowTiles(4, 8), RowTiles(2, 4), RowTiles(1, 4), RowTiles(1, 8, True),
                 RowTiles(2, 8, True)),
}


def _grid(rows: int, columns: int, block_r: int, block_c: int) -> tuple[int, int]:
    return cdiv(rows, block_r), cdiv(columns, block_c)


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


class _BiasGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, bias, tiling):
        rows, columns = a.shape
        y = torch.empty_like(a)
        block_c = column_block(columns)
        block_r, warps, _ = tiling["forward"]
        if rows and columns:
            _bias_gelu_fwd_kernel[_grid(rows, columns, block_r, block_c)](a, bias, y, rows, columns, BLOCK_R=block_r,
                                                                           BLOCK_C=block_c, num_warps=warps)
        ctx.save_for_backward(a, bias)
        ctx.tiling, ctx.deferral = tiling, defer_sums(bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        a, bias = ctx.saved_tensors
        rows, columns = a.shape
        block_c = column_block(columns)
        block_r, warps, prefetch = ctx.tiling["backward"]
        tiles = max(1, ROWS_PER_BIAS_PROGRAM // block_r)
        programs = cdiv(rows, tiles * block_r)
        (da,), dbias, parts = carve_sums(a.device, (((rows, columns), a.dtype),), ((1, columns), bias.dtype),
                                         ((1, programs, columns), torch.float32), ctx.deferral)
        if rows and columns:
            _bias_gelu_bwd_kernel[(programs, cdiv(columns, block_c))](
                dy.contiguous(), a, bias, da, parts, rows, columns, tiles, PREFETCH=prefetch, BLOCK_R=block_r,
                BLOCK_C=block_c, num_warps=warps)
        sum_parts(parts, dbias, ctx.deferral)  # the partials in a fixed order: deterministic
        return da, dbias[0], None


def bias_gelu(a: torch.Tensor, bias: torch.Tensor, tiling: dict[str, RowTiles] | None = None) -> torch.Tensor:
    """gelu(a + bias) for rows a [N, I] (contiguous; exact GELU) and bias [I]: [N, I] in a's dtype. Differentiable in a
    and bias. `tiling`: the kernels' launches (default `bias_gelu_tiles(I)`; the benchmark swaps in
    BIAS_GELU_CANDIDATES)."""
    if a.dim() != 2 or not a.is_contiguous() or bias.shape != (a.shape[1],):
        raise ValueError(f"bias_gelu: a must be contiguous rows [N, I] and bias [I]; got {tuple(a.shape)} (strides "
                         f"{a.stride()}) and {tuple(bias.shape)}")
    return _BiasGELU.apply(a, bias, tiling or bias_gelu_tiles(a.shape[1]))


def geglu(a: torch.Tensor) -> torch.Tensor:
    """gelu(x) * gate for rows a = [x | gate] [N, 2I] (contiguous; exact GELU): [N, I] in a's dtype. Differentiable
    in a."""
    if a.dim() != 2 or a.shape[1] % 2 or not a.is_contiguous():
        raise ValueError(f"geglu: a must be contiguous rows [N, 2I]; got shape {tuple(a.shape)}, strides {a.stride()}")
    return _GeGLU.apply(a)
