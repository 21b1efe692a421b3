"""flash-attention's accuracy rule: a fast path's error against an fp64 oracle may be at most `factor` times the
error of plain torch in the same dtype (2x forward, 3x gradients), plus a small floor for when plain torch is exact.
The floor is relative to the oracle's largest magnitude, so a result that loses small entries (a dropped vocabulary
block of a gradient) fails in bf16 as it does in fp32.

Under TRITON_INTERPRET=1 a kernel's fp32 -> bf16/fp16 store truncates instead of rounding to nearest (checked in
tests/kernels/test_kernel_interpreter.py), so each element of a half-precision result may also be off by one ulp of its
value there; compiled kernels on a GPU round, and get no such allowance.
"""

from __future__ import annotations

import os

import torch

FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` numbers at each of `values` (fp64)."""
    exponent = torch.floor(torch.log2(values.abs().clamp(min=torch.finfo(dtype).tiny)))
    return torch.exp2(exponent) * torch.finfo(dtype).eps


def assert_as_accurate(name: str, got: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype,
                       factor: float, zero_scale: float = 0.0) -> None:
    """Max-abs error of `got` within `factor` x that of `plain` (both against `exact`), plus FLOOR[dtype] x the
    largest |exact|. Where `exact` is 0 everywhere by cancellation (the query gradient of one-token sequences), the
    floor is FLOOR[dtype] x `zero_scale`, the magnitude of the terms that cancel."""
    stored_dtype = got.dtype
    got, plain, exact = (t.detach().double().cpu() for t in (got, plain, exact))
    assert got.shape == exact.shape, f"{name}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    if got.numel() == 0:
        return
    assert not torch.isnan(got).any(), f"{name}: NaN in the result (an unwritten row?)"
    base = (plain - exact).abs().max().item()
    scale = exact.abs().max().item() or zero_scale
    allowed = torch.full_like(exact, factor * base + FLOOR[dtype] * scale)
    if INTERPRETED and stored_dtype in (torch.bfloat16, torch.float16):
        allowed += ulp(exact, stored_dtype)
    excess = (got - exact).abs() - allowed
    worst = int(excess.argmax())
    assert excess.flatten()[worst] <= 0, (f"{name}: error {(got - exact).abs().max().item():.3g} vs plain torch "
                                          f"{base:.3g} in {dtype} (worst at flat index {worst})")
