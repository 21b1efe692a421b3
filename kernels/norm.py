"""Dropout + residual add + LayerNorm in one kernel, forward and backward: a transformer layer's
`norm(dropout(sublayer) + x)`.

    h = dropout(x) + residual  (each rounded to x's dtype, as torch gives them)      y = LayerNorm(h) * weight + bias

A program holds whole rows, each as `row_chunks` blocks of lanes: RoBERTa-base's 768 as three of 256, not one of
1,024 with a quarter masked, for these kernels are bound by the instructions they issue, not by memory
(`python -m fastmae.kernels.aot` counts them: post-LN at 768 in bf16, the forward issues 40 an element where the
masked block issued 72, the backward 68 where 100).

Forward reads x and residual once and writes y (and h, where the caller keeps the residual stream: pre-LN layers),
with each row's mean and 1 / std in fp32. Backward reads dy (and dh, h's own gradient) once, reads h where the
forward kept it (x and the residual need not stay alive for it) or recomputes it from x and residual, and writes
dh_total = dLayerNorm(dy) + dh as the residual's gradient and, through the dropout, as x's (two tensors); the
weight's and bias's gradients are per-program partial sums (at most BACKWARD_PROGRAMS), summed by a
second kernel in a fixed order (no float atomics: deterministic). Each direction's buffers are one allocation
(`launch.carve`). The dropout is hashed (`hashing.hashed_keep`): element (r, c) is dropped where the top 31 bits of its
counter's hash under a 32-bit key are below round(p * 2^31), so the backward draws the same bits again from the key
alone, no mask stored (the keys come from torch's generator of the device, drawn for a whole stack of layers in
one op, `fastmae.ops.dropout_keys`: seeds, checkpoints and CUDA graphs reproduce them). Unfused, torch runs the
dropout forward and backward, the add, the LayerNorm, its input gradient and its weight gradient (`GammaBetaBackward`,
6.9 ms of a RoBERTa-base mlm step on an H100 at 128 x 512 tokens) as six passes over the rows. Reference:
`add_layer_norm_reference` in reference.py. `layer_norm` runs the same kernels without a residual (the LM head's
norm: torch's forward and its two backward kernels, `GammaBetaBackward` the larger).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .hashing import check_dropout_key, dropout_threshold
from .launch import MAX_HIDDEN, TILED_KERNELS, RowTiles, carve, carve_sums, cdiv, next_power_of_2, sum_parts, tiled_pair
from .mask_select import dropout_kept
from .pending import defer_sums
from .residual import ResidualGrad


@triton.jit
def _kept(rows, cols, H, KEY, threshold):
    """bool [BLOCK_R, BLOCK_H]: the elements the hashed dropout keeps (`hashing.hashed_keep`)."""
    return dropout_kept(rows.to(tl.uint32)[:, None] * H + cols[None, :], KEY, threshold)  # in 32-bit ops


@triton.jit
def _summed(x, res, x_bias, kept, scale, HAS_XBIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    """fp32 h = dropout(x + x_bias) + res of loaded rows x and res (x kept where `kept`; x_bias: fp32 [1, BLOCK_H],
    loaded once by the caller), the dropout's output and the sum each rounded to x's dtype (what torch stores; x +
    x_bias stays fp32, a rounding fewer than torch's projection with its bias)."""
    dtype = x.dtype
    if HAS_XBIAS:
        x = x.to(tl.float32) + x_bias
    if HAS_DROPOUT:
        x = tl.where(kept, (x.to(tl.float32) * scale).to(dtype), 0.0)
    return (x.to(tl.float32) + res.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _summed_rows(X, x_bias, R, rows, stride_x, stride_r, cols, mask, kept, scale, HAS_XBIAS: tl.constexpr,
                 HAS_DROPOUT: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """fp32 h [BLOCK_R, BLOCK_H] of `rows`: `_summed` of x and the residual as loaded here (zeros without one)."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    else:
        res = tl.zeros_like(x)
    return _summed(x, res, x_bias, kept, scale, HAS_XBIAS, HAS_DROPOUT)


@triton.jit
def _chunk(c, rows, n_rows, H, BLOCK_H: tl.constexpr):
    """(columns, mask, offsets in a [N, H] tensor) of chunk c of the rows: BLOCK_H lanes from column c * BLOCK_H."""
    cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols[None, :] < H)
    return cols, mask, rows[:, None] * H + cols[None, :]


@triton.jit
def _add_norm_fwd_kernel(X, XB, R, W, B, Y, H_OUT, MEAN, RSTD, KEY, n_rows, H, stride_x, stride_r, eps, threshold,
                         scale, HAS_XBIAS: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_SUM: tl.constexpr,
                         HAS_DROPOUT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr):
    """Program p: rows p * BLOCK_R on, each as CHUNKS chunks of BLOCK_H lanes (`row_chunks`), all held at once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_rows = rows < n_rows
    hs = ()  # each chunk's h, held for the statistics and the output
    total = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        cols, mask, offsets = _chunk(c, rows, n_rows, H, BLOCK_H)
        kept = _kept(rows, cols, H, KEY, threshold) if HAS_DROPOUT else mask
        x_bias = tl.load(XB + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :] if HAS_XBIAS else 0.0
        h = _summed_rows(X, x_bias, R, rows, stride_x, stride_r, cols, mask, kept, scale, HAS_XBIAS, HAS_DROPOUT,
                         HAS_RESIDUAL)
        if STORE_SUM:
            tl.store(H_OUT + offsets, h.to(H_OUT.dtype.element_ty), mask=mask)
        hs = hs + (h,)
        total += h
    mean = tl.sum(total, axis=1) / H
    squares = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        _, mask, _ = _chunk(c, rows, n_rows, H, BLOCK_H)
        centred = tl.where(mask, hs[c] - mean[:, None], 0.0)
        squares += centred * centred
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=1) / H + eps)
    for c in tl.static_range(CHUNKS):
        cols, mask, offsets = _chunk(c, rows, n_rows, H, BLOCK_H)
        y = (hs[c] - mean[:, None]) * rstd[:, None] * tl.load(W + cols, mask=cols < H, other=0.0).to(
            tl.float32)[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=in_rows)
    tl.store(RSTD + rows, rstd, mask=in_rows)


@triton.jit
def _tile_rows(DY, X, R, MEAN, RSTD, first, end, H, stride_x, stride_r, FROM_SUM: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr):
    """What a backward tile of rows first .. first + BLOCK_R - 1 reads, as loaded (rows from `end` on masked): (its
    rows' mean and rstd, and for each chunk dy, x (or the forward's h where FROM_SUM) and the residual's rows)."""
    rows = first + tl.arange(0, BLOCK_R)
    mean = tl.load(MEAN + rows, mask=rows < end, other=0.0)
    rstd = tl.load(RSTD + rows, mask=rows < end, other=0.0)
    dys, xs, res = (), (), ()
    for c in tl.static_range(CHUNKS):
        cols, mask, offsets = _chunk(c, rows, end, H, BLOCK_H)
        dys = dys + (tl.load(DY + offsets, mask=mask, other=0.0),)
        xs = xs + (tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0),)
        if not FROM_SUM:  # the residual's rows (FROM_SUM: h holds them already, read as x)
            res = res + (tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0),)
    return mean, rstd, dys, xs, res


