"""Local attention over a band of row blocks: what a local layer computes on CPU (ARCHITECTURE.md section 4).

SDPA's CPU kernel computes every (query, key) pair of the padded view whatever share of them the window's mask
leaves, so a local layer cost what a global one did. Here each sequence's padded rows are cut into blocks of
`window` rows, and block i's queries are scored against the keys of blocks i-1, i and i+1 only, with the window
(by original position) as a 0 / -inf mask over that band: 3 x window keys per query instead of the whole sequence.

The band holds every key the window admits because, in every stream fastmae builds, positions increase with the
row within a sequence, by at least one a row (a shortened stream skips positions, never reorders them): a key
within `window` positions of its query is within `window` rows of it. The forward and backward are one autograd
Function, so the band's gathers and their sums back happen once a pass (autograd through slices would allocate and
add a zero tensor of the keys' size per slice).
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


class _BandedAttention(torch.autograd.Function):
    """softmax(q k^T * scale + mask) v, block by block against the bands; saves q's blocks, the bands of k and v and
    the probabilities (no scores), and sums each band's gradient back onto its rows."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
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
        ctx.save_for_backward(q_blocks, k_bands, v_bands, probs)
        ctx.scale, ctx.shape = scale, (batch, heads, blocks, block, dim)
        return torch.bmm(probs, v_bands).view(batch, heads, length, dim)

    @staticmethod
    def backward(ctx, grad_out):
        q_blocks, k_bands, v_bands, probs = ctx.saved_tensors
        batch, heads, blocks, block, dim = ctx.shape
        grad_blocks = grad_out.reshape(q_blocks.shape)
        grad_probs = torch.bmm(grad_blocks, v_bands.transpose(1, 2))
        grad_v = torch.bmm(probs.transpose(1, 2), grad_blocks)
        grad_scores = torch.ops.aten._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
        nothing = probs.new_zeros(())  # baddbmm's input, ignored where beta is 0
        grad_q = torch.baddbmm(nothing, grad_scores, k_bands, beta=0, alpha=ctx.scale)
        grad_k = torch.baddbmm(nothing, grad_scores.transpose(1, 2), q_blocks, beta=0, alpha=ctx.scale)
        shape = (batch, heads, blocks, 3 * block, dim)
        return (grad_q.view(batch, heads, blocks * block, dim), _sum_bands(grad_k.view(shape), block),
                _sum_bands(grad_v.view(shape), block), None, None)


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: Band, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + window) v over padded views q, k, v [B, H, S, D] of one stream, within `band`'s
    window; [B, H, S, D]."""
    length = q.shape[2]
    pad_rows = -length % band.block
    q, k, v = (F.pad(t, (0, 0, 0, pad_rows)) for t in (q, k, v))
    return _BandedAttention.apply(q, k, v, band.mask, scale)[:, :, :length]
