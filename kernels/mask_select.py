"""Seeded selection of the masked positions and compaction of the visible stream (DESIGN.md sections 2 and 3.1).

The random numbers come from a counter-based 32-bit hash of (row, key), not from a generator, so the torch
reference here and a GPU kernel produce the same selection for the same seed, whatever the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

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


def row_uniform_bits(num_rows: int, key: int, device) -> torch.Tensor:
    """[num_rows] int64 in [0, 2^32): the hash of each row index under `key`."""
    rows = torch.arange(num_rows, dtype=torch.int64, device=device)
    return hash32((_mul32(rows, _GOLDEN) + key) & _U32)


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


def select_masked_reference(tokens: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor,
                            maskable: torch.Tensor, num_removed: torch.Tensor, num_random: torch.Tensor,
                            num_predicted: torch.Tensor, total_predicted: int, total_removed: int,
                            score_key: int, replace_key: int, vocab_size: int, mask_token_id: int,
                            first_ordinary_id: int) -> MaskSelection:
    """Choose, per sequence, exactly `num_predicted[b]` maskable rows uniformly at random (plain torch).

    tokens, seq_ids, maskable: [T] (int32, int32, bool). cu_seqlens: [B+1] int32.
    num_removed, num_random, num_predicted: [B] int64 on the tokens' device, with removed + random <= predicted
    <= maskable per sequence; total_predicted and total_removed are their sums, known on the host.
    Rows are ranked within their sequence by the hash of (row, score_key), unmaskable rows last, ties by row.
    Ranks [0, removed) are removed (input <mask>), [removed, removed + random) get a random id in
    [first_ordinary_id, vocab_size) drawn with replace_key, [.., predicted) keep their id; all of them are predicted.
    """
    num_rows = tokens.numel()
    device = tokens.device
    bits = row_uniform_bits(num_rows, score_key, device)
    sort_key = (seq_ids.to(torch.int64) << 33) | ((~maskable).to(torch.int64) << 32) | bits
    order = torch.argsort(sort_key, stable=True)
    rank = torch.empty(num_rows, dtype=torch.int64, device=device)
    rank[order] = torch.arange(num_rows, device=device) - cu_seqlens[seq_ids[order].long()].long()

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
