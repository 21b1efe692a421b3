"""Seeded selection of the masked positions and compaction of the visible stream (ARCHITECTURE.md sections 2 and 3.1),
as Triton kernels.

The random numbers come from the counter-based 32-bit hash of kernels/hashing.py, not from a generator, so the torch
reference (kernels/reference.py) and these kernels produce the same selection for the same seed, whatever the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv
from .reference import MaskSelection

# --------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _hash32_tl(x):
    """murmur3's 32-bit finaliser on uint32 `x`: uint32 products wrap mod 2^32 and shifts are logical, so this is
    `hashing.hash32` bit for bit in the GPU's native 32-bit integer ops (64-bit products cost several each)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def uniform_bits_u32(counters, key_ptr):
    """uint32 hash of `counters` (any integer type; taken mod 2^32) under the key at key_ptr (a 1-element int64
    tensor: no int specialisation, no signedness surprises): `hashing.uniform_bits`."""
    key = tl.load(key_ptr).to(tl.uint32)
    return _hash32_tl(counters.to(tl.uint32) * 0x9E3779B1 + key)


@triton.jit
def dropout_kept(counters, key_ptr, threshold):
    """bool: the elements of counters r * H + c (taken mod 2^32) that the hashed dropout keeps, the top 31 bits of
    their hash at or above `hashing.dropout_threshold`'s threshold (`hashing.hashed_keep`, the torch reference)."""
    return (uniform_bits_u32(counters, key_ptr) >> 1) >= threshold


@triton.jit
def uniform_bits_tl(counters, key_ptr):
    """`uniform_bits_u32` as int64 in [0, 2^32) (global row indices in, sort keys and ids out)."""
    return uniform_bits_u32(counters, key_ptr).to(tl.int64)


@triton.jit
def _sort_key(rows, valid, maskable_ptr, key):
    """Ranking key within a sequence: unmaskable rows after all maskable ones, then the hash; invalid rows last."""
    maskable = tl.load(maskable_ptr + rows, mask=valid, other=0)
    k = ((1 - maskable.to(tl.int64)) << 32) | uniform_bits_tl(rows, key)
    return tl.where(valid, k, 0x7FFFFFFFFFFFFFFF)


@triton.jit
def _rank_kernel(cu_seqlens, maskable_ptr, RANK, score_key, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    length = tl.load(cu_seqlens + seq + 1).to(tl.int64) - start
    i0 = tl.program_id(1).to(tl.int64) * BLOCK_I
    if i0 < length:
        local_i = i0 + tl.arange(0, BLOCK_I)  # [BLOCK_I]
        valid_i = local_i < length
        key_i = _sort_key(start + local_i, valid_i, maskable_ptr, score_key)
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, length, BLOCK_J):
            local_j = j0 + tl.arange(0, BLOCK_J)  # [BLOCK_J]
            key_j = _sort_key(start + local_j, local_j < length, maskable_ptr, score_key)
            before = (key_j[None, :] < key_i[:, None]) | (
                (key_j[None, :] == key_i[:, None]) & (local_j[None, :] < local_i[:, None]))  # [BLOCK_I, BLOCK_J]
            rank += tl.sum(before.to(tl.int32), axis=1)
        tl.store(RANK + start + local_i, rank, mask=valid_i)


