"""GeGLU and bias + GELU, each in one kernel (Triton), against their torch references, forward and backward: rows of
odd and wide widths (wide rows take several programs a row; many rows, several bias-gradient partials), fp32 and
bf16, several seeds; and layers on the Triton path computing what the torch path computes."""

import pytest
import torch
from conftest import KERNEL_DEVICE, candidate_tilings
from fastmae.kernels import activation, bias_gelu, bias_gelu_reference, geglu, geglu_reference
from tolerance import assert_as_accurate

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if torch.cuda.is_available() else [])
SHAPES = [pytest.param(1, 8, id="N1-I8"), pytest.param(37, 100, id="N37-I100"),
          pytest.param(9, 2600, id="N9-I2600"),  # three column blocks, the last partial
          pytest.param(9, 192, id="N9-I192"),  # three blocks of 64 (`launch.column_block`: a power of two dividing)
          pytest.param(16384, 1152, id="N16384-I1152", marks=pytest.mark.large)]  # ModernBERT-base's


@pytest.mark.parametrize("rows, columns", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_geglu_matches_the_reference_forward_and_backward(rows, columns, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a = 2 * torch.randn(rows, 2 * columns, generator=gen)  # x over GELU's bend and tails, a gate of either sign
    grad_y = torch.randn(rows, columns, generator=gen)

    def run(fn, run_dtype):
        leaf = a.to(KERNEL_DEVICE, run_dtype).requires_grad_()
        y = fn(leaf)
        (da,) = torch.autograd.grad(y, leaf, grad_y.to(KERNEL_DEVICE, run_dtype))
        return y, da

    got, plain, exact = run(geglu, dtype), run(geglu_reference, dtype), run(geglu_reference, torch.float64)
    for name, g, p, e in zip(("y", "da"), got, plain, exact):
        assert g.dtype == dtype
        assert_as_accurate(f"geglu {name}", g.cpu(), p.cpu(), e.cpu(), dtype, factor=2)


@pytest.mark.parametrize("rows, columns", [*SHAPES[:4], pytest.param(300, 70, id="N300-I70")])  # 3 row programs
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_bias_gelu_matches_the_reference_forward_and_backward(rows, columns, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a, bias = 2 * torch.randn(rows, columns, generator=gen), torch.randn(columns, generator=gen)
    grad_y = torch.randn(rows, columns, generator=gen)

    def run(fn, run_dtype):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (a, bias)]
        y = fn(*leaves)
        return (y, *torch.autograd.grad(y, leaves, grad_y.to(KERNEL_DEVICE, run_dtype)))

    got, plain, exact = run(bias_gelu, dtype), run(bias_gelu_reference, dtype), run(bias_gelu_reference, torch.float64)
    for name, g, p, e in zip(("y", "da", "dbias"), got, plain, exact):
        assert g.dtype == dtype
        assert_as_accurate(f"bias_gelu {name}", g.cpu(), p.cpu(), e.cpu(), dtype, factor=2)


BIAS_GELU_TILINGS = candidate_tilings(activation.bias_gelu_tiles(1100), activation.BIAS_GELU_CANDIDATES)


@pytest.mark.parametrize("kernel, tiles", BIAS_GELU_TILINGS,
                         ids=[f"{k}-{t.rows}x{t.warps}{'-prefetch' * t.prefetch}" for k, t in BIAS_GELU_TILINGS])
def test_every_bias_gelu_tiling_the_gpu_benchmark_times_computes_the_reference(kernel, tiles, monkeypatch):
    """benchmarks/kernels.py times each candidate tiling on CUDA, where fastmae may ship the fastest: each computes
    what the reference does, forward and backward, on rows no tile divides and two column blocks (the last partial),
    the bias gradient's partials from several programs."""
    monkeypatch.setattr(activation, "ROWS_PER_BIAS_PROGRAM", 8)
    gen = torch.Generator().manual_seed(5)
    a, bias = 2 * torch.randn(37, 1100, generator=gen), torch.randn(1100, generator=gen)
    grad_y = torch.randn(37, 1100, generator=gen)
    tiling = {**activation.bias_gelu_tiles(1100), kernel: tiles}
    dtype = torch.bfloat16 if KERNEL_DEVICE == "cuda" else torch.float32

    def run(fn, run_dtype, **options):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (a, bias)]
        y = fn(*leaves, **options)
        return (y, *torch.autograd.grad(y, leaves, grad_y.to(KERNEL_DEVICE, run_dtype)))

    got = run(bias_gelu, dtype, tiling=tiling)
    plain, exact = run(bias_gelu_reference, dtype), run(bias_gelu_reference, torch.float64)
    for name, g, p, e in zip(("y", "da", "dbias"), got, plain, exact):
        assert_as_accurate(f"bias_gelu {name} ({kernel} {tiles})", g.cpu(), p.cpu(), e.cpu(), dtype, factor=2)


# The kernels' GELU (activation.ERFC's erfc, no branch) in fp32 on a dense grid against fp64: relative error of
# gelu(x) for x > -3 and below, absolute error of gelu'(x). Under the interpreter its exp2 and rsqrt are exact
# (measured: 8.5e-7, 8.0e-6, 2.1e-7; torch's own fp32 gelu: 1.2e-5 and nothing left below -5, 1.9e-7); a GPU's are
# approximate instructions, its bounds wider by the error they add (about 2^-22 each, the erfc's sensitivity to t
# about 2).
GELU_BOUNDS = {"cpu": (2e-6, 2e-5, 6e-7), "cuda": (4e-6, 3e-5, 1.5e-6)}


def test_the_kernels_gelu_is_exact_to_fp32_over_its_bend_and_tails():
    x = torch.linspace(-9, 9, 17 * 241, dtype=torch.float64)
    cdf = 0.5 * torch.special.erfc(-x / 2**0.5)
    exact_y, exact_slope = x * cdf, cdf + x * torch.exp(-0.5 * x * x) / (2 * torch.pi) ** 0.5
    a = x.float().view(17, 241).to(KERNEL_DEVICE).requires_grad_()
    y = bias_gelu(a, torch.zeros(241, device=KERNEL_DEVICE))
    (slope,) = torch.autograd.grad(y, a, torch.ones_like(y))
    relative = (y.double().cpu().flatten() - exact_y).abs() / exact_y.abs().clamp(min=1e-300)
    bend, tails, slope_bound = GELU_BOUNDS[KERNEL_DEVICE]
    assert relative[x > -3].max() <= bend, f"gelu over x > -3: relative error {relative[x > -3].max():.3g}"
    assert relative.max() <= tails, f"gelu's tails: relative error {relative.max():.3g}"
    slope_error = (slope.double().cpu().flatten() - exact_slope).abs().max()
    assert slope_error <= slope_bound, f"gelu': error {slope_error:.3g}"


def test_rows_take_column_blocks_that_divide_them():
    """The kernels issue every instruction on masked lanes too: a row takes blocks of a power of two dividing it, at
    least launch.MIN_DIVIDING_BLOCK wide, where one does (ModernBERT-base's GeGLU 1,152, RoBERTa-base's QKV 768), else
    blocks of COLUMNS_PER_PROGRAM or the next power of two, the last partial."""
    from fastmae.kernels.launch import column_block

    assert [column_block(c) for c in (1152, 768, 192, 3072, 1024, 2600, 100, 8)] == [128, 256, 64, 1024, 1024, 1024,
                                                                                      128, 8]


def test_geglu_names_what_it_cannot_take():
    a = torch.randn(4, 8, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"\[N, 2I\]"):
        geglu(a[:, :7])
    with pytest.raises(ValueError, match="contiguous"):
        geglu(a.t())
    with pytest.raises(ValueError, match=r"bias \[I\]"):
        bias_gelu(a, a[0, :4])


@pytest.mark.parametrize("gated", [True, False], ids=["GeGLU", "bias-GELU"])
def test_a_layer_computes_on_the_triton_path_what_the_torch_path_computes(gated, monkeypatch):
    from conftest import tiny_config

    from fastmae.attention import VarlenMeta
    from fastmae.layers import TransformerLayer, finish_stack

    config = tiny_config("mlm", norm_position="pre", ffn_gated=True) if gated else tiny_config("mlm")
    torch.manual_seed(0)
    layer = TransformerLayer(config, dropout=0.0, attention_dropout=0.0).to(KERNEL_DEVICE)
    layer.attention_backend = "padded"
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(2), torch.tensor([5, 9]))
    meta = VarlenMeta.build(cu.to(KERNEL_DEVICE), 9, seq_ids.to(KERNEL_DEVICE),
                            (torch.arange(14) - cu.long()[seq_ids]).int().to(KERNEL_DEVICE), consecutive=True)
    x = torch.randn(14, config.hidden_size, device=KERNEL_DEVICE, requires_grad=True)
    # pre-LN: the previous layer's output still to be added, which the attention norm's fused op adds
    delta = torch.randn_like(x, requires_grad=True) if gated else None
    results = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("FASTMAE_KERNELS", mode)
        out = finish_stack(*layer(x, meta, delta=delta))
        # the output projections' biases: added and their gradients summed by the norm kernel (post-LN, biased); the
        # QKV projection's weight and bias: its backward's gathering kernel (kernels/projection.py)
        wanted = (x, delta, layer.ffn_in.weight, layer.attn_norm.weight) if gated else (
            x, layer.ffn_in.weight, layer.ffn_in.bias, layer.attn_out.bias, layer.ffn_out.bias, layer.qkv.weight,
            layer.qkv.bias)
        results.append((out, *torch.autograd.grad(out.square().sum(), wanted)))
    for fused, plain in zip(results[1], results[0]):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
