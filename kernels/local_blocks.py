"""The blocks the local-window kernels (local_window.py) are made of: loading a block of rows, their positions, the
range of blocks of the other side a program's window reaches (and those wholly inside it), the window's mask, the
softmax probabilities from the forward's log-sum-exp. Positions increase within each sequence (local_window.py says
why that bounds what a program reads)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .launch import next_power_of_2

FAR = tl.constexpr(1 << 30)  # a position outside the window of every real row (the rows past a sequence's end)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr):
    """tl.dot(a, b) with fp32 accumulation; WIDEN: the operands widened to fp32 and multiplied in full fp32 precision
    (fp32 inputs, which a GPU's tl.dot would round to tf32; and under the Triton interpreter, whose tl.dot returns
    garbage for bf16 operands: the products of bf16 values are exact in fp32 either way)."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _positions(POS, rows, valid, window):
    """(positions of `rows` [BLOCK], -FAR for those not valid; the lowest and highest position a window around the
    valid ones reaches)."""
    pos = tl.load(POS + rows, mask=valid, other=-FAR)
    lowest = tl.min(tl.where(valid, pos, 2147483647), axis=0) - window
    highest = tl.max(tl.where(valid, pos, -2147483647), axis=0) + window
    return pos, lowest, highest


@triton.jit
def _rows(X, first, end, stride_t, stride_h, head, cols, BLOCK: tl.constexpr):
    """[BLOCK, HEAD_DIM] of X [T, heads, HEAD_DIM] at rows first .. first + BLOCK - 1 of `head`, those at or past the
    sequence's `end` reading its last row instead: no masked load (a mask a row costs each thread registers, enough
    to spill the backward on sm_80); such a row sits at position -FAR (`_block_positions`, `_positions`), so the
    window's mask (`_in_window`) drops its pairs with the sequence's rows; a program never takes a block of the
    other side as wholly inside the window (unmasked) against a held block holding such rows where the other side's
    sums read those pairs (the backward's dq). One 64-bit base a block, 32-bit offsets within it."""
    base = X + tl.cast(first, tl.int64) * stride_t + head * stride_h
    offsets = tl.minimum(tl.arange(0, BLOCK), end - 1 - first)
    return tl.load(base + offsets[:, None] * stride_t + cols[None, :])


@triton.jit
def _in_window(pos_q, pos_k, window):
    """bool [BLOCK_M, BLOCK_N]: the pairs the window keeps, pos_q - window <= pos_k <= pos_q + window as one unsigned
    compare a pair (a key below the window wraps to above 2 window). A row past the sequence's end on the side a loop
    walks or holds sits at position -FAR (`_block_positions`, `_positions`), outside the window of every row of the
    sequence (pairs of two such rows are kept, and reach only rows never stored)."""
    above_lowest = pos_k[None, :] - (pos_q - window)[:, None]
    return above_lowest.to(tl.uint32, bitcast=True) <= (2 * window).to(tl.uint32, bitcast=True)


@triton.jit
def _scores(a, b, pos_a, pos_b, window, whole, WIDEN: tl.constexpr):
    """fp32 a b^T of the block: [rows of a, rows of b], q k^T in the forward, k q^T (the scores transposed) in the
    backward; not yet scaled (the caller scales it into base 2 in the multiply-add that subtracts the row's shift: one
    instruction a score), -inf for the pairs outside the window, which is symmetric (`_in_window` of either order);
    `whole`: every pair of the block is inside it (`_reached_rows`), and no pair is masked."""
    scores = _dot(a, tl.trans(b), WIDEN)
    if whole:
        kept = scores
    else:
        kept = tl.where(_in_window(pos_a, pos_b, window), scores, float("-inf"))
    return kept


@triton.jit
def _whole(block_start, whole_from, whole_to, MASK_ALL: tl.constexpr):
    """Whether the block from block_start is wholly inside the window (`_reached_rows`): a run-time flag, or the
    constant False under MASK_ALL, which compiles the mask of every block and no branch (the GPU benchmark's
    measure of what the unmasked blocks save)."""
    whole = (block_start >= whole_from) & (block_start < whole_to)
    if MASK_ALL:
        whole = False
    return whole


