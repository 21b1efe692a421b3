"""Row gather / scatter with a fused position add and LayerNorm: the embedding gather and the insertion.

One Triton kernel pair serves both (ARCHITECTURE.md section 3.2). Launch row r writes

    out[dst(r)] = dropout(LayerNorm(src_row(r) + pos_table[pos_ids[dst(r)] + pos_offset]))   (each part optional)

with src_row(r) = src[src_ids[g(r)]] (a table lookup: the embedding gather; g(r) = gather_index[r] or r) or src[r]
for r < num_src_rows and the `fill` row after (the insertion), and dst(r) = r, or dst_index[r] for a source row and
fill_index[r - num_src_rows] for a fill row (a scatter). The dropout is the layers' hashed one (kernels/norm.py),
element (dst(r), c) of the output under a key: the backward draws the same bits, no mask stored, no dropout
kernels either way. The forward keeps the table rows it read, so the backward
indexes nothing; it writes d(pre-norm row) once per row, in row order and in the source's dtype (what a stock
model's gradient there is), so no float atomics: the caller reduces it into the tables in fp32 (kernels/table_grad.py)
or takes it as the gradient of `src` as it is.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import table_grad
from .hashing import check_dropout_key, dropout_threshold
from .launch import MAX_HIDDEN, carve, cdiv, row_launch_config, sum_parts
from .mask_select import dropout_kept
from .pending import claim_slot, expect_table

# ----------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _input_row(r, src_row, pos_row, SRC, FILL, POS, num_src_rows, stride_src, stride_pos, cols, mask,
               HAS_FILL: tl.constexpr, HAS_POS: tl.constexpr):
    """fp32 [BLOCK_H] pre-norm value of launch row r, which reads src row `src_row` and position row `pos_row`
    (branch-free: rows past num_src_rows read FILL)."""
    src_mask = mask
    if HAS_FILL:
        src_mask = mask & ((cols * 0 + r) < num_src_rows)  # a block-shaped condition: the interpreter needs one
    x = tl.load(SRC + src_row * stride_src + cols, mask=src_mask, other=0.0).to(tl.float32)
    if HAS_FILL:
        x += tl.load(FILL + cols, mask=mask & ((cols * 0 + r) >= num_src_rows), other=0.0).to(tl.float32)
    if HAS_POS:
        x += tl.load(POS + pos_row * stride_pos + cols, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _output_row(r, dst_index, fill_index, num_src_rows, DST_INDEXED: tl.constexpr, HAS_FILL: tl.constexpr):
    """Row of the output that launch row r writes (and whose gradient it reads): dst_index[r] for a source row,
    fill_index[r - num_src_rows] for a fill row."""
    dst = r
    if DST_INDEXED:
        if HAS_FILL:
            if r < num_src_rows:
                dst = tl.load(dst_index + r).to(tl.int64)
            else:
                dst = tl.load(fill_index + (r - num_src_rows)).to(tl.int64)
        else:
            dst = tl.load(dst_index + r).to(tl.int64)
    return dst


@triton.jit
def _rows_fwd_kernel(SRC, src_ids, gather_index, FILL, POS, pos_ids, W, B, OUT, dst_index, fill_index, MEAN, RSTD,
                     SRC_ROWS, POS_ROWS, KEY, num_src_rows, H, stride_src, stride_pos, stride_out, pos_offset, eps,
                     threshold, scale, SRC_INDEXED: tl.constexpr, GATHERED: tl.constexpr, HAS_FILL: tl.constexpr,
                     HAS_POS: tl.constexpr, HAS_NORM: tl.constexpr, DST_INDEXED: tl.constexpr,
                     HAS_DROPOUT: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = cols < H
    dst = _output_row(r, dst_index, fill_index, num_src_rows, DST_INDEXED, HAS_FILL)
    src_row = r
    if SRC_INDEXED:  # the table row this launch row reads, kept for the backward's accumulation
        id_row = r
        if GATHERED:
            id_row = tl.load(gather_index + r).to(tl.int64)
        src_row = tl.load(src_ids + id_row).to(tl.int64)
        tl.store(SRC_ROWS + r, src_row.to(tl.int32))
    pos_row = r
    if HAS_POS:  # positions are the output row's; the table row read, kept likewise
        pos_row = tl.load(pos_ids + dst).to(tl.int64) + pos_offset
        tl.store(POS_ROWS + r, pos_row.to(tl.int32))
    x = _input_row(r, src_row, pos_row, SRC, FILL, POS, num_src_rows, stride_src, stride_pos, cols, mask,
                   HAS_FILL, HAS_POS)
    if HAS_NORM:
        mean = tl.sum(x, axis=0) / H
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / H + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        y = xc * rstd * w + b
        tl.store(MEAN + r, mean)
        tl.store(RSTD + r, rstd)
    else:
        y = x
    if HAS_DROPOUT:  # the output rounded to its dtype, then scaled (what torch's dropout of it gives)
        y = tl.where(dropout_kept(dst * H + cols, KEY, threshold), y.to(OUT.dtype.element_ty).to(tl.float32) * scale,
                     0.0)
    tl.store(OUT + dst * stride_out + cols, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rows_bwd_kernel(DOUT, dst_index, fill_index, SRC, SRC_ROWS, FILL, POS, POS_ROWS, W, MEAN, RSTD, DPRE, DW_PART,
                     DB_PART, DFILL_PART, KEY, n_rows, num_src_rows, H, stride_dout, stride_src, stride_pos, threshold,
                     scale,
                     SRC_INDEXED: tl.constexpr, HAS_FILL: tl.constexpr, HAS_POS: tl.constexpr,
                     HAS_NORM: tl.constexpr, DST_INDEXED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                     BLOCK_H: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = cols < H
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    db = tl.zeros([BLOCK_H], dtype=tl.float32)
    dfill = tl.zeros([BLOCK_H], dtype=tl.float32)  # the fill rows' summed gradient (the fill row's)
    if HAS_NORM:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    for i in range(ROWS_PER_PROGRAM):
        r = pid * ROWS_PER_PROGRAM + i
        if r < n_rows:
            dst = _output_row(r, dst_index, fill_index, num_src_rows, DST_INDEXED, HAS_FILL)
            dy = tl.load(DOUT + dst * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_DROPOUT:
                dy = tl.where(dropout_kept(dst * H + cols, KEY, threshold), dy * scale, 0.0)
            if HAS_NORM:
                src_row = r
                if SRC_INDEXED:
                    src_row = tl.load(SRC_ROWS + r).to(tl.int64)
                pos_row = r
                if HAS_POS:
                    pos_row = tl.load(POS_ROWS + r).to(tl.int64)
                x = _input_row(r, src_row, pos_row, SRC, FILL, POS, num_src_rows, stride_src, stride_pos, cols,
                               mask, HAS_FILL, HAS_POS)
                xhat = tl.where(mask, (x - tl.load(MEAN + r)) * tl.load(RSTD + r), 0.0)
                wdy = w * dy
                c1 = tl.sum(xhat * wdy, axis=0) / H
                c2 = tl.sum(wdy, axis=0) / H
                dx = (wdy - (xhat * c1 + c2)) * tl.load(RSTD + r)
                dw += dy * xhat
                db += dy
            else:
                dx = dy
            tl.store(DPRE + r * H + cols, dx.to(DPRE.dtype.element_ty), mask=mask)
            if HAS_FILL:
                dfill += tl.where((cols * 0 + r) >= num_src_rows, dx, 0.0)  # block-shaped: the interpreter's need
    if HAS_NORM:
        tl.store(DW_PART + pid * H + cols, dw, mask=mask)
        tl.store(DB_PART + pid * H + cols, db, mask=mask)
    if HAS_FILL:
        tl.store(DFILL_PART + pid * H + cols, dfill, mask=mask)


# ---------------------------------------------------------------------------------------------------- launchers


ROWS_PER_PROGRAM = 16  # backward: rows per program, so LayerNorm weight-gradient partials stay few


def _pointers(device: torch.device, *tensors: torch.Tensor | None) -> list[torch.Tensor]:
    """The tensors as a kernel's pointer arguments: an empty tensor for each None (the kernel's flags leave it
    unused)."""
    none = torch.empty(0, device=device)
    return [none if t is None else t for t in tensors]


class RowIndex(NamedTuple):
    """Which rows a row op reads and writes (the tensors int32, on the op's device; none of them differentiable).

    src_ids: the table rows of a lookup, or None (launch row r reads src row r, then `fill`); gather_index: the
    entries of src_ids the launch rows read (None: all, in order); dst_index / fill_index: the output rows of the
    source rows / of the fill rows (None: launch row r writes row r); pos_ids: the position of each output row
    (indexed by output row), read at row pos_ids + pos_offset of the position table; n_rows: launch (= output) rows.
    """

    src_ids: torch.Tensor | None
    gather_index: torch.Tensor | None
    dst_index: torch.Tensor | None
    fill_index: torch.Tensor | None
    pos_ids: torch.Tensor | None
    pos_offset: int
    n_rows: int


class RowDropout(NamedTuple):
    """A row op's hashed dropout of its output: `hashing.dropout_threshold`'s (threshold, scale) and the key (an int64
    tensor of one 32-bit value on the op's device; None where threshold is 0: no dropout)."""

    threshold: int
    scale: float
    key: torch.Tensor | None

    @classmethod
    def of(cls, name: str, p: float, key: torch.Tensor | None, device: torch.device) -> RowDropout:
        """The dropout at probability `p` under `key`, checked (errors name the op `name`)."""
        check_dropout_key(name, p, key, device)
        return cls(*dropout_threshold(p), key) if p else cls(0, 1.0, None)


def _launch_forward(src, fill, pos_table, ln_weight, ln_bias, eps, index: RowIndex, dropout: RowDropout):
    """Every output row written exactly once. Returns (out, mean, rstd, src_rows, pos_rows): the statistics and the
    table rows each launch row read (fp32, int32; empty where unused), what the backward reads."""
    hidden, device, n_rows = src.shape[1], src.device, index.n_rows
    out = torch.empty(n_rows, hidden, device=device, dtype=src.dtype)
    has_norm, has_pos, has_fill = ln_weight is not None, pos_table is not None, fill is not None
    src_indexed = index.src_ids is not None
    stats, src_rows, pos_rows = carve(device, ((2, n_rows if has_norm else 0), torch.float32),
                                      ((n_rows if src_indexed else 0,), torch.int32),
                                      ((n_rows if has_pos else 0,), torch.int32))
    mean, rstd = stats.unbind(0)
    if n_rows == 0:
        return out, mean, rstd, src_rows, pos_rows
    block, warps = row_launch_config(hidden)
    src_ids, gather_index, fill, pos_table, pos_ids, ln_weight, ln_bias, dst_index, fill_index, key = _pointers(
        device, index.src_ids, index.gather_index, fill, pos_table, index.pos_ids, ln_weight, ln_bias,
        index.dst_index, index.fill_index, dropout.key)
    _rows_fwd_kernel[(n_rows,)](
        src, src_ids, gather_index, fill, pos_table, pos_ids, ln_weight, ln_bias, out, dst_index, fill_index, mean,
        rstd, src_rows, pos_rows, key, src.shape[0], hidden, src.stride(0), pos_table.stride(0) if has_pos else 0,
        out.stride(0), index.pos_offset, eps, dropout.threshold, dropout.scale, SRC_INDEXED=src_indexed,
        GATHERED=index.gather_index is not None, HAS_FILL=has_fill, HAS_POS=has_pos, HAS_NORM=has_norm,
        DST_INDEXED=index.dst_index is not None, HAS_DROPOUT=dropout.threshold > 0, BLOCK_H=block, num_warps=warps,
    )
    return out, mean, rstd, src_rows, pos_rows


def _launch_backward(dout, src, fill, pos_table, ln_weight, mean, rstd, src_rows, pos_rows, index: RowIndex,
                     dropout: RowDropout):
    hidden, device, n_rows = src.shape[1], src.device, index.n_rows
    has_norm, has_fill, has_pos = ln_weight is not None, fill is not None, pos_table is not None
    # the rows' gradients and the scratch the tables' gradients take from them, one allocation
    tables = index.src_ids is not None or has_pos
    dpre, workspace = carve(device, ((n_rows, hidden), src.dtype),
                            (table_grad.workspace_shape(n_rows, hidden) if tables else (0,), torch.float32))
    if n_rows == 0:
        return dpre, workspace, None, None, None if fill is None else torch.zeros_like(fill)
    programs = cdiv(n_rows, ROWS_PER_PROGRAM)
    # per-program partial sums in one buffer: the LayerNorm's weight and bias gradients, then the fill row's
    parts = torch.empty(2 * has_norm + has_fill, programs, hidden, device=device, dtype=torch.float32)
    dw_part, db_part = parts[:2].unbind(0) if has_norm else (None, None)
    dfill_part = parts[-1] if has_fill else None
    dout = dout.contiguous()
    block, warps = row_launch_config(hidden)
    dst_index, fill_index, fill_ptr, pos_table, ln_weight_ptr, dw_part, db_part, dfill_part, key = _pointers(
        device, index.dst_index, index.fill_index, fill, pos_table, ln_weight, dw_part, db_part, dfill_part,
        dropout.key)
    _rows_bwd_kernel[(programs,)](
        dout, dst_index, fill_index, src, src_rows, fill_ptr, pos_table, pos_rows, ln_weight_ptr, mean, rstd, dpre,
        dw_part, db_part, dfill_part, key, n_rows, src.shape[0], hidden, dout.stride(0), src.stride(0),
        pos_table.stride(0) if has_pos else 0, dropout.threshold, dropout.scale,
        SRC_INDEXED=index.src_ids is not None, HAS_FILL=has_fill, HAS_POS=has_pos, HAS_NORM=has_norm,
        DST_INDEXED=index.dst_index is not None, HAS_DROPOUT=dropout.threshold > 0, BLOCK_H=block,
        ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, num_warps=warps,
    )
    # the norm's parameter gradients and the fill row's each an allocation of its own (`launch.carve` says why)
    dw = db = d_fill = None
    if has_norm:
        dw, db = _summed(parts[:2], ln_weight.dtype)
    if has_fill:
        (d_fill,) = _summed(parts[-1:], fill.dtype)
    return dpre, workspace, dw, db, d_fill


def _summed(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, H] in `dtype`: the per-program partial sums `parts` [n, programs, H] added up (`launch.sum_parts`)."""
    sums = torch.empty(parts.shape[0], parts.shape[2], device=parts.device, dtype=dtype)
    sum_parts(parts, sums)
    return sums


# -------------------------------------------------------------------------------------------- autograd + public


class _RowsFunction(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, src, fill, pos_table, ln_weight, ln_bias, eps, index: RowIndex, extra_row, dropout: RowDropout):
        # the tables' gradients go into their places in a flat gradient; the token table's adds into what a later
        # reader of it (the tied LM head) hands its backward (kernels/pending.py)
        lookup = index.src_ids is not None and src.requires_grad
        ctx.table, ctx.pos_slot = expect_table(src) if lookup else None, claim_slot(pos_table)
        src = src.contiguous()
        out, mean, rstd, src_rows, pos_rows = _launch_forward(src, fill, pos_table, ln_weight, ln_bias, eps, index,
                                                              dropout)
        ctx.save_for_backward(src, fill, pos_table, ln_weight, mean, rstd, src_rows, pos_rows, index.dst_index,
                              index.fill_index, dropout.key)  # None stays None
        ctx.index = index._replace(gather_index=None, dst_index=None, fill_index=None, pos_ids=None)
        ctx.dropout = dropout._replace(key=None)
        ctx.extra_row = extra_row
        return out if extra_row is None else (out, src[extra_row])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout, d_extra=None):
        src, fill, pos_table, ln_weight, mean, rstd, src_rows, pos_rows, dst_index, fill_index, key = ctx.saved_tensors
        index = ctx.index._replace(dst_index=dst_index, fill_index=fill_index)
        dpre, workspace, dw, db, d_fill = _launch_backward(dout, src, fill, pos_table, ln_weight, mean, rstd,
                                                           src_rows, pos_rows, index, ctx.dropout._replace(key=key))
        d_src = None
        if index.src_ids is not None and ctx.needs_input_grad[0]:  # a table lookup: rows with the same id add up
            handed = None if ctx.table is None else ctx.table.take_handed()
            out = handed if handed is not None or ctx.table is None else ctx.table.take(src.dtype)
            d_src = table_grad.table_gradient(dpre, src_rows, src.shape[0], src.dtype, ctx.extra_row, d_extra,
                                              workspace, out=out, accumulate=handed is not None)
        elif index.src_ids is None:  # row r of src made output row r: its gradient is d_pre in row order
            d_src = dpre[: src.shape[0]]
        d_pos = None
        if pos_table is not None and ctx.needs_input_grad[2]:
            d_pos = table_grad.table_gradient(dpre, pos_rows, pos_table.shape[0], pos_table.dtype, workspace=workspace,
                                              out=None if ctx.pos_slot is None else ctx.pos_slot.take(pos_table.dtype))
        return d_src, d_fill, d_pos, dw, db, None, None, None, None


def _check_rows(name, src, pos_table, pos_ids, ln_weight, ln_bias, n_rows):
    if src.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, H] source, got shape {tuple(src.shape)}")
    if src.shape[1] > MAX_HIDDEN:
        raise ValueError(f"{name}: hidden size {src.shape[1]} exceeds the supported {MAX_HIDDEN}")
    if (pos_table is None) != (pos_ids is None):
        raise ValueError(f"{name}: pos_table and pos_ids go together")
    if pos_ids is not None and pos_ids.numel() != n_rows:
        raise ValueError(f"{name}: pos_ids has {pos_ids.numel()} rows, expected {n_rows}")
    if (ln_weight is None) != (ln_bias is None):
        raise ValueError(f"{name}: ln_weight and ln_bias go together")


def embed_rows(table: torch.Tensor, ids: torch.Tensor, pos_table: torch.Tensor | None = None,
               pos_ids: torch.Tensor | None = None, ln_weight: torch.Tensor | None = None,
               ln_bias: torch.Tensor | None = None, eps: float = 1e-5, *, rows: torch.Tensor | None = None,
               pos_offset: int = 0, extra_row: int | None = None, dropout_p: float = 0.0,
               key: torch.Tensor | None = None):
    """Embedding gather (Triton): dropout(LayerNorm(table[ids[rows]] + pos_table[pos_ids + pos_offset])) for each of
    the N rows (`rows` None: every id, in order), the dropout hashed under `key` (an int64 tensor of one 32-bit value
    on the table's device) where dropout_p > 0.

    table: [V, H]; ids: int32; rows: [N] int32 or None; pos_table: [P, H] or None; pos_ids: [N] int32, each row's
    position (its row of pos_table: pos_ids + pos_offset); ln_weight, ln_bias: [H] or None (no norm). Returns [N, H]
    in table's dtype (statistics in fp32), and with `extra_row` the pair of that and table[extra_row] [H] (the
    insertion's `<mask>` row), whose gradient joins the table's in this op's backward. Gradients reach table and
    pos_table (summed over repeated ids) and the LayerNorm parameters.
    """
    n_rows = ids.numel() if rows is None else rows.numel()
    _check_rows("embed_rows", table, pos_table, pos_ids, ln_weight, ln_bias, n_rows)
    index = RowIndex(ids.contiguous(), rows, None, None, pos_ids, pos_offset, n_rows)
    dropout = RowDropout.of("embed_rows", dropout_p, key, table.device)
    return _RowsFunction.apply(table, None, pos_table, ln_weight, ln_bias, eps, index, extra_row, dropout)


def insert_rows(visible: torch.Tensor, visible_index: torch.Tensor, removed_index: torch.Tensor, fill: torch.Tensor,
                pos_table: torch.Tensor | None = None, pos_ids: torch.Tensor | None = None,
                ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
                eps: float = 1e-5, *, pos_offset: int = 0, dropout_p: float = 0.0,
                key: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen scatter (Triton): the full [T, H] stream from T_v visible rows and one fill row.

    visible: [T_v, H]; visible_index: [T_v] int32, their rows in the full stream; removed_index: [T_r] int32, the
    other rows (T_v + T_r = T, disjoint); fill: [H], the row every removed slot gets (the <mask> embedding).
    Optionally add pos_table[pos_ids[row] + pos_offset] (pos_ids: [T], indexed by full-stream row) and apply
    LayerNorm, then the hashed dropout under `key` where dropout_p > 0 (as `embed_rows`). Returns [T, H] in
    visible's dtype. Backward: a gather for `visible`, a sum over removed rows for `fill`, row sums into pos_table,
    reductions for the LayerNorm parameters.
    """
    total = visible.shape[0] + removed_index.shape[0]
    _check_rows("insert_rows", visible, pos_table, pos_ids, ln_weight, ln_bias, total)
    index = RowIndex(None, None, visible_index, removed_index, pos_ids, pos_offset, total)
    dropout = RowDropout.of("insert_rows", dropout_p, key, visible.device)
    return _RowsFunction.apply(visible, fill.reshape(-1).to(visible.dtype), pos_table, ln_weight, ln_bias, eps,
                               index, None, dropout)
