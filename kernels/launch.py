"""What the row-wise kernels share (norm.py, activation.py, projection.py, rotary.py, rows.py): the tiles a
program takes, column blocks, the buffers a launch writes in one allocation, and the one kernel that adds the
per-program partial sums a backward writes (weight and bias gradients) in a fixed order, without atomics.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .pending import SUM_ENTRIES, Deferral

MAX_HIDDEN = 8192  # the largest row the launch configurations cover (kernels/aot.py checks each one)
# exp(v) = exp2(v log2 e): `tl.math.exp2` is one approximate instruction on a GPU, where `tl.exp` adds range checks
# (the row-wise kernels are bound by the instructions they issue)
LOG2_E = tl.constexpr(1.4426950408889634)


# A launch's grid and tiles from host ints: triton.cdiv and triton.next_power_of_2 are constexpr functions (Triton >=
# 3.5), whose every call from the host runs five or six Python calls (their wrapper's unwrapping of each argument);
# an eager step computes some 500 of them. These compute the same ints in one, and the launch configurations below
# (pure functions of ints) are cached: an eager step asks for them at every launch.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, as triton.cdiv."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for an int n >= 0 (0 for 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@triton.jit
def _sum_columns(PARTS, SUMS, count, programs, H, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """Columns block program_id(0) of SUMS[n] [H], n = program_id(1) < count, in SUMS's dtype: the partial sums
    PARTS[n] [programs, H] fp32 a backward's programs wrote, added in a fixed order; each thread adds its own elements
    across the blocks of partial rows and the rows are summed once at the end (no cross-thread sum inside the loop)."""
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    part = tl.program_id(1).to(tl.int64)
    width = tl.where(part < count, H, 0)  # a row past the entry's: no columns
    total = tl.zeros([BLOCK_P, BLOCK_H], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows[:, None] < programs) & (cols[None, :] < width)
        total += tl.load(PARTS + (part * programs + rows[:, None]) * H + cols[None, :], mask=mask, other=0.0)
    tl.store(SUMS + part * H + cols, tl.sum(total, axis=0).to(SUMS.dtype.element_ty), mask=cols < width)


@triton.jit
def _sum_parts_kernel(PARTS0, SUMS0, count0, programs0, H0, PARTS1, SUMS1, count1, programs1, H1,
                      PARTS2, SUMS2, count2, programs2, H2, PARTS3, SUMS3, count3, programs3, H3,
                      BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (c, n, e): `_sum_columns` of entry e, up to SUM_ENTRIES a launch: SUMS_e [count_e, H_e] from the
    partial sums PARTS_e [count_e, programs_e, H_e] (programs past an entry's rows or columns store nothing). Each
    entry a call of its own: its integers keep the JIT's specializations (a width divisible by 16: wide loads)."""
    entry = tl.program_id(2)
    if entry == 0:
        _sum_columns(PARTS0, SUMS0, count0, programs0, H0, BLOCK_P, BLOCK_H)
    elif entry == 1:
        _sum_columns(PARTS1, SUMS1, count1, programs1, H1, BLOCK_P, BLOCK_H)
    elif entry == 2:
        _sum_columns(PARTS2, SUMS2, count2, programs2, H2, BLOCK_P, BLOCK_H)
    else:
        _sum_columns(PARTS3, SUMS3, count3, programs3, H3, BLOCK_P, BLOCK_H)


# _sum_parts_kernel's tile (`sum_tile`): all of a launch's partial rows at once where they fit SUM_MAX_BLOCK_P (a norm's
# backward leaves at most 1,024 of them, norm.BACKWARD_PROGRAMS; a bias's one per ROWS_PER_BIAS_PROGRAM rows: 1,024 at
# 65,536), over as many columns as make SUM_TILE elements, 32 a thread on SUM_WARPS warps (at least 8 columns: 32 bytes
# a row, one whole sector). A program's time is a chain of rounds of loads, one a pass over its partial rows. The first
# GPU timing, at 32 x 64 on 4 warps with a cross-thread sum each step, had 12 programs at RoBERTa-base's width loop 32
# times over 1,024 partial rows: 0.07 ms a call, 1.8 ms of an mlm step on an H200; at 128 x 32 (f6d59b9) 49 calls took
# 0.93 ms of the step, about 19 us each, 72 programs looping 8 times; at 256 x 16 (e63392c) 3ml's 58 calls took 0.51
# ms, about 9 us each, looping 4 times, most of it a launch's own latency (about 2 us of it moving the data): hence
# a launch sums up to SUM_ENTRIES buffers (pending.PendingSums). In one pass a thread issues every load of its sum at
# once (untimed).
SUM_MAX_BLOCK_P, SUM_TILE, SUM_WARPS = 1024, 8192, 8


