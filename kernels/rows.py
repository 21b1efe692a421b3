"""Row gather / scatter with a fused position add and LayerNorm: the embedding gather and the insertion.

One Triton kernel pair serves both (ARCHITECTURE.md section 3.2). Output row r is

    out[dst(r)] = LayerNorm(src_row(r) + pos_table[pos_ids[r]])     (position add and LayerNorm each optional)

with src_row(r) = src[src_ids[r]] (a table lookup: the embedding gather) or src[r] for r < num_src_rows and the
`fill` row after (the insertion), and dst(r) = r or dst_index[r] (a scatter).
Backward writes d(pre-norm row) once per row, in row order, so no float atomics: the caller reduces it into the
tables with torch's embedding backward (`_accumulate_rows`) or takes it as the gradient of `src` directly.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _input_row(r, SRC, src_ids, FILL, POS, pos_ids, num_src_rows, stride_src, stride_pos, cols, mask,
               SRC_INDEXED: tl.constexpr, HAS_FILL: tl.constexpr, HAS_POS: tl.constexpr):
    """fp32 [BLOCK_H] pre-norm value of output row r (branch-free: rows past num_src_rows read FILL)."""
    src_mask = mask
    if HAS_FILL:
        src_mask = mask & ((cols * 0 + r) < num_src_rows)  # a block-shaped condition: the interpreter needs one
    if SRC_INDEXED:
        src_row = tl.load(src_ids + r).to(tl.int64)
    else:
        src_row = r
    x = tl.load(SRC + src_row * stride_src + cols, mask=src_mask, other=0.0).to(tl.float32)
    if HAS_FILL:
        x += tl.load(FILL + cols, mask=mask & ((cols * 0 + r) >= num_src_rows), other=0.0).to(tl.float32)
    if HAS_POS:
        pos_row = tl.load(pos_ids + r).to(tl.int64)
        x += tl.load(POS + pos_row * stride_pos + cols, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _output_row(r, dst_index, DST_INDEXED: tl.constexpr):
    """Row of the output that launch row r writes (and whose gradient it reads)."""
    if DST_INDEXED:
        dst = tl.load(dst_index + r).to(tl.int64)
    else:
        dst = r
    return dst


@triton.jit
def _rows_fwd_kernel(SRC, src_ids, FILL, POS, pos_ids, W, B, OUT, dst_index, MEAN, RSTD,
                     num_src_rows, H, stride_src, stride_pos, stride_out, eps,
                     SRC_INDEXED: tl.constexpr, HAS_FILL: tl.constexpr, HAS_POS: tl.constexpr,
                     HAS_NORM: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = cols < H
    x = _input_row(r, SRC, src_ids, FILL, POS, pos_ids, num_src_rows, stride_src, stride_pos, cols, mask,
                   SRC_INDEXED, HAS_FILL, HAS_POS)
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
    dst = _output_row(r, dst_index, DST_INDEXED)
    tl.store(OUT + dst * stride_out + cols, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rows_bwd_kernel(DOUT, dst_index, SRC, src_ids, FILL, POS, pos_ids, W, MEAN, RSTD, DPRE, DW_PART, DB_PART,
                     n_rows, num_src_rows, H, stride_dout, stride_src, stride_pos,
                     SRC_INDEXED: tl.constexpr, HAS_FILL: tl.constexpr, HAS_POS: tl.constexpr,
                     HAS_NORM: tl.constexpr, DST_INDEXED: tl.constexpr, BLOCK_H: tl.constexpr,
                     ROWS_PER_PROGRAM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    mask = cols < H
    dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    db = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_NORM:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    for i in range(ROWS_PER_PROGRAM):
        r = pid * ROWS_PER_PROGRAM + i
        if r < n_rows:
            dst = _output_row(r, dst_index, DST_INDEXED)
            dy = tl.load(DOUT + dst * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_NORM:
                x = _input_row(r, SRC, src_ids, FILL, POS, pos_ids, num_src_rows, stride_src, stride_pos, cols,
                               mask, SRC_INDEXED, HAS_FILL, HAS_POS)
                xhat = tl.where(mask, (x - tl.load(MEAN + r)) * tl.load(RSTD + r), 0.0)
                wdy = w * dy
                c1 = tl.sum(xhat * wdy, axis=0) / H
                c2 = tl.sum(wdy, axis=0) / H
                dx = (wdy - (xhat * c1 + c2)) * tl.load(RSTD + r)
                dw += dy * xhat
                db += dy
            else:
                dx = dy
            tl.store(DPRE + r * H + cols, dx, mask=mask)
    if HAS_NORM:
        tl.store(DW_PART + pid * H + cols, dw, mask=mask)
        tl.store(DB_PART + pid * H + cols, db, mask=mask)


@triton.jit
def _sum_parts_kernel(PARTS, SUMS, programs, H, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (c, n): columns block c of SUMS[n] [H] in its dtype, the partial sums PARTS[n] [programs, H] fp32 a
    backward's programs wrote, added in a fixed order; each thread adds its own elements across the blocks of partial
    rows and the rows are summed once at the end (no cross-thread sum inside the loop)."""
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    part = tl.program_id(1).to(tl.int64)
    total = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < programs) & (cols[None, :] < H)
        total += tl.load(PARTS + (part * programs + rows[:, None]) * H + cols[None, :], mask=mask, other=0.0)
    tl.store(SUMS + part * H + cols, tl.sum(total, axis=0).to(SUMS.dtype.element_ty), mask=cols < H)