@triton.jit
def _probabilities_t(k, q, pos_k, pos_q, lse, qk_scale, window, whole, WIDEN: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_M] softmax probabilities of the block transposed, keys as rows, from the forward's
    log-sum-exp of each query (base 2): the backward's products then take the block of keys as their rows, as
    Hopper's tensor-core instruction (wgmma) needs 64 rows or more; a block of 16 queries as rows compiles to the
    older mma.sync."""
    return tl.exp2(_scores(k, q, pos_k, pos_q, window, whole, WIDEN) * qk_scale - lse[None, :])


@triton.jit
def _block_positions(POS, first, end, BLOCK: tl.constexpr):
    """(which of rows first .. first + BLOCK - 1 exist, their positions: -FAR for those past the sequence's end)."""
    rows = first + tl.arange(0, BLOCK)
    valid = rows < end
    return valid, tl.load(POS + rows, mask=valid, other=-FAR)


def scan_rows(held: int, window: int, block: int) -> int:
    """SCAN of a kernel whose programs hold `held` rows and loop over blocks of `block`, for a window of `window`
    positions: a power of two above the rows `_reached_rows` reads (at most held + 2 window + 2 block - 2)."""
    return next_power_of_2(held + 2 * window + 2 * block)


@triton.jit
def _reached_rows(POS, start, end, held, HELD: tl.constexpr, lowest, highest, window, BLOCK: tl.constexpr,
                  SCAN: tl.constexpr):
    """(first, last, whole_from, whole_to): rows first .. last - 1 of the sequence's start .. end - 1, in blocks of
    BLOCK from `start`, run from the first block that reaches [lowest, highest] (the window of the program's HELD rows
    from `held`) to the end of the last one (empty where none does): a block of the other side that reaches none of
    the window is skipped. The blocks from whole_from to whole_to are whole blocks every row of which is within the
    window of every held row: their pairs need no mask (held rows past the sequence's end are never stored).
    Positions increase within a sequence, so a row within `window` positions of a held row is within `window` rows of
    it: only the blocks of those rows are read, in one load of SCAN positions (`scan_rows`; it read one block at a
    time, a load and two reductions each), however long the sequence. The main loops then run a fixed range with no
    branch, which lets Triton pipeline their loads."""
    scan_from = start + (tl.maximum(held - window - start, 0) // BLOCK) * BLOCK
    scan_to = tl.minimum(held + HELD + window, end)
    scan_end = tl.minimum(scan_from + tl.cdiv(scan_to - scan_from, BLOCK) * BLOCK, end)  # whole blocks' rows
    rows = scan_from + tl.arange(0, SCAN)
    valid = rows < scan_end
    pos = tl.load(POS + rows, mask=valid, other=0)
    inside = valid & (pos >= lowest) & (pos <= highest)
    first_row = tl.min(tl.where(inside, rows, end), axis=0)  # the first and last rows inside the window
    last_row = tl.max(tl.where(inside, rows, start - 1), axis=0)
    reached = last_row >= first_row
    first = tl.where(reached, scan_from + (first_row - scan_from) // BLOCK * BLOCK, end)
    last = tl.where(reached, scan_from + ((last_row - scan_from) // BLOCK + 1) * BLOCK, start)
    # rows within `window` of every held row: positions from the highest held one's - window to the lowest's + window
    whole = valid & (pos >= highest - 2 * window) & (pos <= lowest + 2 * window)
    first_whole = tl.min(tl.where(whole, rows, end), axis=0)
    after_whole = tl.max(tl.where(whole, rows + 1, scan_from), axis=0)
    whole_from = scan_from + tl.cdiv(first_whole - scan_from, BLOCK) * BLOCK
    whole_to = scan_from + (after_whole - scan_from) // BLOCK * BLOCK
    return first, last, whole_from, whole_to


@triton.jit
def _key_side(K, V, first, end, stride_kt, stride_kh, stride_vt, stride_vh, head, cols, BLOCK_N: tl.constexpr):
    """(k, v) of a block of keys."""
    return (_rows(K, first, end, stride_kt, stride_kh, head, cols, BLOCK_N),
            _rows(V, first, end, stride_vt, stride_vh, head, cols, BLOCK_N))


@triton.jit
def _program_block(CU, BLOCK: tl.constexpr):
    """(head, the sequence's first row, its end, the first row of this program's block of BLOCK rows)."""
    start = tl.load(CU + tl.program_id(1))
    end = tl.load(CU + tl.program_id(1) + 1)
    return tl.program_id(2), start, end, start + tl.program_id(0) * BLOCK


@triton.jit
def _per_row(X, rows, valid, n_heads, head):
    """fp32 [BLOCK] of X [T, heads] (the log-sum-exp) at `rows` of `head`, 0 where not valid."""
    return tl.load(X + rows.to(tl.int64) * n_heads + head, mask=valid, other=0.0)


@triton.jit
def _query_side(Q, DO, OUT, LSE, first, end, rows_q, valid_q, stride_qt, stride_qh, stride_dot, stride_doh, head,
                n_heads, cols, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(q, do, the forward's log-sum-exp, delta = rowsum(out * do): the softmax backward's term) of a block of queries,
    for the backward. OUT: contiguous [T, heads, HEAD_DIM]."""
    q = _rows(Q, first, end, stride_qt, stride_qh, head, cols, BLOCK_M)
    do = _rows(DO, first, end, stride_dot, stride_doh, head, cols, BLOCK_M)
    out = _rows(OUT, first, end, n_heads * HEAD_DIM, HEAD_DIM, head, cols, BLOCK_M)
    delta = tl.sum(out.to(tl.float32) * do.to(tl.float32), axis=1)
    return q, do, _per_row(LSE, rows_q, valid_q, n_heads, head), delta
