"""Rotary position embedding of q and k in one kernel, forward and backward.

    out[r, h, :half] = x1 * cos[r] - x2 * sin[r]      out[r, h, half:] = x2 * cos[r] + x1 * sin[r]

for x = q (tables cos_q, sin_q) and x = k (cos_k, sin_k), in fp32, rounded once to x's dtype (the rotate-half layout;
`apply_rotary_reference` in reference.py). Unfused, torch makes each of q and k in fp32, multiplies, concatenates,
negates and casts back: on an H100 those passes were a quarter of a ModernBERT-base mlm step's GPU time. Here each
program reads a tile of rows of q and of k once (every head, their last dimension contiguous, any row and head
strides: the views the QKV projection's output gives) and writes contiguous [T, heads, head_dim] rows. The backward
is the rotation by the opposite angle, the same kernel with the sine negated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import carve, cdiv, next_power_of_2, tile_launch


@triton.jit
def _rotate_rows(X, OUT, COS, SIN, rows, n_rows, stride_row, stride_head, heads, half, sign, idx):
    """`rows` [BLOCK_R] of X [n_rows, heads, 2 * half] rotated into OUT (contiguous); idx [BLOCK] runs over
    (head, feature pair)."""
    head, j = idx // half, idx % half
    mask = (rows[:, None] < n_rows) & (idx[None, :] < heads * half)
    cos = tl.load(COS + rows[:, None] * half + j[None, :], mask=mask, other=0.0)
    sin = tl.load(SIN + rows[:, None] * half + j[None, :], mask=mask, other=0.0) * sign
    src = X + rows[:, None] * stride_row + (head * stride_head + j)[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = OUT + rows[:, None] * heads * 2 * half + (head * 2 * half + j)[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, Q_OUT, K_OUT, COS_Q, SIN_Q, COS_K, SIN_K, rows_q, rows_k, stride_q_row, stride_q_head,
                   stride_k_row, stride_k_head, heads, half, sign, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    idx = tl.arange(0, BLOCK)
    _rotate_rows(Q, Q_OUT, COS_Q, SIN_Q, rows, rows_q, stride_q_row, stride_q_head, heads, half, sign, idx)
    _rotate_rows(K, K_OUT, COS_K, SIN_K, rows, rows_k, stride_k_row, stride_k_head, heads, half, sign, idx)


def rotate(q, k, cos_q, sin_q, cos_k, sin_k, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's launch (no autograd): q and k rotated by their tables' angles times `sign`, contiguous."""
    for name, x in (("q", q), ("k", k)):
        if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
            raise ValueError(f"rotary_qk: {name} must be [rows, heads, head_dim] with an even head_dim and its last "
                             f"dimension contiguous; got shape {tuple(x.shape)}, strides {x.stride()}")
    heads, head_dim = q.shape[1:]
    tables = [t.float().contiguous() for t in (cos_q, sin_q, cos_k, sin_k)]
    q_out, k_out = carve(q.device, (q.shape, q.dtype), (k.shape, k.dtype))  # contiguous, one allocation
    rows = max(q.shape[0], k.shape[0])
    block = next_power_of_2(heads * head_dim // 2)
    block_r, warps, _ = tile_launch(block)
    if rows:
        _rotary_kernel[(cdiv(rows, block_r),)](q, k, q_out, k_out, *tables, q.shape[0], k.shape[0],
                                                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads,
                                                      head_dim // 2, sign, BLOCK_R=block_r, BLOCK=block,
                                                      num_warps=warps)
    return q_out, k_out


class _RotaryQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos_q, sin_q, cos_k, sin_k):
        ctx.save_for_backward(cos_q, sin_q, cos_k, sin_k)
        return rotate(q, k, cos_q, sin_q, cos_k, sin_k, 1.0)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        # an unused output's gradient comes as zeros (autograd materialises it)
        dq, dk = rotate(grad_q.contiguous(), grad_k.contiguous(), *ctx.saved_tensors, -1.0)
        return dq, dk, None, None, None, None


def rotary_qk(q: torch.Tensor, k: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, cos_k: torch.Tensor,
              sin_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tq, heads, D] and k [Tk, heads, D] rotated by their rows' tables cos, sin [T, D / 2] (fp32), in one
    kernel; returns contiguous tensors in q's and k's dtypes. Differentiable in q and k."""
    return _RotaryQK.apply(q, k, cos_q, sin_q, cos_k, sin_k)
