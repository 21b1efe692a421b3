"""Seeded selection of the masked positions and compaction of the visible stream (DESIGN.md sections 2 and 3.1).

The random numbers come from a counter-based 32-bit hash of (row, key), not from a generator, so the torch
reference here and a GPU kernel produce the same selection for the same seed, whatever the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

_U32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # 2^32 / phi: spreads consecutive row indices over the 32-bit range


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 `x` in [0, 2^32), split in 16-bit halves so no product overflows int64."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _U32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on an int64 tensor holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def hash32_int(x: int) -> int:
    """`hash32` on a Python int (host side, for keys)."""
    x &= _U32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _U32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _U32
    return x ^ (x >> 16)


def mask_key(seed: int, step: int, rank: int = 0, stream: int = 0) -> int:
    """A 32-bit key that differs for every (seed, step, data-parallel rank, random stream)."""
    key = hash32_int(seed)
    for part in (step, rank, stream):
        key = hash32_int(key ^ hash32_int(part + 0x632BE5AB))
    return key


def uniform_bits(counters: torch.Tensor, key: int | torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32), one per entry of `counters` (int64 in [0, 2^32)): the hash of the counter under `key`
    (a 32-bit int, or an int64 tensor broadcast against `counters`)."""
    return hash32((_mul32(counters, _GOLDEN) + key) & _U32)


def row_uniform_bits(num_rows: int, key: int, device) -> torch.Tensor:
    """[num_rows] int64 in [0, 2^32): the hash of each row index under `key`."""
    return uniform_bits(torch.arange(num_rows, dtype=torch.int64, device=device), key)


class MaskSelection(NamedTuple):
    """What the selection produces; all int32 on the tokens' device.

    input_tokens [T]: the input ids after corruption (random replacements applied, removed rows set to <mask>).
    masked_index [T_m]: rows that are predicted, ascending; labels [T_m]: their original ids.
    visible_index [T_v]: rows that stay in the encoder stream, ascending; removed_index [T_r]: the others, ascending.
    """

    input_tokens: torch.Tensor
    masked_index: torch.Tensor
    labels: torch.Tensor
    visible_index: torch.Tensor
    removed_index: torch.Tensor