@functools.cache
def sum_tile(programs: int, hidden: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_H) of `_sum_parts_kernel` for `programs` partial rows of `hidden` columns: every row in one pass
    where they fit SUM_MAX_BLOCK_P, over the columns that make SUM_TILE elements (at least 8, at most the row's)."""
    block_p = min(SUM_MAX_BLOCK_P, next_power_of_2(max(programs, 1)))
    return block_p, min(next_power_of_2(max(hidden, 1)), max(8, SUM_TILE // block_p))


def launch_sums(entries: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`sums` [n, H] = `parts` [n, programs, H] summed over their rows for each (parts, sums) of `entries`: a launch
    of `_sum_parts_kernel` for up to SUM_ENTRIES of one sums dtype and one tile (`sum_tile`), so that each sum is the
    one a launch of its own makes, bit for bit (a tile's shape decides the order of its additions)."""
    groups: dict[tuple, list] = {}
    for parts, sums in entries:
        groups.setdefault((sums.dtype, sum_tile(*parts.shape[1:])), []).append((parts, sums))
    for (_, (block_p, block_h)), group in groups.items():
        for first in range(0, len(group), SUM_ENTRIES):
            chunk = group[first:first + SUM_ENTRIES]
            args, count, hidden = [], 0, 0  # in a plain loop: a generator's every item is a Python call of its own
            for parts, sums in chunk + chunk[:1] * (SUM_ENTRIES - len(chunk)):  # past the grid's last: never read
                args += (parts, sums, *parts.shape)
                count, hidden = max(count, parts.shape[0]), max(hidden, parts.shape[2])
            _sum_parts_kernel[(cdiv(hidden, block_h), count, len(chunk))](*args, BLOCK_P=block_p, BLOCK_H=block_h,
                                                                          num_warps=SUM_WARPS)


def carve_sums(device: torch.device, rows: tuple[tuple[tuple[int, ...], torch.dtype], ...],
               sums: tuple[tuple[int, ...], torch.dtype], parts: tuple[tuple[int, ...], torch.dtype],
               deferral: Deferral | None) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A backward's buffers by (shape, dtype): its rows' gradients `rows` in one allocation (`carve`), the parameters'
    gradients `sums` in another (they outlive the rows'), and the partial sums `parts` beside the rows' gradients
    where `sum_parts` adds them at once, beside the sums where a Deferral keeps them for a later launch."""
    if deferral is None:
        *grads, partial = carve(device, *rows, parts)
        return grads, torch.empty(sums[0], device=device, dtype=sums[1]), partial
    summed, partial = carve(device, sums, parts)
    return carve(device, *rows), summed, partial


def sum_parts(parts: torch.Tensor, sums: torch.Tensor, deferral: Deferral | None = None) -> None:
    """sums [n, H] (contiguous, any float dtype) = parts [n, programs, H] fp32, as a backward's programs wrote them,
    summed over their rows: one kernel for all n (a norm's weight and bias gradients, a projection's bias), a fixed
    order (deterministic), the cast to the dtype of `sums` in it; with a Deferral (`pending.defer_sums`) in a later
    launch with others, before anything reads `sums` (parts must then live as long as sums: `carve` them together)."""
    count, programs, hidden = parts.shape
    if sums.shape != (count, hidden) or not sums.is_contiguous():
        raise ValueError(f"sum_parts: sums must be contiguous [{count}, {hidden}]; got {tuple(sums.shape)}")
    if not (hidden and count) or (deferral is not None and deferral.pending.add(parts, sums, deferral.keys,
                                                                                launch_sums)):
        return
    launch_sums([(parts, sums)])


# Elements of a backward kernel's tile (norm.py, activation.py's bias + GELU): 4 a thread over 8 warps, where the
# forward's 2,048 put 8 a thread. A backward holds more of each element live (the gradient, the recomputed input, the
# statistics, the partial sums). Chosen when the static GPU check compiled without the JIT's specializations and
# counted 143-146 registers for the LayerNorm's backward at 8 a thread; as the GPU runs it (kernels/aot.py now
# compiles so), RoBERTa-base's post-LN backward takes 46 at 4 a thread (40 warps resident) and 72 at 8 (the 1 x 4
# tile, 28): the GPU benchmark times both (norm.CANDIDATES).
BACKWARD_TILE = 1024


# Column-blocked kernels (activation.py's bias + GELU, projection.py's QKV gathering): the columns a program takes
# at most (wide rows take several programs), and the rows a backward program sums, so that its bias gradient's
# partials stay few.
COLUMNS_PER_PROGRAM = 1024
ROWS_PER_BIAS_PROGRAM = 64
MIN_DIVIDING_BLOCK = 64  # the narrowest column block taken because it divides the row (`column_block`)


@functools.cache
def row_launch_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) for rows of `hidden` elements, a row a program (or a step of its loop), ~8 elements per
    thread (rows.py's row ops, table_grad.py's segment sums)."""
    block = next_power_of_2(hidden)
    return block, max(1, min(16, block // 256))


@functools.cache
def column_block(columns: int) -> int:
    """BLOCK_C, the columns a program of a column-blocked kernel takes, for rows of `columns`: at most
    COLUMNS_PER_PROGRAM, a power of two that divides the row where one of at least MIN_DIVIDING_BLOCK does, else the
    next power of two, its tail masked. These kernels are bound by the instructions they issue, masked lanes included:
    ModernBERT-base's GeGLU rows of 1,152 now take nine blocks of 128 where two of 1,024 left 44% of the lanes idle,
    RoBERTa-base's QKV gradient rows of 768 three blocks of 256 where one of 1,024 left a quarter."""
    block = min(next_power_of_2(columns), COLUMNS_PER_PROGRAM)
    dividing = min(columns & -columns, COLUMNS_PER_PROGRAM)  # the largest power of two dividing `columns`
    return dividing if columns % block and dividing >= MIN_DIVIDING_BLOCK else block


class RowTiles(NamedTuple):
    """A row-tiled kernel's launch (norm.py, activation.py, rotary.py): the rows of the tile a program holds at once,
    its warps, and, for a kernel whose programs loop over several tiles (bias + GELU's backward), whether each step
    loads the next tile before it computes on this one (`prefetch`): Triton pipelines only the loads that feed a
    tensor-core product, and a thread would otherwise issue the next tile's loads only after this one's stores, with
    nothing of its own in flight through the loads' latency."""

    rows: int
    warps: int
    prefetch: bool = False


@functools.cache
def tile_launch(block: int, elements: int = 2048) -> RowTiles:
    """The RowTiles of a row-tiled kernel over rows of `block` elements: a tile of about `elements` elements (at most
    64 rows) over 8 warps, at least 4 and at most 16 (the widest rows hold more a thread). Fewer, larger programs than
    one a row: also far cheaper under the interpreter."""
    rows = max(1, min(64, elements // block))
    return RowTiles(rows, max(4, min(16, rows * block * 8 // elements)))


TILED_KERNELS = ("forward", "backward")  # a row-tiled op's two kernels (norm.py's, bias + GELU's)


def tiled_pair(block: int) -> dict[str, RowTiles]:
    """The RowTiles of a row-tiled op's forward and backward kernels (TILED_KERNELS) over rows of `block` elements:
    `tile_launch`'s 8 elements a thread forward, 4 (BACKWARD_TILE) backward."""
    return {"forward": tile_launch(block), "backward": tile_launch(block, BACKWARD_TILE)}


def carve(device: torch.device, *specs: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
    """Tensors of the given (shape, dtype) as views of one allocation, each 256-byte aligned: one op for the host to
    issue however many buffers a kernel writes (benchmarks/host_overhead.py counts each allocation). The allocation
    lives while any of them does: never carve a tensor that outlives the others, as a parameter's gradient does
    (autograd holds it to the end of the backward, where flat parameters gather their views' gradients), which
    would keep a backward's rows' gradients alive with it."""
    offsets, size = [], 0
    for shape, dtype in specs:
        offsets.append(size)
        size += -(-torch.Size(shape).numel() * dtype.itemsize // 256) * 256
    buffer = torch.empty(max(size, 1), device=device, dtype=torch.uint8)
    return [buffer[start:start + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for start, (shape, dtype) in zip(offsets, specs)]
