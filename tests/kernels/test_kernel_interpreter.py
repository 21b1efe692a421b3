"""What the suite assumes about the Triton interpreter: its casts (tests/tolerance.py) and its language patch, made
once a launch (tests/triton_interpreter.py)."""

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


@triton.jit
def _row_total(X, row, N: tl.constexpr):
    return tl.sum(tl.load(X + row * N + tl.arange(0, N)), axis=0)


@triton.jit
def _row_totals_kernel(X, Y, N: tl.constexpr):
    row = tl.program_id(0)
    tl.store(Y + row, _row_total(X, row, N) + tl.max(tl.zeros([N], dtype=tl.float32), axis=0))


@pytest.mark.skipif(not INTERPRETED, reason="compiled kernels are not interpreted")
def test_the_interpreter_patches_the_language_once_a_launch_not_once_a_program(monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "patches_once", False), "tests/triton_interpreter.py is not installed"
    patches = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *args: patches.append(args[0]) or original(*args))
    x = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    for _ in range(2):  # the second launch patches again: the first one's patch was undone
        y = torch.empty(16)
        _row_totals_kernel[(16,)](x, y, N=4)
        torch.testing.assert_close(y, x.sum(1), rtol=0, atol=0)
    # each launch patches triton.language (its kernel's) and triton.language.core (tl.sum's) once: fewer module patches
    # than programs (once a program, the interpreter's own way: ~700)
    assert 0 < len(patches) < 2 * 16, len(patches)