def _compact(flags: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending indices of the True entries of `flags`, whose number `count` the host already knows (no sync)."""
    slot = torch.where(flags, torch.cumsum(flags, 0) - 1, count)  # rows not taken all land in the spare slot
    out = torch.empty(count + 1, dtype=torch.int32, device=flags.device)
    out.scatter_(0, slot, torch.arange(flags.numel(), dtype=torch.int32, device=flags.device))
    return out[:count]


def rank_within_sequences(bits: torch.Tensor, seq_ids: torch.Tensor, maskable: torch.Tensor,
                          cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] int64 rank of each row within its sequence: maskable rows first, ordered by `bits` [T] (int64 in
    [0, 2^32)), ties by row; unmaskable rows after them. Choosing ranks < n picks n maskable rows at random."""
    num_rows = bits.numel()
    sort_key = (seq_ids.to(torch.int64) << 33) | ((~maskable).to(torch.int64) << 32) | bits
    order = torch.argsort(sort_key, stable=True)
    rank = torch.empty(num_rows, dtype=torch.int64, device=bits.device)
    rank[order] = torch.arange(num_rows, device=bits.device) - cu_seqlens[seq_ids[order].long()].long()
    return rank


def select_masked_reference(tokens: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor,
                            maskable: torch.Tensor, num_removed: torch.Tensor, num_random: torch.Tensor,
                            num_predicted: torch.Tensor, total_predicted: int, total_removed: int,
                            score_key: int, replace_key: int, vocab_size: int, mask_token_id: int,
                            first_ordinary_id: int, max_seqlen: int) -> MaskSelection:
    """Choose, per sequence, exactly `num_predicted[b]` maskable rows uniformly at random (plain torch).

    tokens, seq_ids, maskable: [T] (int32, int32, bool). cu_seqlens: [B+1] int32.
    num_removed, num_random, num_predicted: [B] int64 on the tokens' device, with removed + random <= predicted
    <= maskable per sequence; total_predicted and total_removed are their sums, known on the host.
    Rows are ranked within their sequence by the hash of (row, score_key), unmaskable rows last, ties by row.
    Ranks [0, removed) are removed (input <mask>), [removed, removed + random) get a random id in
    [first_ordinary_id, vocab_size) drawn with replace_key, [.., predicted) keep their id; all of them are predicted.
    max_seqlen (host int) sizes the GPU kernels' launch; the reference does not need it.
    """
    num_rows = tokens.numel()
    device = tokens.device
    rank = rank_within_sequences(row_uniform_bits(num_rows, score_key, device), seq_ids, maskable, cu_seqlens)
    seq = seq_ids.long()
    removed = rank < num_removed[seq]
    randomised = ~removed & (rank < (num_removed + num_random)[seq])
    predicted = rank < num_predicted[seq]

    random_ids = first_ordinary_id + row_uniform_bits(num_rows, replace_key, device) % (vocab_size - first_ordinary_id)
    input_tokens = torch.where(randomised, random_ids.to(tokens.dtype), tokens)
    input_tokens = torch.where(removed, torch.full_like(tokens, mask_token_id), input_tokens)
    masked_index = _compact(predicted, total_predicted)
    return MaskSelection(
        input_tokens=input_tokens,
        masked_index=masked_index,
        labels=tokens.index_select(0, masked_index),
        visible_index=_compact(~removed, num_rows - total_removed),
        removed_index=_compact(removed, total_removed),
    )


# --------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _mul32_tl(x, C: tl.constexpr):
    """(x * C) mod 2^32 for int64 x in [0, 2^32): the same split as the torch reference."""
    low = x * (C & 0xFFFF)
    high = ((x * (C >> 16)) & 0xFFFF) << 16
    return (low + high) & 0xFFFFFFFF


@triton.jit
def _hash32_tl(x):
    x = x ^ (x >> 16)
    x = _mul32_tl(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32_tl(x, 0xC2B2AE35)
    return x ^ (x >> 16)


@triton.jit
def _row_bits(rows, key_ptr):
    """int64 [BLOCK] hash of global row indices under the key at key_ptr (see row_uniform_bits)."""
    key = tl.load(key_ptr)  # a 1-element int64 tensor: no int specialisation, no signedness surprises
    return _hash32_tl((_mul32_tl(rows, 0x9E3779B1) + key) & 0xFFFFFFFF)


@triton.jit
def _sort_key(rows, valid, maskable_ptr, key):
    """Ranking key within a sequence: unmaskable rows after all maskable ones, then the hash; invalid rows last."""
    maskable = tl.load(maskable_ptr + rows, mask=valid, other=0)
    k = ((1 - maskable.to(tl.int64)) << 32) | _row_bits(rows, key)
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
                    INPUT, MASKED_INDEX, LABELS, VISIBLE_INDEX, REMOVED_INDEX, replace_key, num_ordinary,
                    MASK_ID: tl.constexpr, FIRST_ORDINARY: tl.constexpr, BLOCK: tl.constexpr):
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
        random_id = FIRST_ORDINARY + _row_bits(rows, replace_key) % num_ordinary
        new = tl.where(randomised, random_id.to(token.dtype), token)
        new = tl.where(removed, MASK_ID, new)
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
RANK_NUM_WARPS = 8  # sm_90: 101 registers at 8 warps vs 162 at 4 (python -m fastmae.kernels.aot); no spills either way
COMPACT_BLOCK = 256


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    return (torch.cumsum(counts, 0) - counts).to(torch.int64)


def select_masked(tokens: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor, maskable: torch.Tensor,
                  num_removed: torch.Tensor, num_random: torch.Tensor, num_predicted: torch.Tensor,
                  total_predicted: int, total_removed: int, score_key: int, replace_key: int, vocab_size: int,
                  mask_token_id: int, first_ordinary_id: int, max_seqlen: int) -> MaskSelection:
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
    _rank_kernel[(batch, triton.cdiv(max_seqlen, RANK_BLOCK))](
        cu_seqlens, maskable_u8, rank, keys[0:], BLOCK_I=RANK_BLOCK, BLOCK_J=RANK_BLOCK, num_warps=RANK_NUM_WARPS)
    _compact_kernel[(batch,)](
        tokens, cu_seqlens, rank, num_removed, num_random, num_predicted, _exclusive_cumsum(num_predicted),
        _exclusive_cumsum(num_removed), out.input_tokens, out.masked_index, out.labels, out.visible_index,
        out.removed_index, keys[1:], vocab_size - first_ordinary_id, MASK_ID=mask_token_id,
        FIRST_ORDINARY=first_ordinary_id, BLOCK=COMPACT_BLOCK, num_warps=4)
    return out
