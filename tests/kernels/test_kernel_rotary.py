"""Rotary position embedding of q and k in one kernel (Triton) against its torch reference, forward and backward:
the strided views the QKV projection gives, queries and keys of different lengths (cross-attention), every dtype."""

import pytest
import torch
from conftest import KERNEL_DEVICE
from fastmae.kernels import rotary_qk, rotary_qk_reference
from tolerance import assert_as_accurate

from fastmae.positions import rotary_tables

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if torch.cuda.is_available() else [])
SHAPES = [pytest.param(1, 1, 1, 8, id="T1-H1-D8"), pytest.param(37, 37, 3, 16, id="T37-H3-D16"),
          pytest.param(20, 45, 2, 64, id="Tq20-Tk45-H2-D64"), pytest.param(40, 40, 12, 64, id="T40-H12-D64"),
          pytest.param(16384, 16384, 16, 128, id="T16384-H16-D128", marks=pytest.mark.large)]


def tables(rows, head_dim, seed):
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(seed))
    return [t.to(KERNEL_DEVICE) for t in rotary_tables(positions, head_dim, 10000.0)]


@pytest.mark.parametrize("rows_q, rows_k, heads, head_dim", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_rotary_qk_matches_the_reference_forward_and_backward(rows_q, rows_k, heads, head_dim, dtype, seed, nan_empty):
    gen = torch.Generator().manual_seed(seed)
    # q, k as the QKV projection's views: rows strided over q, k and v, heads strided within a row
    qkv_q = torch.randn(rows_q, 3, heads, head_dim, generator=gen)
    qkv_k = torch.randn(rows_k, 3, heads, head_dim, generator=gen)
    grads = [torch.randn(rows, heads, head_dim, generator=gen) for rows in (rows_q, rows_k)]
    cos_q, sin_q = tables(rows_q, head_dim, seed)
    cos_k, sin_k = tables(rows_k, head_dim, seed + 7)

    def run(fn, run_dtype):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (qkv_q, qkv_k)]
        q, k = leaves[0][:, 0], leaves[1][:, 1]
        out = fn(q, k, cos_q, sin_q, cos_k, sin_k)
        grads_in = torch.autograd.grad(out, leaves, [g.to(KERNEL_DEVICE, run_dtype) for g in grads])
        return [out[0], out[1], grads_in[0][:, 0], grads_in[1][:, 1]]

    got, plain, exact = run(rotary_qk, dtype), run(rotary_qk_reference, dtype), run(rotary_qk_reference,
                                                                                    torch.float64)
    assert got[0].dtype == dtype and got[0].is_contiguous()
    for name, g, p, e in zip(("q", "k", "dq", "dk"), got, plain, exact):
        assert_as_accurate(f"rotary {name}", g.cpu(), p.cpu(), e.cpu(), dtype, factor=2)


def test_rotary_qk_refuses_a_strided_last_dimension():
    x = torch.randn(4, 2, 16, device=KERNEL_DEVICE)
    cos, sin = tables(4, 8, 0)
    with pytest.raises(ValueError, match="last dimension contiguous"):
        rotary_qk(x[..., ::2], x[..., ::2], cos, sin, cos, sin)
