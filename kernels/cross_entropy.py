"""Masked-row linear cross-entropy: the tied LM projection and the loss (ARCHITECTURE.md section 3.3).

The fused version never holds the [N, V] logits at once: rows go through in chunks; for each chunk the logits are
one matmul, a Triton kernel computes each row's loss with an online log-sum-exp over vocabulary blocks, a second
overwrites the logits with their gradient in tiles of rows and vocabulary columns, summing the bias's gradient from
the same registers, and two more matmuls fold the logits' gradient into the gradients of x and the weight
(Liger-Kernel's fused linear cross-entropy layout). Gradients are computed in the forward pass and scaled by the
incoming gradient in backward, by one kernel a gradient that reads it and writes it in its parameter's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import LOG2_E, carve, cdiv, next_power_of_2, sum_parts
from .pending import claim_slot, table_handoff

# ---------------------------------------------------------------------------------------------------- kernel


@triton.jit
def _ce_rows_kernel(LOGITS, stride_logits, LABELS, LOSS, ROW_MAX, ROW_SCALE, V, ignore_index, smoothing, z_loss,
                    COMPUTE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row: the loss from an online log-sum-exp over vocabulary blocks; where COMPUTE_GRAD, the row's max and the
    factor its exponentials take in d loss / d logits (`_ce_grad_kernel` reads them; 0 and 0 for an ignored row)."""
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_logits
    label = tl.load(LABELS + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)  # [BLOCK_V]
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            tl.store(ROW_MAX + row, 0.0)
            tl.store(ROW_SCALE + row, 0.0)
    else:
        running_max = float("-inf")
        running_sum = 0.0
        logit_sum = 0.0
        for v0 in range(0, V, BLOCK_V):
            mask = v0 + cols < V
            z = tl.load(ptr + v0 + cols, mask=mask, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            running_sum = (running_sum * tl.exp(running_max - new_max)
                           + tl.sum(tl.math.exp2((z - new_max) * LOG2_E), axis=0))
            running_max = new_max
            logit_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
        lse = running_max + tl.log(running_sum)
        z_label = tl.load(ptr + label).to(tl.float32)
        loss = lse - (1.0 - smoothing) * z_label - smoothing * logit_sum / V + z_loss * lse * lse
        tl.store(LOSS + row, loss)
        if COMPUTE_GRAD:
            # exp(z - max) / sum, not exp(z - lse): lse's rounding (~|lse| ulps) would bias every entry of the row;
            # the division once a row (a division an element is several instructions, and these are issue-bound)
            tl.store(ROW_MAX + row, running_max)
            tl.store(ROW_SCALE + row, (1.0 + 2.0 * z_loss * lse) / running_sum)


@triton.jit
def _ce_grad_kernel(LOGITS, stride_logits, LABELS, ROW_MAX, ROW_SCALE, BIAS_PARTS, n_rows, V, group_rows,
                    ignore_index, smoothing, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (c, g): vocabulary block c of rows g * group_rows on (at most group_rows of them, n_rows in all), each
    logit <- d loss_row / d logit (the row's exponentials times its factor, less the label's smoothed one-hot; zeros
    for an ignored row); where HAS_BIAS, the block's sums of those gradients over the group's rows (the bias's
    gradient) into row g of BIAS_PARTS [groups, V], accumulated per element of the tile and summed over its rows
    once, at the end (a fixed order, no atomics)."""
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = cols < V
    first = tl.program_id(1).to(tl.int64) * group_rows
    end = tl.minimum(first + group_rows, n_rows)
    column_sums = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
    for start in range(first, end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        label = tl.load(LABELS + rows, mask=rows < end, other=ignore_index).to(tl.int64)
        counted = (rows < end) & (label != ignore_index)
        row_max = tl.load(ROW_MAX + rows, mask=counted, other=0.0)[:, None]
        row_scale = tl.load(ROW_SCALE + rows, mask=counted, other=0.0)[:, None]
        mask = (rows < end)[:, None] & in_vocab[None, :]
        offsets = rows[:, None] * stride_logits + cols[None, :]
        z = tl.load(LOGITS + offsets, mask=mask, other=0.0).to(tl.float32)
        grad = tl.math.exp2((z - row_max) * LOG2_E) * row_scale - smoothing / V
        grad = tl.where(cols[None, :] == label[:, None], grad - (1.0 - smoothing), grad)
        grad = tl.where(counted[:, None] & in_vocab[None, :], grad, 0.0)
        tl.store(LOGITS + offsets, grad.to(LOGITS.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            column_sums += grad
    if HAS_BIAS:
        tl.store(BIAS_PARTS + tl.program_id(1).to(tl.int64) * V + cols, tl.sum(column_sums, axis=0), mask=in_vocab)


@triton.jit
def _scale_kernel(SRC, DST, FACTOR, n_elements, BLOCK: tl.constexpr):
    """DST = SRC * FACTOR[0] over n_elements, in fp32, stored in DST's dtype (torch's mul with a 16-bit output and an
    fp32 input takes its unvectorized mixed-dtype path: 1.5 TB/s on an H200 where a copy moves 4.2)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    src = tl.load(SRC + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(DST + offsets, (src * tl.load(FACTOR)).to(DST.dtype.element_ty), mask=mask)


SCALE_BLOCK, SCALE_WARPS = 4096, 8  # 16 elements a thread


def scaled(src: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """src (contiguous) times the fp32 one-element `factor`, computed in fp32, in `out` (contiguous, src's shape) or
    a new tensor of `dtype`."""
    if out is None:
        out = torch.empty(src.shape, device=src.device, dtype=dtype)
    if src.numel():
        _scale_kernel[(cdiv(src.numel(), SCALE_BLOCK),)](src, out, factor, src.numel(), BLOCK=SCALE_BLOCK,
                                                                 num_warps=SCALE_WARPS)
    return out


CE_BLOCK_V = 4096  # vocabulary block of the online log-sum-exp
CE_NUM_WARPS = 8  # 4096 / (8 * 32) = 16 fp32 per thread
# The gradient kernel's tile, 4 rows x 1,024 columns over 8 warps (16 elements a thread), and the rows a program
# sums the bias's gradient over: at 256, RoBERTa-base's 3ml (32,768 predicted rows, 50,265 pieces) leaves 128 rows of
# fp32 partial sums (26 MB, written and read once), where torch's sum read each chunk's 206 MB of logits again.
CE_GRAD_BLOCK_R, CE_GRAD_BLOCK_V, CE_GRAD_WARPS = 4, 1024, 8
CE_GROUP_ROWS = 256


CE_VOCAB_ALIGN = 64
"""The logits' row length is padded to a multiple of this: at an odd vocabulary (RoBERTa's 50,265) cuBLAS finds no
aligned kernel and falls back to slow ones (measured on an H100: sm75 `align1` GEMMs, 10% of peak)."""
CE_MIN_CHUNK_ROWS = 32  # single-row chunks turn the gradient matmuls into gemv: ~5x the fp32 error of one GEMM on CPU
CE_CHUNK_BYTES = 256 * 2**20
"""Memory budget of one chunk's logits (in the compute dtype). Every chunk re-reads the [V, H] weight and adds into
the [V, H] fp32 weight gradient, so fewer, larger chunks move less memory: at T_m = 8,192, V = 50,265 in bf16 this is
4 chunks of 2,048 rows (206 MB of logits each), where sizing chunks like x itself gave 64 chunks of 128 rows."""


def chunk_rows(num_rows: int, vocab: int, element_bytes: int, budget: int) -> int:
    """Rows per chunk: the largest power of two whose [rows, vocab] logits fit `budget` bytes, at least
    CE_MIN_CHUNK_ROWS and at most num_rows rounded up to a power of two."""
    fit = max(1, budget // (vocab * element_bytes))
    return max(CE_MIN_CHUNK_ROWS, min(1 << (fit.bit_length() - 1), next_power_of_2(max(num_rows, 1))))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x, weight, bias, labels, ignore_index, label_smoothing, z_loss, needs_grad, num_counted):
        num_rows, hidden = x.shape
        vocab = weight.shape[0]
        compute_dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        # zero rows pad the vocabulary to an aligned size: their logits are 0, which the kernel never reads (it stops
        # at `vocab`) and which add nothing to grad_x; their gradient rows are cut off at the end
        pad = -vocab % CE_VOCAB_ALIGN
        x_c, w_c = x.to(compute_dtype), _pad_rows(weight.to(compute_dtype), pad)
        b_c = None if bias is None else _pad_rows(bias.to(compute_dtype), pad)
        labels = labels.contiguous()
        if num_counted is None:
            scale = 1.0 / (labels != ignore_index).sum().clamp(min=1).float()  # stays on the device: no sync
        else:  # the caller's host count: no device op
            scale = 1.0 / max(num_counted, 1)
        # each row's loss and, for the gradient kernel, its max and factor: one allocation
        stats = (num_rows if needs_grad else 0,)
        loss_rows, row_max, row_scale = carve(x.device, ((num_rows,), torch.float32), (stats, torch.float32),
                                              (stats, torch.float32))
        # x's gradient in the compute dtype, written by its GEMM (an fp32 copy of a 16-bit product holds nothing
        # more); the weight's in fp32, which the first chunk writes and the others add into, and the bias's summed
        # from the gradient kernel's partial sums (a vocabulary without rows gets zeros)
        grad_x = torch.empty(x.shape, device=x.device, dtype=compute_dtype) if needs_grad else None
        empty = torch.zeros if num_rows == 0 else torch.empty
        grad_w = empty(w_c.shape, device=x.device, dtype=torch.float32) if needs_grad else None
        chunk = chunk_rows(num_rows, vocab + pad, w_c.element_size(), CE_CHUNK_BYTES)
        group_rows = min(CE_GROUP_ROWS, chunk)
        groups = [cdiv(min(chunk, num_rows - start), group_rows) for start in range(0, num_rows, chunk)]
        grad_b = bias_parts = None
        if needs_grad and bias is not None:  # one group in all writes the sums themselves
            grad_b = empty(vocab, device=x.device, dtype=torch.float32)
            bias_parts = grad_b.view(1, vocab) if sum(groups) <= 1 else \
                torch.empty(sum(groups), vocab, device=x.device, dtype=torch.float32)
        block_v = min(CE_BLOCK_V, next_power_of_2(vocab))
        grad_block_v = min(CE_GRAD_BLOCK_V, next_power_of_2(vocab))
        first_group = 0
        for start, chunk_groups in zip(range(0, num_rows, chunk), groups):
            stop = min(start + chunk, num_rows)
            x_chunk = x_c[start:stop]
            logits = F.linear(x_chunk, w_c, b_c).contiguous()  # [chunk, V + pad]: the only logits alive
            _ce_rows_kernel[(stop - start,)](
                logits, logits.stride(0), labels[start:stop], loss_rows[start:stop], row_max[start:stop],
                row_scale[start:stop], vocab, ignore_index, label_smoothing, z_loss, COMPUTE_GRAD=needs_grad,
                BLOCK_V=block_v, num_warps=CE_NUM_WARPS)
            if needs_grad:
                _ce_grad_kernel[(cdiv(vocab, grad_block_v), chunk_groups)](
                    logits, logits.stride(0), labels[start:stop], row_max[start:stop], row_scale[start:stop],
                    row_max if bias_parts is None else bias_parts[first_group:], stop - start, vocab, group_rows,
                    ignore_index, label_smoothing, HAS_BIAS=bias_parts is not None, BLOCK_R=CE_GRAD_BLOCK_R,
                    BLOCK_V=grad_block_v, num_warps=CE_GRAD_WARPS)
                first_group += chunk_groups
                # logits now hold d loss_row / d logits (unscaled)
                torch.mm(logits, w_c, out=grad_x[start:stop])
                _add_transposed_product(grad_w, logits, x_chunk, first=start == 0)
        if bias_parts is not None and bias_parts.shape[0] > 1:
            sum_parts(bias_parts[None], grad_b[None])
        if needs_grad:
            grad_w = grad_w[:vocab]
        ctx.save_for_backward(grad_x, grad_w, grad_b)
        # the weight's gradient goes into its place in a flat gradient, or to the embedding lookup it is tied to,
        # whose backward adds the table's into it (kernels/pending.py)
        ctx.slot, ctx.table = claim_slot(weight), table_handoff(weight)
        ctx.scale = scale
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss_rows.sum() * scale

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad_loss):
        grad_x, grad_w, grad_b = ctx.saved_tensors
        factor = (grad_loss.float() * ctx.scale).reshape(1)  # 1 / rows x the incoming gradient, applied in fp32
        # each product in fp32, written in the gradient's dtype by the same kernel (no fp32 product, then a cast),
        # each into an allocation of its own: the parameters' gradients outlive the rows' (`launch.carve`)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dx = None if grad_x is None else scaled(grad_x, factor, x_dtype)
        db = None if grad_b is None else scaled(grad_b, factor, b_dtype)
        dw = None
        if grad_w is not None:
            dw = scaled(grad_w, factor, w_dtype, None if ctx.slot is None else ctx.slot.take(w_dtype))
            if ctx.table is not None and ctx.table.hand(dw):
                dw = None  # the embedding lookup's backward returns it, with the table's gradient added
        return dx, dw, db, None, None, None, None, None, None


def _pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """`t` with `pad` zero rows appended along dim 0; `t` itself when there are none (F.pad would still copy)."""
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) if pad else t


def _add_transposed_product(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """accumulator (fp32) += a^T @ b in place, or = where `first` (the GEMM ignores what the buffer held: no zero
    fill). In fp32 one addmm; in 16 bits on CUDA one addmm with an fp32 output (cuBLAS accumulates into the fp32
    buffer: no temporary, no rounding of the product). On CPU, which has no such addmm, the 16-bit product is formed
    first (one [V, H] temporary per chunk, rounded once more) and added into the buffer as it is."""
    beta = 0 if first else 1
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a.t(), b, beta=beta)
    elif accumulator.is_cuda:
        torch.addmm(accumulator, a.t(), b, out_dtype=accumulator.dtype, beta=beta, out=accumulator)
    elif first:
        accumulator.copy_(a.t() @ b)
    else:
        accumulator.add_(a.t() @ b)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         num_counted: int | None = None) -> torch.Tensor:
    """`linear_cross_entropy_reference` fused (Triton): same arguments and result, logits held one chunk at a time.

    Under CUDA autocast the matmuls run in the autocast dtype; loss and softmax in fp32.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or labels.shape != x.shape[:1]:
        raise ValueError(f"linear_cross_entropy: shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, labels "
                         f"{tuple(labels.shape)} do not fit [N, H], [V, H], [N]")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))  # evaluation under no_grad computes no gradients
    return _LinearCrossEntropy.apply(x, weight, bias, labels, ignore_index, label_smoothing, z_loss, needs_grad,
                                     num_counted)
