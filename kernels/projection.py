"""The attention's QKV projection with its backward's gathering in one kernel: the three heads' gradients into the
projection's output gradient, and its bias gradient, together.

    q, k, v = (x W^T + b) viewed as [N, 3, heads, head_dim], split on the 3    (forward: torch's addmm, its bias
                                                                                 added in the GEMM)

Unfused, autograd's backward stacks dq, dk and dv into the [N, 3H] gradient of the projection's output (one pass
over them) and sums that over its rows for the bias gradient (a second pass). Here one kernel reads dq, dk and dv once
(any strides of rows and heads, as the attention's backward leaves them) and writes the [N, 3H] gradient and, from the
same registers, each program's partial column sums (summed by `launch.sum_parts` in a fixed order: deterministic); the
input's and the weight's gradients are then the two GEMMs autograd runs. Reference: `project_qkv_reference` in
reference.py.

Both this projection and `project` (a plain x W^T, the feed-forward's input projection before bias + GELU) can take
the gradient of the residual their input also is into their input-gradient GEMM (`residual.ResidualGrad`), in place
of autograd's add of the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import BACKWARD_TILE, ROWS_PER_BIAS_PROGRAM, carve_sums, cdiv, column_block, sum_parts, tile_launch
from .pending import SlotClaim, claim_slot, defer_sums
from .residual import ResidualGrad
from .rotary import rotate


@triton.jit
def _qkv_grad_kernel(DQ, DK, DV, G, PARTS, COS, SIN, n_rows, hidden, tiles, stride_qr, stride_qh, stride_kr,
                     stride_kh, stride_vr, stride_vh, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, ROTARY: tl.constexpr):
    """Program (p, c, part): `tiles` tiles of BLOCK_R rows from row p * tiles * BLOCK_R, columns block c of `part`
    (0 q, 1 k, 2 v): G[rows, part * H + cols] = d{part}[rows, cols // HEAD_DIM, cols % HEAD_DIM] (with ROTARY, q's
    and k's rotated back by their rows' angles: the transpose of the forward's rotation), and with HAS_BIAS the
    tile's column sums into row p of PARTS [programs, 3H], accumulated per element and summed over the rows once, at
    the end."""
    pid = tl.program_id(0).to(tl.int64)
    part = tl.program_id(2)
    if part == 0:
        src, stride_r, stride_h = DQ, stride_qr, stride_qh
    elif part == 1:
        src, stride_r, stride_h = DK, stride_kr, stride_kh
    else:
        src, stride_r, stride_h = DV, stride_vr, stride_vh
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_cols = cols < hidden
    feature = cols % HEAD_DIM
    source_cols = (cols // HEAD_DIM).to(tl.int64) * stride_h + feature
    half: tl.constexpr = HEAD_DIM // 2
    first = feature < half
    rotated = in_cols & ((cols * 0 + part) < 2)  # a block-shaped condition: the interpreter needs one
    total = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for tile in range(tiles):
        rows = (pid * tiles + tile) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < n_rows) & in_cols[None, :]
        grad = tl.load(src + rows[:, None] * stride_r + source_cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ROTARY:  # d x1 = d1 cos + d2 sin, d x2 = d2 cos - d1 sin (v: cos 1, sin 0)
            turn = mask & rotated[None, :]
            pair = tl.load(src + rows[:, None] * stride_r + (source_cols + tl.where(first, half, -half))[None, :],
                           mask=turn, other=0.0).to(tl.float32)
            angle = rows[:, None] * half + (feature % half)[None, :]
            cos = tl.load(COS + angle, mask=turn, other=1.0)
            sin = tl.load(SIN + angle, mask=turn, other=0.0)
            grad = grad * cos + tl.where(first[None, :], pair, -pair) * sin
        tl.store(G + rows[:, None] * (3 * hidden) + part * hidden + cols[None, :], grad.to(G.dtype.element_ty),
                 mask=mask)
        if HAS_BIAS:
            total += grad
    if HAS_BIAS:
        tl.store(PARTS + pid * (3 * hidden) + part * hidden + cols, tl.sum(total, axis=0), mask=in_cols)


def launch(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps) of the gathering kernel for heads of `hidden` columns in all: 4 elements a
    thread (`launch.BACKWARD_TILE`)."""
    block_c = column_block(hidden)
    block_r, warps, _ = tile_launch(block_c, BACKWARD_TILE)
    return block_r, block_c, warps


def _rows_of_heads(t: torch.Tensor) -> torch.Tensor:
    """t [N, heads, head_dim] with its last dimension contiguous (a copy only where it is not)."""
    return t if t.stride(2) == 1 else t.contiguous()


def _input_grad(g: torch.Tensor, weight: torch.Tensor, residual_grad: ResidualGrad | None) -> torch.Tensor:
    """The projection's input gradient g W, with the residual's gradient a norm handed over added by the GEMM, into
    the handed tensor itself (the handoff's alone): an out-of-place addmm would first copy it into its output, a pass
    over the rows as costly as the add it saves."""
    handed = residual_grad.take() if residual_grad is not None else None
    return g @ weight if handed is None else handed.addmm_(g, weight)


def _weight_grad(g: torch.Tensor, x: torch.Tensor, slot: SlotClaim | None) -> torch.Tensor:
    """The projection's weight gradient g^T x, written into its place in the flat gradient where it has one
    (kernels/pending.py; g and x of its dtype)."""
    out = slot.take(g.dtype) if slot is not None and g.dtype == x.dtype else None
    return g.t() @ x if out is None else torch.mm(g.t(), x, out=out)


def _claimed(residual_grad: ResidualGrad | None) -> ResidualGrad | None:
    if residual_grad is not None:
        residual_grad.claim()
    return residual_grad


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual_grad):
        ctx.save_for_backward(x, weight)
        ctx.residual_grad, ctx.slot = residual_grad, claim_slot(weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dx = _input_grad(g, weight, ctx.residual_grad) if ctx.needs_input_grad[0] else None
        return dx, _weight_grad(g, x, ctx.slot) if ctx.needs_input_grad[1] else None, None


def project(x: torch.Tensor, weight: torch.Tensor, residual_grad: ResidualGrad | None = None) -> torch.Tensor:
    """x W^T (no bias) for rows x [N, H] and weight [O, H], as F.linear computes it; with `residual_grad` its input
    gradient takes in the gradient of a residual x also is (`residual.ResidualGrad`), in the same GEMM."""
    return _Project.apply(x, weight, _claimed(residual_grad))


class _ProjectQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, heads, residual_grad, cos, sin):
        rows, hidden = x.shape[0], weight.shape[0] // 3
        y = (x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t()))
        q, k, v = y.view(rows, 3, heads, hidden // heads).unbind(1)
        if cos is not None:
            q, k = rotate(q, k, cos, sin, cos, sin, 1.0)
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.heads, ctx.residual_grad, ctx.has_bias = heads, residual_grad, bias is not None
        ctx.deferral = defer_sums(bias) if bias is not None else None
        ctx.slot = claim_slot(weight)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, weight, cos, sin = ctx.saved_tensors
        rows, hidden = x.shape[0], weight.shape[0] // 3
        heads, head_dim = ctx.heads, weight.shape[0] // 3 // ctx.heads
        grads = [_rows_of_heads(d if d is not None else x.new_zeros(rows, heads, head_dim)) for d in (dq, dk, dv)]
        block_r, block_c, warps = launch(hidden)
        tiles = max(1, ROWS_PER_BIAS_PROGRAM // block_r)
        programs = cdiv(rows, tiles * block_r)
        bias_rows = programs if ctx.has_bias else 0
        (g,), dbias, parts = carve_sums(x.device, (((rows, 3 * hidden), x.dtype),),
                                        ((1, 3 * hidden if ctx.has_bias else 0), weight.dtype),
                                        ((1, bias_rows, 3 * hidden), torch.float32), ctx.deferral)
        if rows:
            tables = (cos, sin) if cos is not None else (parts, parts)  # unread without ROTARY
            _qkv_grad_kernel[(programs, cdiv(hidden, block_c), 3)](
                *grads, g, parts, *tables, rows, hidden, tiles, *[s for d in grads for s in d.stride()[:2]],
                HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_C=block_c, HAS_BIAS=ctx.has_bias, ROTARY=cos is not None,
                num_warps=warps)
        if ctx.has_bias:
            sum_parts(parts, dbias, ctx.deferral)
        dx = _input_grad(g, weight, ctx.residual_grad) if ctx.needs_input_grad[0] else None
        dweight = _weight_grad(g, x, ctx.slot) if ctx.needs_input_grad[1] else None
        return dx, dweight, dbias[0] if ctx.has_bias else None, None, None, None, None


def project_qkv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, heads: int,
                residual_grad: ResidualGrad | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), each [N, heads, H / heads]: the rows x [N, H] projected by weight [3H, H] and bias [3H] or None (one
    dtype), split as `(x W^T + b).view(N, 3, heads, -1).unbind(1)` does; with `rotary`, the (cos, sin) tables
    [N, head_dim / 2] of the rows, q and k rotated as `rotary_qk` rotates them (by the same kernel). Differentiable in
    x, weight and bias; the backward gathers the three gradients (q's and k's rotated back), and sums the bias's, in
    one kernel; with `residual_grad`, as `project`."""
    if x.dim() != 2 or weight.shape != (3 * x.shape[1], x.shape[1]) or (
            bias is not None and bias.shape != (weight.shape[0],)):
        raise ValueError(f"project_qkv: x must be [N, H], weight [3H, H] and bias [3H] or None; got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    if x.shape[1] % heads:
        raise ValueError(f"project_qkv: {heads} heads do not divide the width {x.shape[1]}")
    cos, sin = (None, None) if rotary is None else (t.float().contiguous() for t in rotary)
    return _ProjectQKV.apply(x, weight, bias, heads, _claimed(residual_grad), cos, sin)
