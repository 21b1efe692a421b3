"""The counter-based 32-bit hash behind every masking decision (ARCHITECTURE.md section 3.1), in plain Python and torch.

The random numbers of the masking come from hashing (row, key), not from a generator, so the torch reference, the
Triton kernel and the data preparation (`fastmae prepare` keys its validation split with it) agree on any device.
No Triton here: `fastmae prepare` and the CPU path import this module where Triton is not installed.
"""

from __future__ import annotations

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


def uniform_bits(counters: torch.Tensor, key: int | torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32), one per entry of `counters` (int64 in [0, 2^32)): the hash of the counter under `key`
    (a 32-bit int, or an int64 tensor broadcast against `counters`)."""
    return hash32((_mul32(counters, _GOLDEN) + key) & _U32)


def row_uniform_bits(num_rows: int, key: int, device) -> torch.Tensor:
    """[num_rows] int64 in [0, 2^32): the hash of each row index under `key`."""
    return uniform_bits(torch.arange(num_rows, dtype=torch.int64, device=device), key)
