"""What the tolerance rule assumes about the Triton interpreter (tests/tolerance.py)."""

import pytest
import torch
import triton
import triton.language as tl
from tolerance import INTERPRETED


@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Y + offs, tl.load(X + offs).to(Y.dtype.element_ty))


@pytest.mark.skipif(not INTERPRETED, reason="compiled kernels round to nearest")
def test_interpreter_truncates_fp32_to_bf16():
    x = torch.tensor([1.0 + 2**-8 + 2**-10, -1.0 - 2**-8 - 2**-10], dtype=torch.float32)
    y = torch.empty(2, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, N=2)
    assert y.tolist() == [1.0, -1.0]  # round-to-nearest would give +-1.0078125