@triton.jit
def _compact_kernel(tokens, cu_seqlens, RANK, num_removed, num_random, num_predicted, masked_start, removed_start,
                    INPUT, MASKED_INDEX, LABELS, VISIBLE_INDEX, REMOVED_INDEX, replace_key, ORDINARY, num_ordinary,
                    mask_token_id, BLOCK: tl.constexpr):
    seq = tl.program_id(0)
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    length = tl.load(cu_seqlens + seq + 1).to(tl.int64) - start
    n_removed = tl.load(num_removed + seq)
    n_changed = n_removed + tl.load(num_random + seq)
    n_predicted = tl.load(num_predicted + seq)
    next_masked = tl.load(masked_start + seq)
    next_removed = tl.load(removed_start + seq)
    next_visible = start - next_removed  # visible rows of earlier sequences: all their rows minus removed ones
    for i0 in range(0, length, BLOCK):
        local = i0 + tl.arange(0, BLOCK)  # [BLOCK]
        valid = local < length
        rows = start + local
        rank = tl.load(RANK + rows, mask=valid, other=0x7FFFFFFF)
        token = tl.load(tokens + rows, mask=valid, other=0)
        removed = valid & (rank < n_removed)
        randomised = valid & (rank >= n_removed) & (rank < n_changed)
        predicted = valid & (rank < n_predicted)
        visible = valid & (rank >= n_removed)
        random_id = tl.load(ORDINARY + uniform_bits_tl(rows, replace_key) % num_ordinary, mask=randomised, other=0)
        new = tl.where(randomised, random_id.to(token.dtype), token)
        new = tl.where(removed, mask_token_id, new)
        tl.store(INPUT + rows, new, mask=valid)
        # each kind's rows keep their order: slot = rows of that kind before this one
        p = predicted.to(tl.int32)
        slot = next_masked + tl.cumsum(p, axis=0) - p
        tl.store(MASKED_INDEX + slot, rows.to(tl.int32), mask=predicted)
        tl.store(LABELS + slot, token, mask=predicted)
        next_masked += tl.sum(p, axis=0)
        d = removed.to(tl.int32)
        slot = next_removed + tl.cumsum(d, axis=0) - d
        tl.store(REMOVED_INDEX + slot, rows.to(tl.int32), mask=removed)
        next_removed += tl.sum(d, axis=0)
        v = visible.to(tl.int32)
        slot = next_visible + tl.cumsum(v, axis=0) - v
        tl.store(VISIBLE_INDEX + slot, rows.to(tl.int32), mask=visible)
        next_visible += tl.sum(v, axis=0)


RANK_BLOCK = 64  # [64, 64] int64 comparison tiles
RANK_NUM_WARPS = 8  # sm_90: 99 registers at 8 warps vs 162 at 4 (python -m fastmae.kernels.aot); no spills either way
COMPACT_BLOCK = 256


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return (torch.cumsum(counts, 0) - counts).to(torch.int64)


def select_masked(tokens: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor, maskable: torch.Tensor,
                  num_removed: torch.Tensor, num_random: torch.Tensor, num_predicted: torch.Tensor,
                  total_predicted: int, total_removed: int, score_key: int, replace_key: int,
                  mask_token_id: int, ordinary_ids: torch.Tensor, max_seqlen: int) -> MaskSelection:
    """`select_masked_reference` as two Triton kernels: per-sequence ranks by pairwise comparison, then per-sequence
    compaction into the masked / visible / removed streams. Same arguments and bit-identical results;
    `max_seqlen` (host int) sizes the launch grid. seq_ids is not needed here (sequences are programs).
    """
    num_rows = tokens.numel()
    device = tokens.device
    batch = cu_seqlens.numel() - 1
    rank = torch.empty(num_rows, dtype=torch.int32, device=device)
    keys = torch.tensor([score_key, replace_key], dtype=torch.int64).to(device, non_blocking=True)
    out = MaskSelection(
        input_tokens=torch.empty_like(tokens),
        masked_index=torch.empty(total_predicted, dtype=torch.int32, device=device),
        labels=torch.empty(total_predicted, dtype=tokens.dtype, device=device),
        visible_index=torch.empty(num_rows - total_removed, dtype=torch.int32, device=device),
        removed_index=torch.empty(total_removed, dtype=torch.int32, device=device),
    )
    if num_rows == 0:
        return out
    maskable_u8 = maskable.to(torch.uint8)
    _rank_kernel[(batch, cdiv(max_seqlen, RANK_BLOCK))](
        cu_seqlens, maskable_u8, rank, keys[0:], BLOCK_I=RANK_BLOCK, BLOCK_J=RANK_BLOCK, num_warps=RANK_NUM_WARPS)
    _compact_kernel[(batch,)](
        tokens, cu_seqlens, rank, num_removed, num_random, num_predicted, _exclusive_cumsum(num_predicted),
        _exclusive_cumsum(num_removed), out.input_tokens, out.masked_index, out.labels, out.visible_index,
        out.removed_index, keys[1:], ordinary_ids, ordinary_ids.numel(), mask_token_id, BLOCK=COMPACT_BLOCK,
        num_warps=4)
    return out
