"""Local attention by original position over packed varlen sequences, forward and backward, in the manner of
FlashAttention (online softmax, nothing of [T, T] stored): a query attends to the keys of its own sequence whose
original positions are at most `window` from its own.

On a stream whose rows skip positions (3ml's and mae-lm's encoder before the insertion) a window of positions is not
a window of rows, so FlashAttention's own window cannot run it exactly; these kernels mask each (query, key) pair by
their positions where a block of keys straddles the window's boundary, leave the pairs of a block wholly inside it
unmasked, and skip every block of keys whose positions all lie outside the window of every query of the block (on
any stream: on a full one it also beat FlashAttention's window, attention.CUDA_LOCAL_BACKEND). Positions must
increase within each sequence, as every fastmae stream's do (the full stream's 0, 1, 2, ...; a shortened stream's
kept positions in order): a row within `window` positions of another is then within `window` rows of it, so a
program looks only at the blocks of those rows, about (2 * window) / BLOCK_N + 2 of them however long its sequence
(the blocks: local_blocks.py).

The forward: program (block of BLOCK_M query rows, sequence, head). The backward is one kernel of FlashAttention's
five products a pair, each taken with the block of keys (or the head's dimensions) as its rows, as Hopper's wgmma
needs (k q^T, p^T do, v do^T, ds^T q, k^T ds^T = dq^T), with dq summed in a fixed order, without atomics
(deterministic): program (span of SPAN rows of a sequence, head) loops over the span's blocks of keys in order, each
over the blocks of queries its window reaches, and sums dk and dv of the block and, for the queries inside its own
span, their dq in fp32 partial sums only it touches; the keys outside its span whose window reaches its queries (a
sequence longer than the span) add their dq terms in their own loops (three products a pair: k q^T, v do^T,
k^T ds^T, recomputed: the program owning those keys computes them too, for dk and dv, and drops its dq term for
queries not its own). The span's dq is then scaled and stored in the inputs' dtype. Softmax in base 2 (`exp2`), the
log-sum-exp of each row kept for the backward. Reference: `local_attention_reference` in reference.py.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import LOG2_E, cdiv
from .local_blocks import (
    INTERPRETED,
    _block_positions,
    _dot,
    _key_side,
    _positions,
    _probabilities_t,
    _program_block,
    _query_side,
    _reached_rows,
    _rows,
    _scores,
    _whole,
    scan_rows,
)


class Tiles(NamedTuple):
    """One kernel's tiling: the rows of the block a program holds (`outer`: queries in the forward, keys in the
    backward), the rows of the blocks of the other side it loops over (`inner`), warps a program, Triton's pipeline
    stages (the inner loop's loads in flight) and, for the backward, the rows of a sequence a program takes in blocks
    of `outer` (`span`, a multiple of both blocks; the forward's programs take one block)."""

    outer: int
    inner: int
    warps: int
    stages: int = 3
    span: int = 512


KERNELS = ("forward", "backward")


def tiles(head_dim: int) -> dict[str, Tiles]:
    """Each kernel's Tiles (KERNELS) for heads of `head_dim`. As in FlashAttention's Triton backward, the backward
    holds a large block of keys and loops over small blocks of queries, its products taken with the keys as rows
    (p^T, dp^T, ds^T; dq^T with the head's dimensions as rows), as Hopper's tensor-core instruction (wgmma) needs 64
    rows or more. A span of 512 rows holds a whole sequence of the throughput benchmark's (128 x 512 full, 128 x 256
    visible), so no dq term is computed twice there. The backward's 64 x 32 at heads of 64: the H200 timed it faster
    than 64 x 16 (then the shipped tile) before the products were transposed (e63392c) and after (1a99eec); at heads
    of 32, 64 x 16 on 3 stages spills on sm_80. At heads of 128 only 8 warps on one stage compile without spills on
    sm_80. Every tiling compiles for sm_80 and sm_90 without spills (kernels/aot.py, which compiles these and every
    CANDIDATE); `benchmarks/local_attention.py` times every candidate on CUDA. Tests shrink them."""
    if head_dim <= 64:
        return {"forward": Tiles(64, 32, 4), "backward": Tiles(64, 32, 4)}
    return {"forward": Tiles(32, 32, 8), "backward": Tiles(32, 16, 8, 1)}


# What the GPU benchmark times at heads of 64 beside the shipped tiles (each compiled without spills by kernels/aot.py).
# The forward's 64 x 64 tiles on 4 warps hold twice the scores a thread of the shipped 64 x 32 (32, not 16), over
# which each step of the loop spreads its fixed work (the accumulator's rescale, the loads' addresses, the row
# reductions): on sm_90 under Triton 3.6 about 22.5 instructions a score where the shipped tile issues 26.5, at half
# the warps resident (186 registers a thread). The backward's: larger blocks of keys (128) or smaller of queries
# (16, the tile shipped until its products were transposed), on 4 or 8 warps, two pipeline stages, and spans of 256
# rows (twice the programs, each half as long, on the full stream's sequences of 512, the dq terms across a span's
# edge computed twice). 64 x 64 on 4 warps spills on both. Blocks of 32 rows held, forward and backward: a 64-row
# block spans about twice the window's positions on a shortened stream, and visits blocks beyond its rows' windows
# (`benchmarks/local_attention.products_share` gives the floor of `x global` each tiling allows), at products of
# fewer rows.
CANDIDATES = {
    "forward": (Tiles(64, 32, 8), Tiles(64, 64, 8), Tiles(128, 32, 8), Tiles(128, 64, 8), Tiles(64, 32, 4, 2),
                Tiles(64, 64, 4), Tiles(32, 32, 4)),
    "backward": (Tiles(64, 16, 4), Tiles(128, 16, 8), Tiles(64, 32, 8), Tiles(64, 32, 4, 2), Tiles(128, 32, 8),
                 Tiles(64, 32, 4, 3, 256), Tiles(32, 16, 4)),
}


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
def _add_dq(DQ_SUM, part_t, rows_q, span_start, span_end, summed_to, head, n_heads, cols, HEAD_DIM: tl.constexpr):
    """DQ_SUM [T, heads, HEAD_DIM] fp32 += part_t [HEAD_DIM, BLOCK_M] fp32 (dq^T = k^T ds^T, whose rows, HEAD_DIM,
    make it a wgmma product where ds k's block of queries would not) at those of rows_q of `head` inside the span
    (only its program touches them, in a fixed order), = part_t at those from `summed_to` on (no partial sum yet). The
    load and the store may give an element to different threads: a loop over a block of keys touches each block of
    queries once, and each step over the blocks of keys begins with a barrier (`_next_key_block`), so what one step
    stored is visible to the next; a barrier here, inside the loop over queries, would keep Triton from pipelining
    that loop's loads."""
    offsets = rows_q[None, :].to(tl.int64) * (n_heads * HEAD_DIM) + head * HEAD_DIM + cols[:, None]
    in_span = ((rows_q >= span_start) & (rows_q < span_end))[None, :]
    held = tl.load(DQ_SUM + offsets, mask=in_span & (rows_q < summed_to)[None, :], other=0.0)
    tl.store(DQ_SUM + offsets, held + part_t, mask=in_span)


@triton.jit
def _next_key_block(K, V, POS, key_start, end, stride_kt, stride_kh, stride_vt, stride_vh, head, cols, window,
                    BLOCK_N: tl.constexpr):
    """(rows, k, v, positions, the lowest and highest position their window reaches) of the block of keys from
    key_start, the backward's next, after a barrier: every dq partial sum the program stored in its step over the
    previous block is visible to all its threads before this step reads it back (`_add_dq`)."""
    tl.debug_barrier()
    rows_k = key_start + tl.arange(0, BLOCK_N)
    k, v = _key_side(K, V, key_start, end, stride_kt, stride_kh, stride_vt, stride_vh, head, cols, BLOCK_N)
    pos_k, lowest, highest = _positions(POS, rows_k, rows_k < end, window)
    return rows_k, k, v, pos_k, lowest, highest


@triton.jit
def _dq_of_keys_outside(Q, K, V, DO, OUT, LSE, DQ_SUM, POS, key_from, key_to, span_start, span_end, summed_to, start,
                        end, qk_scale, window, n_heads, head, cols, stride_qt, stride_qh, stride_kt, stride_kh,
                        stride_vt, stride_vh, stride_dot, stride_doh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, WIDEN: tl.constexpr, SCAN: tl.constexpr, MASK_ALL: tl.constexpr):
    """The dq terms that the blocks of keys from key_from to key_to (outside the program's span) give the span's
    queries their window reaches, into DQ_SUM. Returns the row below which the span's rows hold partial sums."""
    for key_start in range(key_from, key_to, BLOCK_N):
        _, k, v, pos_k, lowest, highest = _next_key_block(K, V, POS, key_start, end, stride_kt, stride_kh, stride_vt,
                                                          stride_vh, head, cols, window, BLOCK_N)
        first_q, last_q, whole_from, whole_to = _reached_rows(POS, start, end, key_start, BLOCK_N, lowest, highest,
                                                             window, BLOCK_M, SCAN)
        whole_to = tl.where(key_start + BLOCK_N <= end, whole_to, whole_from)  # keys past the end: masked, as dq sums
        for query_start in range(tl.maximum(first_q, span_start), tl.minimum(last_q, span_end), BLOCK_M):
            valid_q, pos_q = _block_positions(POS, query_start, end, BLOCK_M)
            rows_q = query_start + tl.arange(0, BLOCK_M)
            q, do, lse, delta = _query_side(Q, DO, OUT, LSE, query_start, end, rows_q, valid_q, stride_qt, stride_qh,
                                            stride_dot, stride_doh, head, n_heads, cols, BLOCK_M, HEAD_DIM)
            whole = _whole(query_start, whole_from, whole_to, MASK_ALL)
            p_t = _probabilities_t(k, q, pos_k, pos_q, lse, qk_scale, window, whole, WIDEN)
            ds_t = p_t * (_dot(v, tl.trans(do), WIDEN) - delta[None, :])
            _add_dq(DQ_SUM, _dot(tl.trans(k), ds_t.to(k.dtype), WIDEN), rows_q, span_start, span_end, summed_to,
                    head, n_heads, cols, HEAD_DIM)
        summed_to = tl.maximum(summed_to, tl.minimum(last_q, span_end))
    return summed_to


@triton.jit
def _local_bwd_kernel(Q, K, V, DO, OUT, LSE, DQ_SUM, DQ, DK, DV, CU, POS, qk_scale, scale, window, n_heads, stride_qt,
                      stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr,
                      WIDEN: tl.constexpr, SCAN: tl.constexpr, MASK_ALL: tl.constexpr):
    """Program (span of SPAN rows, sequence, head): dk and dv of the span's keys, each block's summed over the blocks
    of queries its window reaches, in order, and dq of the span's queries, summed in DQ_SUM [T, heads, HEAD_DIM] fp32
    (rows only this program touches) in a fixed order: the keys before the span, its own, the keys after it. OUT, DQ,
    DK, DV: contiguous [T, heads, HEAD_DIM]. Positions increase, so the blocks of queries a block of keys reaches
    move forward with it: a block of queries from the highest row reached so far (`summed_to`) on holds no partial
    sum of dq yet, and every block of the span's queries is reached by its own rows' keys."""
    head, start, end, span_start = _program_block(CU, SPAN)
    if span_start < end:
        span_end = tl.minimum(span_start + SPAN, end)
        cols = tl.arange(0, HEAD_DIM)
        # keys before the span within `window` rows of it (none where the span starts its sequence)
        summed_to = _dq_of_keys_outside(Q, K, V, DO, OUT, LSE, DQ_SUM, POS,
                                        start + tl.maximum(span_start - window - start, 0) // BLOCK_N * BLOCK_N,
                                        span_start, span_start, span_end, span_start, start, end, qk_scale, window,
                                        n_heads, head, cols, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                                        stride_vh, stride_dot, stride_doh, HEAD_DIM, BLOCK_M, BLOCK_N, WIDEN, SCAN,
                                        MASK_ALL)
        for key_start in range(span_start, span_end, BLOCK_N):
            rows_k, k, v, pos_k, lowest, highest = _next_key_block(K, V, POS, key_start, end, stride_kt, stride_kh,
                                                                   stride_vt, stride_vh, head, cols, window, BLOCK_N)
            dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
            first_q, last_q, whole_from, whole_to = _reached_rows(POS, start, end, key_start, BLOCK_N, lowest,
                                                                 highest, window, BLOCK_M, SCAN)
            whole_to = tl.where(key_start + BLOCK_N <= end, whole_to, whole_from)  # keys past the end: masked
            for query_start in range(first_q, last_q, BLOCK_M):
                valid_q, pos_q = _block_positions(POS, query_start, end, BLOCK_M)
                rows_q = query_start + tl.arange(0, BLOCK_M)
                q, do, lse, delta = _query_side(Q, DO, OUT, LSE, query_start, end, rows_q, valid_q, stride_qt,
                                                stride_qh, stride_dot, stride_doh, head, n_heads, cols, BLOCK_M,
                                                HEAD_DIM)
                whole = _whole(query_start, whole_from, whole_to, MASK_ALL)
                # transposed, keys as rows (`_probabilities_t`): p^T, dp^T = v do^T, ds^T, dq^T = k^T ds^T
                p_t = _probabilities_t(k, q, pos_k, pos_q, lse, qk_scale, window, whole, WIDEN)
                dv += _dot(p_t.to(do.dtype), do, WIDEN)
                ds_t = p_t * (_dot(v, tl.trans(do), WIDEN) - delta[None, :])
                dk += _dot(ds_t.to(q.dtype), q, WIDEN)
                # the span's queries only (those of another span: its own program sums them)
                _add_dq(DQ_SUM, _dot(tl.trans(k), ds_t.to(k.dtype), WIDEN), rows_q, span_start, span_end, summed_to,
                        head, n_heads, cols, HEAD_DIM)
            summed_to = tl.maximum(summed_to, tl.minimum(last_q, span_end))
            offsets = rows_k[:, None].to(tl.int64) * (n_heads * HEAD_DIM) + head * HEAD_DIM + cols[None, :]
            tl.store(DK + offsets, (dk * scale).to(DK.dtype.element_ty), mask=rows_k[:, None] < end)
            tl.store(DV + offsets, dv.to(DV.dtype.element_ty), mask=rows_k[:, None] < end)
        # keys after the span within `window` rows of it (none where the span ends its sequence)
        _dq_of_keys_outside(Q, K, V, DO, OUT, LSE, DQ_SUM, POS, span_end, tl.minimum(span_end + window, end),
                            span_start, span_end, summed_to, start, end, qk_scale, window, n_heads, head, cols,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                            HEAD_DIM, BLOCK_M, BLOCK_N, WIDEN, SCAN, MASK_ALL)
        tl.debug_barrier()  # every thread's partial sums stored before the span's are read back
        for query_start in range(span_start, span_end, BLOCK_M):
            rows_q = query_start + tl.arange(0, BLOCK_M)
            offsets = rows_q[:, None].to(tl.int64) * (n_heads * HEAD_DIM) + head * HEAD_DIM + cols[None, :]
            summed = tl.load(DQ_SUM + offsets, mask=rows_q[:, None] < span_end, other=0.0)
            tl.store(DQ + offsets, (summed * scale).to(DQ.dtype.element_ty), mask=rows_q[:, None] < span_end)


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
            _local_fwd_kernel[(cdiv(max_seqlen, forward.outer), sequences, heads)](
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
            dq_sum = torch.empty(rows, heads, head_dim, device=q.device, dtype=torch.float32)  # the kernel's alone
            backward = ctx.tiling["backward"]
            _local_bwd_kernel[(cdiv(ctx.max_seqlen, backward.span), cu_seqlens.shape[0] - 1, heads)](
                q, k, v, dout, out, lse, dq_sum, dq, dk, dv, cu_seqlens, positions, ctx.scale * LOG2_E.value,
                ctx.scale, ctx.window, heads, *_strides(q, k, v, dout), HEAD_DIM=head_dim, BLOCK_M=backward.inner,
                BLOCK_N=backward.outer, SPAN=backward.span, WIDEN=_widened(q),
                SCAN=scan_rows(backward.outer, ctx.window, backward.inner), MASK_ALL=ctx.mask_all,
                num_warps=backward.warps, num_stages=backward.stages)
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
    tiling = tiling or tiles(head_dim)
    backward = tiling["backward"]
    if backward.span % backward.outer or backward.span % backward.inner:
        raise ValueError(f"local_attention: the backward's span must be a multiple of both its blocks; got {backward}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return _LocalAttention.apply(q, k, v, cu_seqlens, positions, max_seqlen, window, scale, tiling, mask_every_block)
