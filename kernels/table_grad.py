"""The gradient of an embedding table from per-row gradients: rows that read the same table row add up.

An embedding lookup's backward on CUDA in torch (`embedding_dense_backward`) sorts the ids, then runs about a dozen
kernels of its own: unique ids, segments cut into partial segments of a few rows, a scan, the partial sums, their
scatter, and an fp32 [V, H] table zeroed and then cast. At RoBERTa-base's step on an H200 that was about 0.5 ms and
25 kernels (the sort 13 of them) for the token table of 3ml's 32,768 encoder rows (e63392c's trace), and 0.09-0.13
ms and 22 kernels for each position table.

Here (ARCHITECTURE.md section 3.2) the ids are sorted by torch (stable, so equal ids keep their rows' order), the
table's gradient is zeroed in its own dtype (or is a given one the sums are added into, ACCUMULATE: the tied LM
head's, kernels/pending.py), and two kernels sum each id's rows in that order:

    `_segment_sums_kernel`  program j takes sorted rows [j R, (j + 1) R) and walks them in order, summing each run of
                            equal ids in fp32: a run that starts and ends inside the program is written to its table
                            row; the piece of a run that began before the program goes to HEAD[j], that of a run
                            that began inside it and goes on past its end to TAIL[j]
    `_segment_carry_kernel` the program whose TAIL holds a run's start adds the HEADs of the programs the run goes
                            on into, BLOCK_K of them a step (their loads in flight together; each tile row summed
                            in order, the rows at the end), and writes the run's table row

Each table row is written by one program, in a fixed order: no atomics, deterministic. A run as long as mlm's
`<mask>` id (15-30% of the rows) is summed by many programs in parallel, R rows each, and added up by one (torch's
`index_put_(accumulate=True)`, deterministic too, adds an id's rows one after another: that id made it 5.7 ms of a
RoBERTa-base step on an H200).
The optional `extra_row` (the insertion's `<mask>` row, read by the forward beside the lookup) sorts in as one more
row, the last of its run, whose gradient is `d_extra`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import MAX_HIDDEN, cdiv, next_power_of_2, row_launch_config

ROWS_PER_PROGRAM = 32
"""Sorted rows a `_segment_sums_kernel` program walks: at RoBERTa-base's step 1,024 (3ml, 32,768 encoder rows) to
2,048 programs (mlm), each a chain of row loads one after another."""


@triton.jit
def _run_bounds(SID, j, n_ids, R: tl.constexpr):
    """Program j's sorted rows [a, b), its first and last ids, and whether the run of its first id began before a
    (HEAD) and that of its last id goes on past b (TAIL)."""
    a = j * R
    b = tl.minimum(a + R, n_ids)
    first = tl.load(SID + a)
    last = tl.load(SID + b - 1)
    head = (j > 0) & (tl.load(SID + a - 1, mask=j > 0, other=0) == first)
    tail = (b < n_ids) & (tl.load(SID + b, mask=b < n_ids, other=0) == last)
    return a, b, first, last, head, tail


@triton.jit
def _write_row(ptrs, acc, mask, ACCUMULATE: tl.constexpr):
    """A table row's sum `acc` (fp32) stored in the table's dtype or, with ACCUMULATE, added to the row there as
    autograd adds two gradients: each in the table's dtype, their sum in fp32, rounded once."""
    dtype = ptrs.dtype.element_ty
    value = acc.to(dtype)
    if ACCUMULATE:
        value = (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + value.to(tl.float32)).to(dtype)
    tl.store(ptrs, value, mask=mask)