# ---------------------------------------------------------------------------------------------------- launchers


# _sum_parts_kernel's tile and warps: 128 partial rows x 32 columns (a 128-byte line a row), 16 elements a thread.
# The first GPU timing, at 32 x 64 on 4 warps with a cross-thread sum each step, had 12 programs at RoBERTa-base's
# width loop 32 times over 1,024 partial rows: 0.07 ms a call, 1.8 ms of an mlm step on an H200.
SUM_BLOCK_P, SUM_BLOCK_H, SUM_WARPS = 128, 32, 8


def sum_parts(parts: torch.Tensor, sums: torch.Tensor) -> None:
    """sums [n, H] (contiguous, any float dtype) = parts [n, programs, H] fp32, as a backward's programs wrote them,
    summed over their rows: one kernel for all n (a norm's weight and bias gradients, a projection's bias), a fixed
    order (deterministic), the cast to the dtype of `sums` in it."""
    count, programs, hidden = parts.shape
    if sums.shape != (count, hidden) or not sums.is_contiguous():
        raise ValueError(f"sum_parts: sums must be contiguous [{count}, {hidden}]; got {tuple(sums.shape)}")
    if hidden and count:
        _sum_parts_kernel[(triton.cdiv(hidden, SUM_BLOCK_H), count)](parts, sums, programs, hidden,
                                                                     BLOCK_P=SUM_BLOCK_P, BLOCK_H=SUM_BLOCK_H,
                                                                     num_warps=SUM_WARPS)


def row_launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for rows of `hidden` elements: one row per program, ~8 elements per thread."""
    block = triton.next_power_of_2(hidden)
    return block, max(1, min(16, block // 256))


ROWS_PER_PROGRAM = 16  # backward: rows per program, so LayerNorm weight-gradient partials stay few


# Elements of a backward kernel's tile (norm.py, activation.py's bias + GELU): 4 a thread over 8 warps, where the
# forward's 2,048 put 8 a thread. A backward holds more of each element live (the gradient, the recomputed input, the
# statistics, the partial sums), and at 8 a thread the static GPU check counted 143-146 registers for the LayerNorm's
# backward at RoBERTa-base's width: one 8-warp program a multiprocessor (8 of 64 warps). At 4 a thread: 75-80, three.
BACKWARD_TILE = 1024


# Column-blocked kernels (activation.py's bias + GELU, projection.py's QKV gathering): the columns a program takes
# at most (wide rows take several programs), and the rows a backward program sums, so that its bias gradient's
# partials stay few.
COLUMNS_PER_PROGRAM = 1024
ROWS_PER_BIAS_PROGRAM = 64


def column_block(columns: int) -> int:
    """BLOCK_C, the columns a program of a column-blocked kernel takes, for rows of `columns`."""
    return min(triton.next_power_of_2(columns), COLUMNS_PER_PROGRAM)


class RowTiles(NamedTuple):
    """A row-tiled kernel's launch (norm.py, activation.py, rotary.py): the rows of the tile a program holds at once,
    and its warps."""

    rows: int
    warps: int


def tile_launch(block: int, elements: int = 2048) -> RowTiles:
    """The RowTiles of a row-tiled kernel over rows of `block` elements: a tile of about `elements` elements (at most
    64 rows) over 8 warps, at least 4 and at most 16 (the widest rows hold more a thread). Fewer, larger programs than
    one a row: also far cheaper under the interpreter."""
    rows = max(1, min(64, elements // block))
    return RowTiles(rows, max(4, min(16, rows * block * 8 // elements)))


TILED_KERNELS = ("forward", "backward")  # a row-tiled op's two kernels (norm.py's, bias + GELU's)


def tiled_pair(block: int) -> dict[str, RowTiles]:
    """The RowTiles of a row-tiled op's forward and backward kernels (TILED_KERNELS) over rows of `block` elements:
    `tile_launch`'s 8 elements a thread forward, 4 (BACKWARD_TILE) backward."""
    return {"forward": tile_launch(block), "backward": tile_launch(block, BACKWARD_TILE)}


