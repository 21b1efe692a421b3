"""Local attention by original position over packed varlen sequences, forward and backward, in the manner of
FlashAttention (online softmax, nothing of [T, T] stored): a query attends to the keys of its own sequence whose
original positions are at most `window` from its own.

On a stream whose rows skip positions (3ml's and mae-lm's encoder before the insertion) a window of positions is not
a window of rows, so FlashAttention's own window cannot run it exactly; this kernel masks each (query, key) pair by
their positions where a block of keys straddles the window's boundary, leaves the pairs of a block wholly inside it
unmasked, and skips every block of keys whose positions all lie outside the window of every query of the block (on
any stream: on a full one it also beat FlashAttention's window, attention.CUDA_LOCAL_BACKEND). Positions must
increase within each sequence, as every fastmae stream's do (the full stream's 0, 1, 2, ...; a shortened stream's
kept positions in order): a row within `window` positions of another is then within `window` rows of it, so a
program looks only at the blocks of those rows, about (2 * window) / BLOCK_N + 2 of them however long its sequence.
Program (block of BLOCK_M query rows, sequence, head); the backward is two kernels, one a block of queries (dq, and
each row's rowsum(out * do) for the other) and then one a block of keys (dk, dv), each summing in a fixed order: no
atomics, deterministic. Softmax in base 2 (`exp2`), the log-sum-exp of each row kept for the backward. Reference:
`local_attention_reference` in reference.py.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import LOG2_E


class Tiles(NamedTuple):
    """One kernel's tiling: the rows of the block a program holds (`outer`: queries in the forward and the dq kernel,
    keys in the dk/dv kernel), the rows of the blocks of the other side it loops over (`inner`), warps a program and
    Triton's pipeline stages (the inner loop's loads in flight)."""

    outer: int
    inner: int
    warps: int
    stages: int = 3


KERNELS = ("forward", "dkdv", "dq")


def tiles(head_dim: int) -> dict[str, Tiles]:
    """Each kernel's Tiles (KERNELS) for heads of `head_dim`. As in FlashAttention's Triton backward, a backward
    kernel holds a large block and loops over small ones: the dk/dv kernel's products dv += p^T do and dk += ds^T q
    have its keys as their rows, and Hopper's tensor-core instruction (wgmma) takes 64 rows or more. Chosen without a
    GPU timing from what compiles for sm_80 and sm_90 without spills (kernels/aot.py, which compiles these and every
    CANDIDATE); `benchmarks/local_attention.py` times every candidate on CUDA. Tests shrink them."""
    if head_dim <= 64:
        return {"forward": Tiles(64, 32, 4), "dkdv": Tiles(64, 16, 4), "dq": Tiles(64, 32, 4)}
    return {"forward": Tiles(32, 32, 8), "dkdv": Tiles(32, 16, 8), "dq": Tiles(32, 32, 8)}


# What the GPU benchmark times at heads of 64 beside the shipped tiles (each compiled without spills by kernels/aot.py).
# The dk/dv kernel's 128-key tiles on 8 warps, timed slower than the shipped tile on an H200 at f6d59b9, are out: as
# the JIT specializes them they spill to the stack on sm_80, as its 64 x 64 tile on 4 warps does. The forward's and
# dq's 64 x 64 tiles on 4 warps hold twice the scores a thread of the shipped 64 x 32 (32, not 16), over which each
# step of the loop spreads its fixed work (the accumulator's rescale, the loads' addresses, the row reductions): on
# sm_90 under Triton 3.6 about 22.5 instructions a score where the shipped tile issues 26.5, at half the warps
# resident (186 registers a thread).
CANDIDATES = {
    "forward": (Tiles(64, 32, 8), Tiles(64, 64, 8), Tiles(128, 32, 8), Tiles(128, 64, 8), Tiles(64, 32, 4, 2),
                Tiles(64, 64, 4)),
    "dkdv": (Tiles(64, 16, 8), Tiles(32, 32, 4), Tiles(64, 32, 4)),
    "dq": (Tiles(64, 16, 4), Tiles(128, 32, 8), Tiles(64, 64, 8), Tiles(128, 16, 8), Tiles(64, 64, 4)),
}


FAR = tl.constexpr(1 << 30)  # a position outside every window (the rows past a sequence's end a loop walks)
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
    """(positions of `rows` [BLOCK], the lowest and highest position a window around them reaches)."""
    pos = tl.load(POS + rows, mask=valid, other=0)
    lowest = tl.min(tl.where(valid, pos, 2147483647), axis=0) - window
    highest = tl.max(tl.where(valid, pos, -2147483647), axis=0) + window
    return pos, lowest, highest


@triton.jit
def _rows(X, first, end, stride_t, stride_h, head, cols, BLOCK: tl.constexpr):
    """[BLOCK, HEAD_DIM] of X [T, heads, HEAD_DIM] at rows first .. first + BLOCK - 1 of `head`, those at or past the
    sequence's `end` reading its last row instead: no masked load (a mask a row costs each thread registers, enough
    to spill the backward on sm_80); the window's mask (`_in_window`) drops every pair of such a row on the side a
    loop walks, and the held side's are never stored. One 64-bit base a block, 32-bit offsets within it."""
    base = X + tl.cast(first, tl.int64) * stride_t + head * stride_h
    offsets = tl.minimum(tl.arange(0, BLOCK), end - 1 - first)
    return tl.load(base + offsets[:, None] * stride_t + cols[None, :])


