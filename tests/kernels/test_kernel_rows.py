"""Fused embedding gather and insertion (Triton) against their torch references, forward and backward."""

import pytest
import torch
from conftest import KERNEL_DEVICE
from fastmae.kernels import embed_rows, embed_rows_reference, insert_rows, insert_rows_reference
from tolerance import assert_as_accurate

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if torch.cuda.is_available() else [])
SHAPES = [pytest.param(1, 8, id="N1-H8"), pytest.param(20, 37, id="N20-H37"), pytest.param(37, 100, id="N37-H100"),
          pytest.param(32, 128, id="N32-H128"), pytest.param(16384, 1024, id="N16384-H1024", marks=pytest.mark.large)]
VARIANTS = [pytest.param(False, False, id="plain"), pytest.param(True, False, id="pos"),
            pytest.param(False, True, id="norm"), pytest.param(True, True, id="pos+norm")]


def make_inputs(rows, hidden, dtype, seed, with_pos, with_norm, vocab=50, positions=16, pos_offset=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return dict(
        table=rand(vocab, hidden), ids=torch.randint(0, vocab, (rows,), generator=gen, dtype=torch.int32),
        pos_table=rand(positions, hidden) if with_pos else None,
        pos_ids=torch.randint(0, positions - pos_offset, (rows,), generator=gen, dtype=torch.int32)
        if with_pos else None,
        ln_weight=1 + 0.1 * rand(hidden) if with_norm else None, ln_bias=0.1 * rand(hidden) if with_norm else None,
        grad=rand(rows, hidden),
    )


def run(fn, inputs, dtype, float_keys, int_keys, call):
    """Call `call(fn, tensors)` with float inputs in `dtype` (leaves) and return [out, grads of the float inputs]."""
    tensors = {k: inputs[k].to(KERNEL_DEVICE, dtype).requires_grad_() for k in float_keys if inputs[k] is not None}
    tensors.update({k: inputs[k].to(KERNEL_DEVICE) for k in int_keys if inputs.get(k) is not None})
    if "ln_weight" in tensors:  # LayerNorm parameters stay fp32, as in the model
        for k in ("ln_weight", "ln_bias"):
            param_dtype = torch.float32 if dtype != torch.float64 else dtype
            tensors[k] = inputs[k].to(KERNEL_DEVICE, param_dtype).requires_grad_()
    out = call(fn, tensors)
    leaves = [tensors[k] for k in float_keys if k in tensors]
    grads = torch.autograd.grad(out, leaves, inputs["grad"].to(KERNEL_DEVICE, out.dtype))
    return [out, *grads]


def row_cases(test):
    """Parametrise `test` over every shape x variant x dtype; the inputs' seed differs from case to case
    (`case_seed`), not crossed with them (the suite's time)."""
    for mark in (pytest.mark.parametrize("dtype", DTYPES, ids=str),
                 pytest.mark.parametrize("with_pos, with_norm", VARIANTS),
                 pytest.mark.parametrize("rows, hidden", SHAPES)):
        test = mark(test)
    return test


def case_seed(rows, hidden, with_pos, with_norm) -> int:
    """A seed of its own for each shape and variant."""
    return rows + hidden + 2 * with_pos + with_norm


def check(kernel, reference, inputs, dtype, float_keys, int_keys, call, bit_exact: int):
    """Kernel vs reference in `dtype` vs reference in fp64; the first `bit_exact` results must match bit for bit."""
    got = run(kernel, inputs, dtype, float_keys, int_keys, call)
    plain = run(reference, inputs, dtype, float_keys, int_keys, call)
    exact = run(reference, inputs, torch.float64, float_keys, int_keys, call)
    for i in range(bit_exact):
        assert torch.equal(got[i], plain[i]), f"result {i} is not bit-identical"
    for i, (g, p, e) in enumerate(zip(got, plain, exact)):
        assert_as_accurate(f"output {i}" if i == 0 else f"grad {i}", g, p, e, dtype, factor=2 if i == 0 else 3)


@row_cases
def test_embed_rows(rows, hidden, with_pos, with_norm, dtype, nan_empty):
    """Every id in order (mlm's encoder), or the entries `rows` picks of a longer ids tensor (the visible rows of a
    k > 0 encoder: some shapes), positions past an offset (RoBERTa's)."""
    seed = case_seed(rows, hidden, with_pos, with_norm)
    inputs = make_inputs(rows, hidden, dtype, seed, with_pos, with_norm, pos_offset=2)
    gathered = rows in (20, 37)
    if gathered:
        gen = torch.Generator().manual_seed(200 + seed)
        inputs["ids"] = torch.cat([inputs["ids"], torch.randint(0, 50, (7,), generator=gen, dtype=torch.int32)])
        inputs["rows"] = torch.randperm(rows + 7, generator=gen)[:rows].to(torch.int32)
    floats, ints = ["table", "pos_table", "ln_weight", "ln_bias"], ["ids", "pos_ids", "rows"]
    call = lambda fn, t: fn(t["table"], t["ids"], t.get("pos_table"), t.get("pos_ids"), t.get("ln_weight"),  # noqa
                            t.get("ln_bias"), rows=t.get("rows"), pos_offset=2)
    movement_only = not with_norm and not with_pos  # a pure gather: bit for bit forward
    check(embed_rows, embed_rows_reference, inputs, dtype, floats, ints, call, bit_exact=1 if movement_only else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [False, True])
def test_the_extra_rows_gradient_joins_the_tables(with_norm, dtype):
    """`extra_row` hands out one row of the table (the insertion's `<mask>` row), its gradient added in the op's own
    backward: here the row is added to every output row, and the id also occurs among the ids."""
    inputs = make_inputs(37, 100, dtype, 5, True, with_norm)
    inputs["ids"][::5] = 3
    call = lambda fn, t: torch.add(*fn(t["table"], t["ids"], t["pos_table"], t["pos_ids"], t.get("ln_weight"),  # noqa
                                       t.get("ln_bias"), extra_row=3))
    floats, ints = ["table", "pos_table", "ln_weight", "ln_bias"], ["ids", "pos_ids"]
    check(embed_rows, embed_rows_reference, inputs, dtype, floats, ints, call, bit_exact=0)


@row_cases
def test_insert_rows(rows, hidden, with_pos, with_norm, dtype, nan_empty):
    seed = case_seed(rows, hidden, with_pos, with_norm)
    inputs = make_inputs(rows, hidden, dtype, seed, with_pos, with_norm, pos_offset=1)
    gen = torch.Generator().manual_seed(100 + seed)
    num_visible = int(torch.randint(0, rows + 1, (1,), generator=gen))
    perm = torch.randperm(rows, generator=gen).to(torch.int32)
    inputs.update(visible=torch.randn(num_visible, hidden, generator=gen), fill=torch.randn(hidden, generator=gen),
                  visible_index=perm[:num_visible].sort().values, removed_index=perm[num_visible:].sort().values)
    floats = ["visible", "fill", "pos_table", "ln_weight", "ln_bias"]
    ints = ["visible_index", "removed_index", "pos_ids"]
    call = lambda fn, t: fn(t["visible"], t["visible_index"], t["removed_index"], t["fill"], t.get("pos_table"),  # noqa
                            t.get("pos_ids"), t.get("ln_weight"), t.get("ln_bias"), pos_offset=1)
    movement_only = not with_norm and not with_pos  # a scatter and its gather: bit for bit both ways
    check(insert_rows, insert_rows_reference, inputs, dtype, floats, ints, call, bit_exact=2 if movement_only else 0)


@pytest.mark.parametrize("op", ["embed", "embed-gathered", "insert"])
@pytest.mark.parametrize("with_pos, with_norm", [VARIANTS[0], VARIANTS[3]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_hashed_dropout_drops_what_the_references_does(op, with_pos, with_norm, dtype, nan_empty):
    """dropout_p > 0: the output's elements kept and scaled as `hashing.hashed_keep` says for each output row (the
    gathered rows' and the insertion's scattered rows' too), its gradient through the same bits, forward and
    backward against the reference."""
    rows, hidden = 37, 100
    inputs = make_inputs(rows, hidden, dtype, 11, with_pos, with_norm, pos_offset=1)
    key = torch.tensor([0x7F4A7C15], dtype=torch.int64, device=KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(12)
    if op == "insert":
        perm = torch.randperm(rows, generator=gen).to(torch.int32)
        inputs.update(visible=torch.randn(20, hidden, generator=gen), fill=torch.randn(hidden, generator=gen),
                      visible_index=perm[:20].sort().values, removed_index=perm[20:].sort().values)
        floats, ints = ["visible", "fill", "pos_table", "ln_weight", "ln_bias"], ["visible_index", "removed_index",
                                                                                  "pos_ids"]
        call = lambda fn, t: fn(t["visible"], t["visible_index"], t["removed_index"], t["fill"],  # noqa: E731
                                t.get("pos_table"), t.get("pos_ids"), t.get("ln_weight"), t.get("ln_bias"),
                                pos_offset=1, dropout_p=0.3, key=key)
        check(insert_rows, insert_rows_reference, inputs, dtype, floats, ints, call, bit_exact=0)
        return
    if op == "embed-gathered":
        inputs["ids"] = torch.cat([inputs["ids"], torch.randint(0, 50, (7,), generator=gen, dtype=torch.int32)])
        inputs["rows"] = torch.randperm(rows + 7, generator=gen)[:rows].to(torch.int32)
    floats, ints = ["table", "pos_table", "ln_weight", "ln_bias"], ["ids", "pos_ids", "rows"]
    call = lambda fn, t: fn(t["table"], t["ids"], t.get("pos_table"), t.get("pos_ids"), t.get("ln_weight"),  # noqa
                            t.get("ln_bias"), rows=t.get("rows"), pos_offset=1, dropout_p=0.3, key=key)
    check(embed_rows, embed_rows_reference, inputs, dtype, floats, ints, call, bit_exact=0)


def test_bad_arguments_are_named():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="pos_table and pos_ids"):
        embed_rows(x, torch.zeros(2, dtype=torch.int32), pos_table=x)
    with pytest.raises(ValueError, match="embed_rows: dropout_p=0.1 needs its key"):
        embed_rows(x, torch.zeros(2, dtype=torch.int32), dropout_p=0.1)
    with pytest.raises(ValueError, match="pos_ids has 3 rows"):
        insert_rows(x, torch.arange(4, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), x[0], x,
                    torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backwards_partial_sums_add_up_to_torchs(groups, dtype):
    """launch.sum_parts (the norm's weight and bias gradients, bias + GELU's bias gradient, the embedding's LayerNorm,
    the LM head's bias): more partial rows than one block of them (three passes of SUM_MAX_BLOCK_P), and fewer (one
    pass of a narrower, wider tile), widths no column block divides, one group and three (the norm's weight and bias
    with a projection's bias)."""
    from fastmae.kernels import launch

    gen = torch.Generator().manual_seed(groups)
    for programs in (2 * launch.SUM_MAX_BLOCK_P + 44, 37):
        block_h = launch.sum_tile(programs, 10**4)[1]
        parts = torch.randn(groups, programs, block_h + 38, generator=gen).to(KERNEL_DEVICE)
        outs = torch.full((groups, parts.shape[2]), float("nan"), device=KERNEL_DEVICE, dtype=dtype)
        launch.sum_parts(parts, outs)
        for out, expected in zip(outs, parts.double().sum(1)):
            assert out.dtype == dtype
            torch.testing.assert_close(out.double().cpu(), expected.to(dtype).double().cpu(), rtol=1e-5 if
                                       dtype == torch.float32 else 1e-2, atol=1e-4 if dtype == torch.float32 else 1e-2)


def test_the_partial_sums_take_one_pass_at_base_size():
    """Every partial row of RoBERTa-base's backward sums in one pass (a round of loads, not a chain): the norm's at most
    1,024, a bias's one per 64 of 65,536 rows; 32 elements a thread, whole 32-byte sectors of each row."""
    from fastmae.kernels import launch, norm

    for programs in (norm.BACKWARD_PROGRAMS, 65536 // launch.ROWS_PER_BIAS_PROGRAM, 512, 128):
        block_p, block_h = launch.sum_tile(programs, 3072)
        assert block_p >= programs and block_h >= 8 and block_p * block_h == launch.SUM_TILE
    assert launch.sum_tile(3, 5) == (4, 8) and launch.sum_tile(3, 768) == (4, 1024)
