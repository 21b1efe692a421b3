"""Local attention over a band of row blocks: what a local layer computes on CPU (ARCHITECTURE.md section 4).

SDPA's CPU kernel computes every (query, key) pair of the padded view whatever share of them the window's mask
leaves, so a local layer cost what a global one did. Here each sequence's padded rows are cut into blocks of
`window` rows, and block i's queries are scored against the keys of blocks i-1, i and i+1 only, with the window
(by original position) as a 0 / -inf mask over that band: 3 x window keys per query instead of the whole sequence.

The band holds every key the window admits because, in every stream fastmae builds, positions increase with the
row within a sequence, by at least one a row (a shortened stream skips positions, never reorders them): a key
within `window` positions of its query is within `window` rows of it. The forward and backward are one op each
(`torch.library` custom ops with a registered autograd formula), so the band's gathers and their sums back happen
once a pass (autograd through slices would allocate and add a zero tensor of the keys' size per slice), and dynamo
takes each as one node.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Band(NamedTuple):
    """A local window over one stream's padded view [B, S] (S rounded up to whole blocks): block i of `block` rows
    (block = window) attends to blocks i-1, i, i+1; `mask` [B, 1, blocks, block, 3 * block] in the attention dtype
    holds 0 where the key is a real row of the query's sequence within `window` positions, -inf elsewhere (0 in
    the rows of padding queries, whose outputs are dropped: no row is left without a key)."""

    window: int
    mask: torch.Tensor

    @property
    def block(self) -> int:
        return self.window

    @classmethod
    def build(cls, positions: torch.Tensor, valid: torch.Tensor, window: int, dtype: torch.dtype) -> Band:
        """The band of a padded view whose rows hold `positions` [B, S] (original positions) where `valid` [B, S]."""
        batch, length = positions.shape
        block = window
        pad_rows = -length % block
        positions, valid = F.pad(positions, (0, pad_rows)), F.pad(valid, (0, pad_rows), value=False)
        queries = positions.view(batch, -1, block)  # [B, blocks, block]
        # the keys of blocks i-1, i, i+1 for each block i, with a block of padding at each end
        keys = F.pad(positions, (block, block)).unfold(1, 3 * block, block)  # [B, blocks, 3 * block]
        key_valid = F.pad(valid, (block, block), value=False).unfold(1, 3 * block, block)
        near = (keys[:, :, None, :] - queries[:, :, :, None]).abs() <= window
        keep = (near & key_valid[:, :, None, :]) | ~valid.view(batch, -1, block)[:, :, :, None]
        mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, -math.inf)
        return cls(window, mask[:, None])


def _rows_of_bands(x: torch.Tensor, block: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, blocks, 3 * block, D]: for each block the rows of its left neighbour, its own and its
    right neighbour's (zeros beyond the ends), copied."""
    batch, heads, length, dim = x.shape
    blocks = x.view(batch, heads, length // block, block, dim)
    bands = x.new_empty(batch, heads, length // block, 3, block, dim)
    bands[:, :, 1:, 0] = blocks[:, :, :-1]
    bands[:, :, 0, 0] = 0
    bands[:, :, :, 1] = blocks
    bands[:, :, :-1, 2] = blocks[:, :, 1:]
    bands[:, :, -1, 2] = 0
    return bands.view(batch, heads, length // block, 3 * block, dim)


def _sum_bands(bands: torch.Tensor, block: int) -> torch.Tensor:
    """The adjoint of `_rows_of_bands`: [B, H, blocks, 3 * block, D] -> [B, H, S, D], each row the sum of its
    three copies."""
    batch, heads, blocks, _, dim = bands.shape
    parts = bands.view(batch, heads, blocks, 3, block, dim)
    out = parts[:, :, :, 1].clone(memory_format=torch.contiguous_format)
    out[:, :, :-1].add_(parts[:, :, 1:, 0])  # block i is the left neighbour of block i + 1
    out[:, :, 1:].add_(parts[:, :, :-1, 2])  # and the right neighbour of block i - 1
    return out.view(batch, heads, blocks * block, dim)


# Custom ops with fake (shape) functions: dynamo's tracing of the slices inside them, on a view of dynamic length,
# cost ~11 s of sympy's reasoning for a 3ml model's two layer graphs on a 2-core machine (train.compile).
@torch.library.custom_op("fastmae::banded_attention_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v, block by block against the bands: (out [B, H, S, D], and what the backward
    reads: the probabilities [B*H*blocks, block, 3*block] and the bands of k and v [B*H*blocks, 3*block, D])."""
    batch, heads, length, dim = q.shape
    block = mask.shape[-2]
    blocks = length // block
    flat = batch * heads * blocks
    q_blocks = q.reshape(flat, block, dim)
    k_bands = _rows_of_bands(k, block).view(flat, 3 * block, dim)
    v_bands = _rows_of_bands(v, block).view(flat, 3 * block, dim)
    # beta 0: the matmul alone, scaled (alpha); the window's mask is then added over the heads
    scores = torch.baddbmm(q.new_zeros(()), q_blocks, k_bands.transpose(1, 2), beta=0, alpha=scale)
    scores.view(batch, heads, blocks, block, 3 * block).add_(mask)
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, v_bands).view(batch, heads, length, dim), probs, k_bands, v_bands


@torch.library.custom_op("fastmae::banded_attention_backward", mutates_args=())
def _backward(grad_out: torch.Tensor, q: torch.Tensor, probs: torch.Tensor, k_bands: torch.Tensor,
              v_bands: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v [B, H, S, D]; each band's gradient summed back onto its rows."""
    batch, heads, length, dim = q.shape
    flat, block, _ = probs.shape
    blocks = flat // (batch * heads)
    q_blocks = q.reshape(flat, block, dim)
    grad_blocks = grad_out.reshape(flat, block, dim)
    grad_probs = torch.bmm(grad_blocks, v_bands.transpose(1, 2))
    grad_v = torch.bmm(probs.transpose(1, 2), grad_blocks)
    grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
    nothing = probs.new_zeros(())  # baddbmm's input, ignored where beta is 0
    grad_q = torch.baddbmm(nothing, grad_scores, k_bands, beta=0, alpha=scale)
    grad_k = torch.baddbmm(nothing, grad_scores.transpose(1, 2), q_blocks, beta=0, alpha=scale)
    shape = (batch, heads, blocks, 3 * block, dim)
    return (grad_q.view(batch, heads, length, dim), _sum_bands(grad_k.view(shape), block),
            _sum_bands(grad_v.view(shape), block))


@_forward.register_fake
def _forward_fake(q, k, v, mask, scale):
    batch, heads, length, dim = q.shape
    block = mask.shape[-2]
    flat = batch * heads * (length // block)
    return (torch.empty_like(q), q.new_empty(flat, block, 3 * block), q.new_empty(flat, 3 * block, dim),
            q.new_empty(flat, 3 * block, dim))


@_backward.register_fake
def _backward_fake(grad_out, q, probs, k_bands, v_bands, scale):
    return torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)


def _setup_context(ctx, inputs, output):
    q, _, _, _, scale = inputs
    _, probs, k_bands, v_bands = output
    ctx.save_for_backward(q, probs, k_bands, v_bands)
    ctx.scale = scale
    ctx.mark_non_differentiable(probs, k_bands, v_bands)


def _autograd_backward(ctx, grad_out, _grad_probs, _grad_k_bands, _grad_v_bands):
    q, probs, k_bands, v_bands = ctx.saved_tensors
    return (*_backward(grad_out, q, probs, k_bands, v_bands, ctx.scale), None, None)


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + window) v over padded views q, k, v [B, H, S, D] of one stream, within `band`'s
    window; [B, H, S, D]."""
    length = q.shape[2]
    pad_rows = -length % band.block
    q, k, v = (F.pad(t, (0, 0, 0, pad_rows)) for t in (q, k, v))
    return _forward(q, k, v, band.mask, scale)[0][:, :, :length]