@triton.jit
def _in_window(pos_q, pos_k, window):
    """bool [BLOCK_M, BLOCK_N]: the pairs the window keeps, pos_q - window <= pos_k <= pos_q + window as one unsigned
    compare a pair (a key below the window wraps to above 2 window). A row past the sequence's end on the side a loop
    walks sits at position -FAR (`_block_positions`), outside every window; the held side's rows past it are never
    stored, nor do they reach any stored row."""
    above_lowest = pos_k[None, :] - (pos_q - window)[:, None]
    return above_lowest.to(tl.uint32, bitcast=True) <= (2 * window).to(tl.uint32, bitcast=True)


@triton.jit
def _scores(q, k, pos_q, pos_k, window, whole, WIDEN: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] q k^T of the block, not yet scaled (the caller scales it into base 2 in the multiply-add
    that subtracts the row's shift: one instruction a score), -inf for the pairs outside the window; `whole`: every
    pair of the block is inside it (`_reached_rows`), and no pair is masked."""
    scores = _dot(q, tl.trans(k), WIDEN)
    if whole:
        kept = scores
    else:
        kept = tl.where(_in_window(pos_q, pos_k, window), scores, float("-inf"))
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
def _probabilities(q, k, pos_q, pos_k, lse, qk_scale, window, whole, WIDEN: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] softmax probabilities of the block, from the forward's log-sum-exp (base 2)."""
    return tl.exp2(_scores(q, k, pos_q, pos_k, window, whole, WIDEN) * qk_scale - lse[:, None])


@triton.jit
def _block_positions(POS, first, end, BLOCK: tl.constexpr):
    """(which of rows first .. first + BLOCK - 1 exist, their positions: -FAR for those past the sequence's end)."""
    rows = first + tl.arange(0, BLOCK)
    valid = rows < end
    return valid, tl.load(POS + rows, mask=valid, other=-FAR)


def scan_rows(held: int, window: int, block: int) -> int:
    """SCAN of a kernel whose programs hold `held` rows and loop over blocks of `block`, for a window of `window`
    positions: a power of two above the rows `_reached_rows` reads (at most held + 2 window + 2 block - 2)."""
    return triton.next_power_of_2(held + 2 * window + 2 * block)


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
    """fp32 [BLOCK] of X [T, heads] (the log-sum-exp, delta) at `rows` of `head`, 0 where not valid."""
    return tl.load(X + rows.to(tl.int64) * n_heads + head, mask=valid, other=0.0)


@triton.jit
def _query_side(Q, DO, LSE, first, end, rows_q, valid_q, stride_qt, stride_qh, stride_dot, stride_doh, head, n_heads,
                cols, BLOCK_M: tl.constexpr):
    """(q, do, the forward's log-sum-exp) of a block of queries, for the backward."""
    q = _rows(Q, first, end, stride_qt, stride_qh, head, cols, BLOCK_M)
    do = _rows(DO, first, end, stride_dot, stride_doh, head, cols, BLOCK_M)
    return q, do, _per_row(LSE, rows_q, valid_q, n_heads, head)


@triton.jit
def _local_fwd_kernel(Q, K, V, OUT, LSE, CU, POS, qk_scale, window, n_heads, stride_qt, stride_qh, stride_kt,
                      stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr, SCAN: tl.constexpr,
                      MASK_ALL: tl.constexpr):
    head, start, end, first = _program_block(CU, BLOCK_M)
    if first < end:
        cols = tl.arange(0, HEAD_DIM)
        rows_q = first + tl.arange(0, BLOCK_M)
        valid_q = rows_q < end
        q = _rows(Q, first, end, stride_qt, stride_qh, head, cols, BLOCK_M)
        pos_q, lowest, highest = _positions(POS, rows_q, valid_q, window)
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        first_k, last_k, whole_from, whole_to = _reached_rows(POS, start, end, first, BLOCK_M, lowest, highest,
                                                             window, BLOCK_N, SCAN)
        for key_start in range(first_k, last_k, BLOCK_N):
            _, pos_k = _block_positions(POS, key_start, end, BLOCK_N)
            k, v = _key_side(K, V, key_start, end, stride_kt, stride_kh, stride_vt, stride_vh, head, cols, BLOCK_N)
            whole = _whole(key_start, whole_from, whole_to, MASK_ALL)
            scores = _scores(q, k, pos_q, pos_k, window, whole, WIDEN)
            # the row's largest score in base 2: the scale (positive) commutes with the max, rounding included
            new_max = tl.maximum(row_max, tl.max(scores, axis=1) * qk_scale)
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key yet: no NaN
            p = tl.exp2(scores * qk_scale - shift[:, None])
            rescale = tl.exp2(row_max - shift)
            row_sum = row_sum * rescale + tl.sum(p, axis=1)
            acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, WIDEN)
            row_max = new_max
        # every valid query sees itself (distance 0): its row_sum is positive
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(OUT + rows_q[:, None].to(tl.int64) * stride_ot + head * stride_oh + cols[None, :],
                 out.to(OUT.dtype.element_ty), mask=valid_q[:, None])
        tl.store(LSE + rows_q.to(tl.int64) * n_heads + head, row_max + tl.log2(tl.where(row_sum > 0, row_sum, 1.0)),
                 mask=valid_q)