@triton.jit
def _add_norm_bwd_kernel(DY, DH, X, XB, R, W, MEAN, RSTD, KEY, DX, DR, PARTS, n_rows, tiles, programs, H,
                         stride_x, stride_r, threshold, scale, HAS_DH: tl.constexpr, HAS_XBIAS: tl.constexpr,
                         HAS_DROPOUT: tl.constexpr, FROM_SUM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, CHUNKS: tl.constexpr):
    """Program p: `tiles` tiles of BLOCK_R rows (each as CHUNKS chunks of BLOCK_H lanes), from row p * tiles *
    BLOCK_R; its partial weight and bias gradients (and x_bias's) into row p of PARTS [2 or 3, programs, H]. The
    partials accumulate per element of the tile and are summed over its rows once, at the end: no reduction across the
    tile's rows (and its barrier) in the loop. FROM_SUM: X holds the forward's h (rounded as `_summed` rounds it),
    read in place of x and the residual. Without HAS_RESIDUAL no residual's gradient is written (and X is x, which
    is h: FROM_SUM)."""
    pid = tl.program_id(0).to(tl.int64)
    first = pid * tiles * BLOCK_R
    end = tl.minimum(first + tiles * BLOCK_R, n_rows)  # the program's rows end here
    dw, db, dxb = (), (), ()  # a tile of each partial for each chunk
    for c in tl.static_range(CHUNKS):
        zeros = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        dw, db, dxb = dw + (zeros,), db + (zeros,), dxb + (zeros,)
    for tile in range(tiles):
        rows = first + tile * BLOCK_R + tl.arange(0, BLOCK_R)
        mean, rstd, dys, xs, res = _tile_rows(DY, X, R, MEAN, RSTD, first + tile * BLOCK_R, end, H, stride_x,
                                              stride_r, FROM_SUM, BLOCK_R, BLOCK_H, CHUNKS)
        mean, rstd = mean[:, None], rstd[:, None]
        hhats, wdys, kepts = (), (), ()
        c1 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        c2 = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        new_dw, new_db = (), ()
        for c in tl.static_range(CHUNKS):
            cols, mask, offsets = _chunk(c, rows, n_rows, H, BLOCK_H)
            # the weight and x_bias read again each tile (from cache) rather than held: registers for warps resident
            w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
            x_bias = tl.load(XB + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :] if HAS_XBIAS else 0.0
            dy = dys[c].to(tl.float32)
            kept = _kept(rows, cols, H, KEY, threshold) if HAS_DROPOUT else mask  # hashed once, used twice
            if FROM_SUM:
                h = xs[c].to(tl.float32)
            else:
                h = _summed(xs[c], res[c], x_bias, kept, scale, HAS_XBIAS, HAS_DROPOUT)
            hhat = tl.where(mask, (h - mean) * rstd, 0.0)
            wdy = w * dy
            c1 += hhat * wdy
            c2 += wdy
            # the weight's and bias's partials now: dy need not stay live for the second pass
            new_dw, new_db = new_dw + (dw[c] + dy * hhat,), new_db + (db[c] + dy,)
            hhats, wdys, kepts = hhats + (hhat,), wdys + (wdy,), kepts + (kept,)
        dw, db = new_dw, new_db
        c1 = tl.sum(c1, axis=1)[:, None] / H
        c2 = tl.sum(c2, axis=1)[:, None] / H
        new_dxb = ()
        for c in tl.static_range(CHUNKS):
            _, mask, offsets = _chunk(c, rows, n_rows, H, BLOCK_H)
            dh = (wdys[c] - (hhats[c] * c1 + c2)) * rstd
            if HAS_DH:
                dh += tl.load(DH + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:  # its own tensor: no aliased gradients
                tl.store(DR + offsets, dh.to(DR.dtype.element_ty), mask=mask)
            if HAS_DROPOUT:
                dh = tl.where(kepts[c], dh * scale, 0.0)
            tl.store(DX + offsets, dh.to(DX.dtype.element_ty), mask=mask)
            new_dxb = new_dxb + ((dxb[c] + tl.where(mask, dh, 0.0)) if HAS_XBIAS else dxb[c],)
        dxb = new_dxb
    for c in tl.static_range(CHUNKS):
        cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
        tl.store(PARTS + pid * H + cols, tl.sum(dw[c], axis=0), mask=cols < H)
        tl.store(PARTS + (programs + pid) * H + cols, tl.sum(db[c], axis=0), mask=cols < H)
        if HAS_XBIAS:
            tl.store(PARTS + (2 * programs + pid) * H + cols, tl.sum(dxb[c], axis=0), mask=cols < H)


# The backward's programs, at most: about 8 for each multiprocessor of an H100 / H200 (132), so every one stays busy,
# and few weight-gradient partials to sum (the first GPU timing, at 16 rows a program: 4,096 programs at 65,536 rows,
# and summing their 25 MB of partials on 12 programs took a third of the backward's time). A constant, not the
# device's count: the same rows give the same summation order on every device.
BACKWARD_PROGRAMS = 1024


KERNELS = TILED_KERNELS


# The narrowest chunk a row is split into (`row_chunks`): 8 elements a thread still fill a tile of whole rows.
MIN_CHUNK_LANES = 64


@functools.cache
def row_chunks(hidden: int) -> tuple[int, int]:
    """(chunks, lanes): the kernels take a row of `hidden` elements as `chunks` blocks of `lanes` (a power of two)
    each: three where hidden is 3 x 2^k, at least MIN_CHUNK_LANES lanes a block, else one block of the next power of
    two, its tail masked. RoBERTa-base's and ModernBERT-base's 768 as 3 x 256: in one block of 1,024, a quarter of the
    lanes would issue every instruction for nothing (these kernels are bound by what they issue). Not five or seven
    (Ettin-1B's 1,792 = 7 x 256): the backward, holding six values an element of every chunk, took 180-231 registers
    at seven; 1,792 runs in 2,048 lanes."""
    if hidden % 3 == 0 and (hidden // 3) & (hidden // 3 - 1) == 0 and hidden // 3 >= MIN_CHUNK_LANES:
        return 3, hidden // 3
    return 1, next_power_of_2(hidden)


def tiles(hidden: int) -> dict[str, RowTiles]:
    """Each kernel's RowTiles (KERNELS) for rows of `hidden` elements: `launch.tiled_pair` of a chunk's lanes
    (`row_chunks`), the rows of a tile each held whole; a backward over several chunks takes one row a tile at 4
    elements of each chunk a thread: at RoBERTa-base's 768 on 2 warps, which the H200 at e63392c timed faster than
    the 4 warps at 2 elements then shipped (fewer instructions an element: a row's sums across threads span fewer
    warps; it holds six values an element across the chunks, at most 128 registers, 16 warps resident).
    `benchmarks/kernels.py --ops layers` times every CANDIDATE on CUDA."""
    chunks, lanes = row_chunks(hidden)
    tiling = tiled_pair(lanes)
    if chunks > 1:
        tiling["backward"] = RowTiles(1, max(1, lanes // 128))
    return tiling


# What the GPU benchmark times beside the shipped tiles, at RoBERTa-base's width (768: three chunks of 256 lanes,
# `row_chunks`), one kernel's tiles swapped at a time. They hold 8 or 16 elements of each chunk a thread (forward;
# shipped 8) and 2 or 4 (backward; shipped 4), on fewer or more warps, at the registers and residency
# kernels_static.md gives. (Backward tiles that loaded the next tile before the maths of this one, timed at e63392c,
# were no faster than the same tiles without: the norm's backward no longer has the form; bias + GELU's still does.)
CANDIDATES = {
    "forward": (RowTiles(4, 4), RowTiles(16, 8), RowTiles(8, 4), RowTiles(16, 16)),
    "backward": (RowTiles(1, 4), RowTiles(2, 4), RowTiles(2, 8)),
}


def backward_tiles(rows: int, block_r: int) -> int:
    """Tiles of block_r rows each backward program takes: enough that at most BACKWARD_PROGRAMS programs cover
    `rows`."""
    return max(1, cdiv(cdiv(rows, block_r), BACKWARD_PROGRAMS))


class _AddLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, x_bias, eps, keep_sum, dropout_p, key, tiling, handoff):
        rows, hidden = x.shape
        has_residual = residual is not None
        residual = residual if has_residual else x  # a pointer the kernels never read
        threshold, scale = dropout_threshold(dropout_p)
        y, h, stats = carve(x.device, ((rows, hidden), x.dtype), ((rows, hidden) if keep_sum else (0,), x.dtype),
                             ((2, rows), torch.float32))
        chunks, lanes = row_chunks(hidden)
        block_r, warps, _ = tiling["forward"]
        if rows:
            _add_norm_fwd_kernel[(cdiv(rows, block_r),)](
                x, x_bias if x_bias is not None else weight, residual, weight, bias if bias is not None else weight,
                y, h, stats[0], stats[1], key if threshold else stats, rows, hidden, x.stride(0), residual.stride(0),
                eps, threshold, scale, HAS_XBIAS=x_bias is not None, HAS_BIAS=bias is not None, STORE_SUM=keep_sum,
                HAS_DROPOUT=threshold > 0, HAS_RESIDUAL=has_residual, BLOCK_R=block_r, BLOCK_H=lanes, CHUNKS=chunks,
                num_warps=warps)
        # the kept sum is what the backward reads (x and the residual are then free to go); without a residual,
        # dropout or x_bias, x is the sum
        from_sum = keep_sum or not has_residual
        summed = h if keep_sum else x
        ctx.save_for_backward(summed if from_sum else x, x_bias if x_bias is not None else weight,
                              summed if from_sum else residual, weight, stats, key if threshold else stats)
        ctx.has_bias, ctx.has_x_bias, ctx.has_residual = bias is not None, x_bias is not None, has_residual
        ctx.keep_sum, ctx.from_sum, ctx.threshold, ctx.scale = keep_sum, from_sum, threshold, scale
        ctx.tiling, ctx.handoff = tiling, handoff
        ctx.deferral = defer_sums(weight, bias, *((x_bias,) if x_bias is not None else ()))  # the sums' rows
        return (y, h) if keep_sum else (y, None)

    @staticmethod
    def backward(ctx, dy, dh):
        x, x_bias, residual, weight, stats, key = ctx.saved_tensors
        rows, hidden = x.shape
        chunks, lanes = row_chunks(hidden)
        block_r, warps, _ = ctx.tiling["backward"]
        tiles = backward_tiles(rows, block_r)
        programs = cdiv(rows, tiles * block_r)
        # dx and dr two tensors (no aliased gradients); every program writes its row of partial sums: the weight's,
        # the bias's, and x_bias's where there is one, summed by one kernel into `sums` (`launch.carve_sums`)
        summed = 3 if ctx.has_x_bias else 2
        (dx, dr), sums, parts = carve_sums(
            x.device, (((rows, hidden), x.dtype), ((rows, hidden) if ctx.has_residual else (0,), x.dtype)),
            ((summed, hidden), weight.dtype), ((summed, programs, hidden), torch.float32), ctx.deferral)
        has_dh = ctx.keep_sum and dh is not None
        if rows:
            _add_norm_bwd_kernel[(programs,)](dy.contiguous(), dh.contiguous() if has_dh else dy, x, x_bias, residual,
                                              weight, stats[0], stats[1], key, dx, dr, parts, rows, tiles, programs,
                                              hidden, x.stride(0), residual.stride(0), ctx.threshold, ctx.scale,
                                              HAS_DH=has_dh, HAS_XBIAS=ctx.has_x_bias, HAS_DROPOUT=ctx.threshold > 0,
                                              FROM_SUM=ctx.from_sum, HAS_RESIDUAL=ctx.has_residual,
                                              BLOCK_R=block_r, BLOCK_H=lanes, CHUNKS=chunks, num_warps=warps)
        sum_parts(parts, sums, ctx.deferral)
        if ctx.handoff is not None:  # the projection reading the residual's rows adds its gradient in its GEMM
            ctx.handoff.put(dr)
        if ctx.handoff is not None or not ctx.has_residual:
            dr = None
        return (dx, dr, sums[0], sums[1] if ctx.has_bias else None, sums[2] if ctx.has_x_bias else None,
                None, None, None, None, None, None)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float = 1e-5, keep_sum: bool = False, dropout_p: float = 0.0,
                   key: torch.Tensor | None = None, tiling: dict[str, RowTiles] | None = None,
                   x_bias: torch.Tensor | None = None,
                   residual_grad: ResidualGrad | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(LayerNorm(h), h if keep_sum else None), h = dropout(x + x_bias) + residual, for rows x, residual [N, H] (the
    same dtype, their last dimension contiguous), weight [H], bias and x_bias [H] or None (x_bias: the bias of the
    projection whose output x is, its gradient summed here); the dropout hashed under `key` (an int64 tensor of one
    32-bit value on x's device) where dropout_p > 0. Differentiable in x, residual, weight, bias, x_bias. `tiling`:
    the kernels' launches (default `tiles(H)`; the benchmark swaps in CANDIDATES). `residual_grad`: where a
    projection that reads the residual's rows has claimed its gradient (`residual.ResidualGrad`), the backward hands
    it there instead of returning it."""
    if x.dim() != 2 or x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_layer_norm: x and residual must be [rows, H] of one dtype; got {tuple(x.shape)} "
                         f"{x.dtype} and {tuple(residual.shape)} {residual.dtype}")
    if x.shape[1] > MAX_HIDDEN or x.stride(1) != 1 or residual.stride(1) != 1:
        raise ValueError(f"add_layer_norm: rows of at most {MAX_HIDDEN} contiguous elements; got shape "
                         f"{tuple(x.shape)}, strides {x.stride()} and {residual.stride()}")
    check_dropout_key("add_layer_norm", dropout_p, key, x.device)
    if x_bias is not None and (x_bias.shape != weight.shape or x_bias.dtype != weight.dtype):
        raise ValueError(f"add_layer_norm: x_bias must be [H] in the weight's dtype {weight.dtype}; got "
                         f"{tuple(x_bias.shape)} {x_bias.dtype}")
    handoff = residual_grad if residual_grad is not None and residual_grad.claimed else None
    return _AddLayerNorm.apply(x, residual, weight, bias, x_bias, eps, keep_sum, dropout_p, key,
                               tiling or tiles(x.shape[1]), handoff)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5,
               tiling: dict[str, RowTiles] | None = None) -> torch.Tensor:
    """LayerNorm(x) * weight + bias for rows x [N, H] (last dimension contiguous, the weight's dtype):
    `add_layer_norm`'s kernels without a residual (none read, none's gradient written; the backward reads x as the
    sum). Differentiable in x, weight, bias."""
    if x.dim() != 2 or x.shape[1] > MAX_HIDDEN or x.stride(1) != 1 or x.dtype != weight.dtype:
        raise ValueError(f"layer_norm: rows of at most {MAX_HIDDEN} contiguous elements in the weight's dtype "
                         f"{weight.dtype}; got shape {tuple(x.shape)}, strides {x.stride()}, {x.dtype}")
    return _AddLayerNorm.apply(x, None, weight, bias, None, eps, False, 0.0, None, tiling or tiles(x.shape[1]),
                               None)[0]
