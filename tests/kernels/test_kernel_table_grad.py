"""The embedding tables' gradient (Triton: sorted runs of equal ids summed per program, the runs that cross programs
added by a second kernel) against torch's embedding backward."""

import pytest
import torch
from conftest import KERNEL_DEVICE
from fastmae.kernels import table_gradient, table_gradient_reference
from tolerance import assert_as_accurate

# (rows, hidden, table rows, rows a program): runs inside one program, runs crossing two and many programs (a table
# of one or two rows: every row one run, as mlm's `<mask>` id is a long one), fewer rows than a program takes, rows a
# whole number of programs, the shipped program size, and runs over several of the carry kernel's steps
CASES = [pytest.param(1, 8, 5, 4, id="N1"), pytest.param(37, 100, 50, 4, id="N37-V50-R4"),
         pytest.param(64, 37, 2, 8, id="N64-V2-R8"), pytest.param(45, 16, 1, 4, id="N45-V1-R4"),
         pytest.param(3, 16, 7, 32, id="N3-R32"), pytest.param(200, 64, 9, 32, id="N200-V9-R32"),
         pytest.param(150, 100, 2, 2, id="N150-V2-R2"),  # a run over more programs than the carry's step takes
         pytest.param(65536, 768, 50265, 32, id="N65536-H768-V50265", marks=pytest.mark.large)]  # an mlm step's


def _inputs(rows, hidden, table_rows, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, table_rows, (rows,), generator=gen, dtype=torch.int32)
    ids[: rows // 3] = table_rows // 2  # one id far more often than the others, its rows at the front
    return torch.randn(rows, hidden, generator=gen), ids, torch.randn(hidden, generator=gen)


@pytest.mark.parametrize("extra", [None, "among the ids", "not among them"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, hidden, table_rows, per_program", CASES)
def test_table_gradient_sums_each_ids_rows(rows, hidden, table_rows, per_program, dtype, extra):
    """Every table row against torch's embedding backward in `dtype` and in fp64; rows no id names are zero; the
    extra row's gradient added to its table row whether or not its id occurs among the ids."""
    grads, ids, d_extra = _inputs(rows, hidden, table_rows, rows + hidden + table_rows)
    extra_row = {None: None, "among the ids": int(ids[-1]), "not among them": table_rows}[extra]
    table_rows += extra == "not among them"  # a row of its own, after those the ids can name
    grads, d_extra = grads.to(dtype), None if extra is None else d_extra.to(dtype)  # the rows in the table's dtype
    device = dict(device=KERNEL_DEVICE)
    args = (grads.to(**device), ids.to(**device), table_rows)
    got = table_gradient(*args, dtype, extra_row, None if d_extra is None else d_extra.to(**device),
                         rows_per_program=per_program)
    plain = table_gradient_reference(*args, dtype, extra_row, None if d_extra is None else d_extra.to(**device))
    exact = table_gradient_reference(grads.double(), ids, table_rows, torch.float64, extra_row,
                                     None if d_extra is None else d_extra.double())
    assert got.dtype == dtype and got.shape == (table_rows, hidden)
    assert_as_accurate("table gradient", got, plain, exact, dtype, factor=3)
    named = torch.zeros(table_rows, dtype=torch.bool)
    named[ids.long()] = True
    if extra_row is not None:
        named[extra_row] = True
    assert not got[~named.to(KERNEL_DEVICE)].any(), "a row no id names is not zero"


def test_no_rows_give_zeros_and_bad_arguments_are_named():
    """No rows: a zero table; wrong rows, a lone extra row or a workspace of another shape: named errors."""
    empty = torch.empty(0, 8, device=KERNEL_DEVICE)
    ids = torch.empty(0, dtype=torch.int32, device=KERNEL_DEVICE)
    assert torch.equal(table_gradient(empty, ids, 3, torch.bfloat16),
                       torch.zeros(3, 8, dtype=torch.bfloat16, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="float rows"):
        table_gradient(empty.int(), ids, 3, torch.float32)
    with pytest.raises(ValueError, match="extra_row and d_extra go together"):
        table_gradient(empty, ids, 3, torch.float32, extra_row=1)
    rows, ids = torch.randn(4, 8, device=KERNEL_DEVICE), torch.zeros(4, dtype=torch.int32, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"workspace of shape \(2, 1, 8\), expected a contiguous \(2, 2, 8\)"):
        table_gradient(rows, ids, 3, torch.float32, workspace=torch.empty(2, 1, 8, device=KERNEL_DEVICE),
                       rows_per_program=4)


def _kernel_rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `x` cast to `dtype` as the kernels cast: to nearest on a GPU (torch's cast, autograd's add), toward zero
    under Triton's interpreter, whose bf16 casts truncate."""
    if dtype != torch.bfloat16 or x.is_cuda:
        return x.to(dtype)
    return (x.view(torch.int32) & -65536).view(torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, hidden, table_rows, per_program", [CASES[1], CASES[5], CASES[6]])
def test_a_table_gradient_adds_into_a_given_one_as_autograd_would(rows, hidden, table_rows, per_program, dtype):
    """With `out` and `accumulate`, the table's gradient added into `out` (the tied LM head's gradient, handed over:
    kernels/pending.py): autograd's sum of the two, bit for bit, rows no id names kept; with `out` alone, written
    into it, whatever it held: the table a new one gets."""
    grads, ids, d_extra = _inputs(rows, hidden, table_rows, rows + hidden)
    base = torch.randn(table_rows, hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = (grads.to(dtype).to(KERNEL_DEVICE), ids.to(KERNEL_DEVICE), table_rows, dtype, int(ids[0]),
            d_extra.to(dtype).to(KERNEL_DEVICE))
    alone = table_gradient(*args, rows_per_program=per_program)
    base = base.to(KERNEL_DEVICE)
    added = table_gradient(*args, rows_per_program=per_program, out=base.clone(), accumulate=True)
    assert torch.equal(added, _kernel_rounded(base.float() + alone.float(), dtype))
    written = table_gradient(*args, rows_per_program=per_program, out=torch.full_like(base, float("nan")))
    assert torch.equal(written, alone)
    reference = table_gradient_reference(*args, out=base.clone(), accumulate=True)
    assert torch.equal(reference, base + table_gradient_reference(*args))
    with pytest.raises(ValueError, match="accumulate needs the gradient to add to"):
        table_gradient(*args, accumulate=True)
    with pytest.raises(ValueError, match=rf"out must be a contiguous \[{table_rows}, {hidden}\]"):
        table_gradient(*args, out=base.t())
