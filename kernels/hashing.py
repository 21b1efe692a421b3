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


def dropout_threshold(p: float) -> tuple[int, float]:
    """(threshold, scale) of the hashed dropout at probability `p` in [0, 1): an element whose hash's top 31 bits are
    below threshold = round(p * 2^31) is dropped, the others scaled by 1 / (1 - threshold / 2^31), the probability
    used (a 31-bit threshold is an int32 for Triton whatever p is: one compiled kernel)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability {p} is not in [0, 1)")
    threshold = min(round(p * 2**31), 2**31 - 1)
    return threshold, 2**31 / (2**31 - threshold)


def check_dropout_key(name: str, p: float, key: torch.Tensor | None, device: torch.device) -> None:
    """Raise ValueError naming the op `name` where dropout at probability `p` > 0 lacks its key: an int64 tensor of
    one 32-bit value on `device` (what the Triton kernels hash under)."""
    if p and (key is None or key.numel() != 1 or key.dtype != torch.int64 or key.device != device):
        raise ValueError(f"{name}: dropout_p={p} needs its key as one int64 on {device}; got "
                         f"{None if key is None else (tuple(key.shape), key.dtype, str(key.device))}")


def hashed_keep(rows: int, hidden: int, p: float, key: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(kept [rows, hidden] bool, scale): the hashed dropout of a [rows, hidden] tensor under `key` (an int64 tensor
    of one 32-bit value): element (r, c) is kept unless the top 31 bits of the hash of its counter r * hidden + c
    (mod 2^32) are below `dropout_threshold(p)`'s threshold. The Triton kernels draw the same bits (kernels/norm.py)."""
    threshold, scale = dropout_threshold(p)
    counters = torch.arange(rows * hidden, dtype=torch.int64, device=key.device).view(rows, hidden) & _U32
    return (uniform_bits(counters, key.view(1, 1)) >> 1) >= threshold, scale