@triton.jit
def _segment_sums_kernel(ROWS, EXTRA, SID, ORDER, GRAD, HEAD, TAIL, n_rows, n_ids, H, stride_rows, stride_grad,
                         HAS_EXTRA: tl.constexpr, ACCUMULATE: tl.constexpr, R: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    a, b, first, last, head, tail = _run_bounds(SID, j, n_ids, R)
    cur = first
    in_first = tl.full([], 1, tl.int32)  # whether the run being summed is the program's first
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    row = tl.load(ORDER + a)  # loaded a step ahead: a row's load waits on no load of its index
    for i in range(R):
        s = a + i
        if s < b:
            ahead = tl.load(ORDER + s + 1, mask=s + 1 < b, other=0)
            x = tl.load(ROWS + row * stride_rows + cols, mask=mask & ((cols * 0 + row) < n_rows),
                        other=0.0).to(tl.float32)
            if HAS_EXTRA:  # the sorted-in extra row is row n_rows
                x += tl.load(EXTRA + cols, mask=mask & ((cols * 0 + row) == n_rows), other=0.0).to(tl.float32)
            sid = tl.load(SID + s)
            if sid != cur:  # cur's run ended at s: its sum is whole unless it is the program's first and began before
                if (in_first == 1) & head:
                    tl.store(HEAD + j * H + cols, acc, mask=mask)
                else:
                    _write_row(GRAD + cur.to(tl.int64) * stride_grad + cols, acc, mask, ACCUMULATE)
                acc = x
                cur = sid
                in_first = tl.full([], 0, tl.int32)
            else:
                acc += x
            row = ahead
    if (in_first == 1) & head:  # one run over the whole program, begun before it
        tl.store(HEAD + j * H + cols, acc, mask=mask)
    elif tail:
        tl.store(TAIL + j * H + cols, acc, mask=mask)
    else:
        _write_row(GRAD + cur.to(tl.int64) * stride_grad + cols, acc, mask, ACCUMULATE)


@triton.jit
def _segment_carry_kernel(SID, GRAD, HEAD, TAIL, n_ids, n_programs, H, stride_grad, ACCUMULATE: tl.constexpr,
                          R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    a, b, first, last, head, tail = _run_bounds(SID, j, n_ids, R)
    if tail & ((first != last) | (head == 0)):  # the run of `last` began in this program and goes on
        # the HEADs of the programs after j whose first row is still the run (the ids are sorted), BLOCK_K programs a
        # step, their loads all in flight at once: mlm's `<mask>` run spans hundreds of programs
        total = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
        k = j + 1
        going = tl.full([], 1, tl.int32)
        while going == 1:
            ks = k + tl.arange(0, BLOCK_K)
            in_run = (ks < n_programs) & (tl.load(SID + ks * R, mask=ks < n_programs, other=0) == last)
            total += tl.load(HEAD + ks[:, None] * H + cols[None, :], mask=in_run[:, None] & mask[None, :],
                             other=0.0)
            k += BLOCK_K
            going = ((k < n_programs) & (tl.load(SID + k * R, mask=k < n_programs, other=0) == last)).to(tl.int32)
        acc = tl.load(TAIL + j * H + cols, mask=mask, other=0.0) + tl.sum(total, axis=0)
        _write_row(GRAD + last.to(tl.int64) * stride_grad + cols, acc, mask, ACCUMULATE)


def carry_config(hidden: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of `_segment_carry_kernel` for rows of `hidden` elements: tiles of BLOCK_K HEAD rows, 32
    elements a thread (8 rows on 8 warps at 1,024: hundreds of programs' pieces in a few dozen steps)."""
    block = next_power_of_2(hidden)
    warps = max(1, min(8, block // 128))
    return max(1, min(16, 32 * 32 * warps // block)), warps


def workspace_shape(n_rows: int, hidden: int, rows_per_program: int = ROWS_PER_PROGRAM) -> tuple[int, int, int]:
    """The fp32 scratch `table_gradient` takes for `n_rows` rows of `hidden` (and an extra row): HEAD and TAIL, a row
    each per program. One workspace serves a backward's calls one after another (kernels on one stream)."""
    return 2, cdiv(n_rows + 1, rows_per_program), hidden


def table_gradient(rows: torch.Tensor, ids: torch.Tensor, num_table_rows: int, dtype: torch.dtype,
                   extra_row: int | None = None, d_extra: torch.Tensor | None = None,
                   workspace: torch.Tensor | None = None, rows_per_program: int = ROWS_PER_PROGRAM,
                   out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """[num_table_rows, H] in `dtype`: row v the sum (in fp32, cast once) of the rows of `rows` [N, H] (a float
    dtype) whose `ids` [N] (int32 or int64) are v, plus `d_extra` [H] at row `extra_row` where given; rows no id
    names are zero. Deterministic: each id's rows are added in their order, then the extra row. `workspace`: an fp32
    tensor of `workspace_shape` (its rows per program alike), carved beside the caller's buffers, else allocated.
    `out`: a contiguous [num_table_rows, H] tensor of `dtype` written (zero-filled first) and returned, or with
    `accumulate` added to as autograd adds a second gradient to a first (`_write_row`), its rows no id names kept."""
    if rows.dim() != 2 or not rows.is_floating_point() or ids.shape != rows.shape[:1]:
        raise ValueError(f"table_gradient: expected float rows [N, H] and ids [N]; got rows {tuple(rows.shape)} "
                         f"{rows.dtype}, ids {tuple(ids.shape)}")
    if (extra_row is None) != (d_extra is None):
        raise ValueError("table_gradient: extra_row and d_extra go together")
    hidden = rows.shape[1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"table_gradient: hidden size {hidden} exceeds the supported {MAX_HIDDEN}")
    if out is None:
        if accumulate:
            raise ValueError("table_gradient: accumulate needs the gradient to add to (out)")
        grad = torch.zeros(num_table_rows, hidden, device=rows.device, dtype=dtype)
    elif out.shape != (num_table_rows, hidden) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"table_gradient: out must be a contiguous [{num_table_rows}, {hidden}] {dtype}; got "
                         f"{tuple(out.shape)} {out.dtype}")
    else:
        grad = out if accumulate else out.zero_()
    keys = ids if extra_row is None else torch.nn.functional.pad(ids, (0, 1), value=extra_row)
    n_ids = keys.numel()
    if n_ids == 0 or hidden == 0:
        return grad
    sorted_ids, order = torch.sort(keys, stable=True)
    programs = cdiv(n_ids, rows_per_program)
    if workspace is None:
        workspace = torch.empty(workspace_shape(rows.shape[0], hidden, rows_per_program), device=rows.device,
                                dtype=torch.float32)
    elif workspace.shape != workspace_shape(rows.shape[0], hidden, rows_per_program) or not workspace.is_contiguous():
        raise ValueError(f"table_gradient: workspace of shape {tuple(workspace.shape)}, expected a contiguous "
                         f"{workspace_shape(rows.shape[0], hidden, rows_per_program)}")
    rows = rows.contiguous()
    extra = grad if d_extra is None else d_extra.contiguous()  # unread without the extra row
    block, warps = row_launch_config(hidden)
    head, tail = workspace.unbind(0)
    _segment_sums_kernel[(programs,)](rows, extra, sorted_ids, order, grad, head, tail, rows.shape[0], n_ids, hidden,
                                      rows.stride(0), grad.stride(0), HAS_EXTRA=d_extra is not None,
                                      ACCUMULATE=accumulate, R=rows_per_program, BLOCK_H=block, num_warps=warps)
    if programs > 1:
        block_k, carry_warps = carry_config(hidden)
        _segment_carry_kernel[(programs,)](sorted_ids, grad, head, tail, n_ids, programs, hidden, grad.stride(0),
                                           ACCUMULATE=accumulate, R=rows_per_program, BLOCK_K=block_k,
                                           BLOCK_H=block, num_warps=carry_warps)
    return grad