@triton.jit
def _local_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU, POS, qk_scale, scale, window, n_heads, stride_qt,
                           stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           WIDEN: tl.constexpr, SCAN: tl.constexpr, MASK_ALL: tl.constexpr):
    """Program (block of keys, sequence, head): dk and dv of its keys, summed over the query blocks their window
    reaches, in order. DK, DV: contiguous [T, heads, HEAD_DIM]."""
    head, start, end, first = _program_block(CU, BLOCK_N)
    if first < end:
        cols = tl.arange(0, HEAD_DIM)
        rows_k = first + tl.arange(0, BLOCK_N)
        valid_k = rows_k < end
        k, v = _key_side(K, V, first, end, stride_kt, stride_kh, stride_vt, stride_vh, head, cols, BLOCK_N)
        pos_k, lowest, highest = _positions(POS, rows_k, valid_k, window)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        first_q, last_q, whole_from, whole_to = _reached_rows(POS, start, end, first, BLOCK_N, lowest, highest,
                                                             window, BLOCK_M, SCAN)
        for query_start in range(first_q, last_q, BLOCK_M):
            valid_q, pos_q = _block_positions(POS, query_start, end, BLOCK_M)
            rows_q = query_start + tl.arange(0, BLOCK_M)
            q, do, lse = _query_side(Q, DO, LSE, query_start, end, rows_q, valid_q, stride_qt, stride_qh, stride_dot,
                                     stride_doh, head, n_heads, cols, BLOCK_M)
            delta = _per_row(DELTA, rows_q, valid_q, n_heads, head)
            whole = _whole(query_start, whole_from, whole_to, MASK_ALL)
            p = _probabilities(q, k, pos_q, pos_k, lse, qk_scale, window, whole, WIDEN)
            dv += _dot(tl.trans(p).to(do.dtype), do, WIDEN)
            ds = p * (_dot(do, tl.trans(v), WIDEN) - delta[:, None])
            dk += _dot(tl.trans(ds).to(q.dtype), q, WIDEN)
        offsets = rows_k[:, None].to(tl.int64) * (n_heads * HEAD_DIM) + head * HEAD_DIM + cols[None, :]
        tl.store(DK + offsets, (dk * scale).to(DK.dtype.element_ty), mask=valid_k[:, None])
        tl.store(DV + offsets, dv.to(DV.dtype.element_ty), mask=valid_k[:, None])