def carve(device: torch.device, *specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
    """Tensors of the given (shape, dtype) as views of one allocation, each 256-byte aligned: one op for the host to
    issue however many buffers a kernel writes (benchmarks/host_overhead.py counts each allocation)."""
    offsets, size = [], 0
    for shape, dtype in specs:
        offsets.append(size)
        size += -(-torch.Size(shape).numel() * dtype.itemsize // 256) * 256
    buffer = torch.empty(max(size, 1), device=device, dtype=torch.uint8)
    return [buffer[start:start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for start, (shape, dtype) in zip(offsets, specs)]


def _placeholder(device):
    """An empty tensor passed for a pointer argument that the kernel's flags leave unused."""
    return torch.empty(0, device=device)


def _launch_forward(src, src_ids, fill, pos_table, pos_ids, ln_weight, ln_bias, eps, dst_index, n_rows):
    """n_rows: launch rows, one per output row (every output row is written exactly once)."""
    hidden = src.shape[1]
    device = src.device
    out = torch.empty(n_rows, hidden, device=device, dtype=src.dtype)
    has_norm = ln_weight is not None
    if has_norm:  # one allocation for both
        mean, rstd = torch.empty(2, n_rows, device=device, dtype=torch.float32).unbind(0)
    else:
        mean = rstd = _placeholder(device)
    if n_rows == 0:
        return out, mean, rstd
    block, warps = row_launch_config(hidden)
    none = _placeholder(device)
    _rows_fwd_kernel[(n_rows,)](
        src, src_ids if src_ids is not None else none, fill if fill is not None else none,
        pos_table if pos_table is not None else none, pos_ids if pos_ids is not None else none,
        ln_weight if has_norm else none, ln_bias if has_norm else none, out,
        dst_index if dst_index is not None else none, mean, rstd,
        src.shape[0], hidden, src.stride(0), pos_table.stride(0) if pos_table is not None else 0, out.stride(0), eps,
        SRC_INDEXED=src_ids is not None, HAS_FILL=fill is not None, HAS_POS=pos_table is not None,
        HAS_NORM=has_norm, DST_INDEXED=dst_index is not None, BLOCK_H=block, num_warps=warps,
    )
    return out, mean, rstd


def _launch_backward(dout, src, src_ids, fill, pos_table, pos_ids, ln_weight, mean, rstd, dst_index, n_rows):
    hidden = src.shape[1]
    device = src.device
    dpre = torch.empty(n_rows, hidden, device=device, dtype=torch.float32)
    has_norm = ln_weight is not None
    programs = triton.cdiv(n_rows, ROWS_PER_PROGRAM)
    # the LayerNorm's per-program partial gradients, weight's and bias's in one buffer, summed by one kernel
    parts = torch.empty(2, programs, hidden, device=device, dtype=torch.float32) if has_norm else None
    dw_part, db_part = parts.unbind(0) if has_norm else (None, None)
    if n_rows == 0:
        return dpre, None, None
    dout = dout.contiguous()
    block, warps = row_launch_config(hidden)
    none = _placeholder(device)
    _rows_bwd_kernel[(programs,)](
        dout, dst_index if dst_index is not None else none, src, src_ids if src_ids is not None else none,
        fill if fill is not None else none, pos_table if pos_table is not None else none,
        pos_ids if pos_ids is not None else none, ln_weight if has_norm else none, mean, rstd, dpre,
        dw_part if has_norm else none, db_part if has_norm else none,
        n_rows, src.shape[0], hidden, dout.stride(0), src.stride(0),
        pos_table.stride(0) if pos_table is not None else 0,
        SRC_INDEXED=src_ids is not None, HAS_FILL=fill is not None, HAS_POS=pos_table is not None,
        HAS_NORM=has_norm, DST_INDEXED=dst_index is not None, BLOCK_H=block, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
        num_warps=warps,
    )
    if not has_norm:
        return dpre, None, None
    sums = torch.empty(2, hidden, device=device, dtype=ln_weight.dtype)
    sum_parts(parts, sums)
    return dpre, sums[0], sums[1]


def _accumulate_rows(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Gradient of `table` [V, H] from per-row fp32 gradients `rows` [N, H] read at `ids` [N], in table's dtype:
    torch's embedding backward, which on CUDA sorts the ids and sums each id's rows in parallel partial sums (for a
    small table torch may add those partials with float atomics, unless torch.use_deterministic_algorithms(True)).
    `index_put_(accumulate=True)`, deterministic, sums an id's rows one after another:
    mlm's `<mask>` id, 15-30% of a micro-batch's rows, made it 5.7 ms of a RoBERTa-base step and 11 ms of a
    ModernBERT-base one on an H200 (Hugging Face's embedding backward: 0.4 ms)."""
    return torch.ops.aten.embedding_dense_backward(rows, ids, table.shape[0], -1, False).to(table.dtype)


# -------------------------------------------------------------------------------------------- autograd + public


class _RowsFunction(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, src, src_ids, fill, pos_table, pos_ids, ln_weight, ln_bias, eps, dst_index, n_rows):
        src = src.contiguous()
        out, mean, rstd = _launch_forward(src, src_ids, fill, pos_table, pos_ids, ln_weight, ln_bias, eps, dst_index,
                                          n_rows)
        ctx.save_for_backward(src, src_ids, fill, pos_table, pos_ids, ln_weight, mean, rstd, dst_index)  # None stays
        ctx.n_rows = n_rows
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, dout):
        src, src_ids, fill, pos_table, pos_ids, ln_weight, mean, rstd, dst_index = ctx.saved_tensors
        dpre, dw, db = _launch_backward(dout, src, src_ids, fill, pos_table, pos_ids, ln_weight, mean, rstd,
                                        dst_index, ctx.n_rows)
        if src_ids is not None:  # a table lookup: rows with the same id add up
            d_src = _accumulate_rows(src, src_ids, dpre) if ctx.needs_input_grad[0] else None
        else:  # row r of src made output row r: its gradient is d_pre in row order
            d_src = dpre[: src.shape[0]].to(src.dtype)
        d_fill = dpre[src.shape[0]:].sum(0).to(fill.dtype) if fill is not None else None
        d_pos = None
        if pos_table is not None and ctx.needs_input_grad[3]:
            d_pos = _accumulate_rows(pos_table, pos_ids, dpre)
        return d_src, None, d_fill, d_pos, None, dw, db, None, None, None


MAX_HIDDEN = 8192  # the largest row the launch configurations cover (kernels/aot.py checks each one)


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
               ln_bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Embedding gather (Triton): LayerNorm(table[ids] + pos_table[pos_ids]) for each of the N rows.

    table: [V, H]; ids: [N] int32; pos_table: [P, H] or None; pos_ids: [N] int32 (row of pos_table, offset included);
    ln_weight, ln_bias: [H] or None (no norm). Returns [N, H] in table's dtype; statistics in fp32.
    Gradients reach table and pos_table (summed over repeated ids) and the LayerNorm parameters.
    """
    _check_rows("embed_rows", table, pos_table, pos_ids, ln_weight, ln_bias, ids.numel())
    return _RowsFunction.apply(table, ids.contiguous(), None, pos_table, pos_ids, ln_weight, ln_bias, eps, None,
                               ids.numel())


def insert_rows(visible: torch.Tensor, visible_index: torch.Tensor, removed_index: torch.Tensor, fill: torch.Tensor,
                pos_table: torch.Tensor | None = None, pos_ids: torch.Tensor | None = None,
                ln_weight: torch.Tensor | None = None, ln_bias: torch.Tensor | None = None,
                eps: float = 1e-5) -> torch.Tensor:
    """Varlen scatter (Triton): the full [T, H] stream from T_v visible rows and one fill row.

    visible: [T_v, H]; visible_index: [T_v] int32, their rows in the full stream; removed_index: [T_r] int32, the
    other rows (T_v + T_r = T, disjoint); fill: [H], the row every removed slot gets (the <mask> embedding).
    Optionally add pos_table[pos_ids[row]] (pos_ids: [T], indexed by full-stream row) and apply LayerNorm.
    Returns [T, H] in visible's dtype. Backward: a gather for `visible`, a sum over removed rows for `fill`,
    row sums into pos_table, reductions for the LayerNorm parameters.
    """
    total = visible.shape[0] + removed_index.shape[0]
    _check_rows("insert_rows", visible, pos_table, pos_ids, ln_weight, ln_bias, total)
    dst_index = torch.cat([visible_index, removed_index]).to(torch.int32)
    launch_pos_ids = pos_ids.index_select(0, dst_index) if pos_ids is not None else None
    return _RowsFunction.apply(visible, None, fill.reshape(-1).to(visible.dtype), pos_table, launch_pos_ids,
                               ln_weight, ln_bias, eps, dst_index, total)