@triton.jit
def _local_bwd_dq_kernel(Q, K, V, DO, OUT, LSE, DELTA, DQ, CU, POS, qk_scale, scale, window, n_heads, stride_qt,
                         stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         WIDEN: tl.constexpr, SCAN: tl.constexpr, MASK_ALL: tl.constexpr):
    """Program (block of queries, sequence, head): dq of its queries, summed over the key blocks their window
    reaches, in order, and their delta = rowsum(out * do), the softmax backward's term, stored for the dk/dv kernel
    that runs after it. OUT, DQ: contiguous [T, heads, HEAD_DIM]; DELTA [T, heads] fp32."""
    head, start, end, first = _program_block(CU, BLOCK_M)
    if first < end:
        cols = tl.arange(0, HEAD_DIM)
        rows_q = first + tl.arange(0, BLOCK_M)
        valid_q = rows_q < end
        q, do, lse = _query_side(Q, DO, LSE, first, end, rows_q, valid_q, stride_qt, stride_qh, stride_dot, stride_doh,
                                 head, n_heads, cols, BLOCK_M)
        out = _rows(OUT, first, end, n_heads * HEAD_DIM, HEAD_DIM, head, cols, BLOCK_M)
        delta = tl.sum(out.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + rows_q.to(tl.int64) * n_heads + head, delta, mask=valid_q)
        pos_q, lowest, highest = _positions(POS, rows_q, valid_q, window)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        first_k, last_k, whole_from, whole_to = _reached_rows(POS, start, end, first, BLOCK_M, lowest, highest,
                                                             window, BLOCK_N, SCAN)
        for key_start in range(first_k, last_k, BLOCK_N):
            _, pos_k = _block_positions(POS, key_start, end, BLOCK_N)
            k, v = _key_side(K, V, key_start, end, stride_kt, stride_kh, stride_vt, stride_vh, head, cols, BLOCK_N)
            whole = _whole(key_start, whole_from, whole_to, MASK_ALL)
            p = _probabilities(q, k, pos_q, pos_k, lse, qk_scale, window, whole, WIDEN)
            ds = p * (_dot(do, tl.trans(v), WIDEN) - delta[:, None])
            dq += _dot(ds.to(k.dtype), k, WIDEN)
        tl.store(DQ + rows_q[:, None].to(tl.int64) * (n_heads * HEAD_DIM) + head * HEAD_DIM + cols[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=valid_q[:, None])


def _widened(q: torch.Tensor) -> bool:
    """Whether the kernels multiply in full fp32 (`_dot`'s WIDEN): fp32 inputs, or the Triton interpreter."""
    return INTERPRETED or q.dtype == torch.float32


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()[:2]]


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, positions, max_seqlen, window, scale, tiling, mask_all):
        rows, heads, head_dim = q.shape
        out = torch.empty(rows, heads, head_dim, device=q.device, dtype=q.dtype)
        lse = torch.empty(rows, heads, device=q.device, dtype=torch.float32)
        sequences = cu_seqlens.shape[0] - 1
        if rows:
            forward = tiling["forward"]
            _local_fwd_kernel[(triton.cdiv(max_seqlen, forward.outer), sequences, heads)](
                q, k, v, out, lse, cu_seqlens, positions, scale * LOG2_E.value, window, heads, *_strides(q, k, v, out),
                HEAD_DIM=head_dim, BLOCK_M=forward.outer, BLOCK_N=forward.inner, WIDEN=_widened(q),
                SCAN=scan_rows(forward.outer, window, forward.inner), MASK_ALL=mask_all, num_warps=forward.warps,
                num_stages=forward.stages)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, positions)
        ctx.max_seqlen, ctx.window, ctx.scale, ctx.tiling, ctx.mask_all = max_seqlen, window, scale, tiling, mask_all
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, positions = ctx.saved_tensors
        dout = dout if dout.stride(2) == 1 else dout.contiguous()
        rows, heads, head_dim = q.shape
        dq, dk, dv = torch.empty((3, rows, heads, head_dim), device=q.device, dtype=q.dtype).unbind(0)
        if rows:
            delta = torch.empty(rows, heads, device=q.device, dtype=torch.float32)  # written by the dq kernel
            sequences = cu_seqlens.shape[0] - 1
            args = (cu_seqlens, positions, ctx.scale * LOG2_E.value, ctx.scale, ctx.window, heads,
                    *_strides(q, k, v, dout))
            dkdv, by_query = ctx.tiling["dkdv"], ctx.tiling["dq"]
            _local_bwd_dq_kernel[(triton.cdiv(ctx.max_seqlen, by_query.outer), sequences, heads)](
                q, k, v, dout, out, lse, delta, dq, *args, HEAD_DIM=head_dim, BLOCK_M=by_query.outer,
                BLOCK_N=by_query.inner, WIDEN=_widened(q), SCAN=scan_rows(by_query.outer, ctx.window, by_query.inner),
                MASK_ALL=ctx.mask_all, num_warps=by_query.warps, num_stages=by_query.stages)
            _local_bwd_dkdv_kernel[(triton.cdiv(ctx.max_seqlen, dkdv.outer), sequences, heads)](
                q, k, v, dout, lse, delta, dk, dv, *args, HEAD_DIM=head_dim, BLOCK_M=dkdv.inner, BLOCK_N=dkdv.outer,
                WIDEN=_widened(q), SCAN=scan_rows(dkdv.outer, ctx.window, dkdv.inner), MASK_ALL=ctx.mask_all,
                num_warps=dkdv.warps, num_stages=dkdv.stages)
        return dq, dk, dv, None, None, None, None, None, None, None


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    positions: torch.Tensor, max_seqlen: int, window: int, scale: float | None = None,
                    tiling: dict[str, Tiles] | None = None, mask_every_block: bool = False) -> torch.Tensor:
    """Softmax attention of q [T, heads, D] over k, v [T, heads, D] (one packed stream, its sequences bounded by
    cu_seqlens [B+1] int32; D a power of two, at least 16; each tensor's last dimension contiguous) where a query sees
    the keys of its sequence whose original position (positions [T] int32, increasing within each sequence) is
    within `window` of its own; max_seqlen: the longest sequence's rows (host int). Returns [T, heads, D] in q's
    dtype. Differentiable in q, k, v. `tiling`: each kernel's Tiles, `tiles(D)` unless given (the GPU benchmark's
    candidates); `mask_every_block`: mask the pairs of every block, also of those wholly inside the window (what the
    GPU benchmark sets beside the default to time the unmasked blocks' saving)."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape or any(t.stride(2) != 1 for t in (q, k, v)):
        raise ValueError(f"local_attention: q, k, v must be [T, heads, D] of one shape, D contiguous; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    head_dim = q.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"local_attention: the head dimension must be a power of two, at least 16; got {head_dim}")
    if positions.shape != (q.shape[0],) or positions.dtype != torch.int32 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"local_attention: positions [T] and cu_seqlens [B+1] must be int32; got "
                         f"{tuple(positions.shape)} {positions.dtype}, {cu_seqlens.dtype}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return _LocalAttention.apply(q, k, v, cu_seqlens, positions, max_seqlen, window, scale,
                                 tiling or tiles(head_dim), mask_every_block)
