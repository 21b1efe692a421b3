"""Dropout + residual add + LayerNorm in one kernel (Triton) against its torch reference, forward and backward: with and
without a bias, with the sum kept (pre-LN: the residual stream goes on, its gradient comes back) or not, with and
without dropout, rows of any stride."""

import pytest
import torch
from conftest import KERNEL_DEVICE, candidate_tilings
from fastmae.kernels import add_layer_norm, add_layer_norm_reference, layer_norm, layer_norm_reference, norm
from tolerance import assert_as_accurate

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if torch.cuda.is_available() else [])
SHAPES = [pytest.param(1, 8, id="N1-H8"), pytest.param(37, 100, id="N37-H100"), pytest.param(40, 768, id="N40-H768"),
          pytest.param(16384, 1024, id="N16384-H1024", marks=pytest.mark.large)]


@pytest.mark.parametrize("rows, hidden", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias, keep_sum, dropout_p",  # RoBERTa's post-LN; ModernBERT's pre-LN; a pre-LN with both
                         [(True, False, 0.1), (False, True, 0.0), (True, True, 0.3)],
                         ids=["bias-post-LN-dropout", "no-bias-pre-LN", "bias-pre-LN-dropout"])
@pytest.mark.parametrize("seed", [0, 1])
def test_add_layer_norm_matches_the_reference_forward_and_backward(rows, hidden, dtype, with_bias, keep_sum, dropout_p,
                                                                   seed, nan_empty, monkeypatch):
    """The hashed dropout's bits are the reference's under the same key: the same elements dropped, the same scale.
    Seed 1 runs the backward on two programs, each looping over several tiles of rows (the last one partial). Where
    the norm has a bias, so does the projection before it (x_bias: RoBERTa's linear biases), its gradient summed by
    the kernel; ModernBERT's layers have neither."""
    if seed:
        monkeypatch.setattr(norm, "BACKWARD_PROGRAMS", 2)
    gen = torch.Generator().manual_seed(seed)
    key = torch.tensor([0x9E3779B1 * (seed + 1) % 2**32], dtype=torch.int64, device=KERNEL_DEVICE)
    wide = torch.randn(rows, hidden + 5, generator=gen)  # x as a strided view: rows hidden + 5 apart
    residual = 3 * torch.randn(rows, hidden, generator=gen) + 1
    weight, bias = 1 + 0.2 * torch.randn(hidden, generator=gen), 0.3 * torch.randn(hidden, generator=gen)
    x_bias = torch.randn(hidden, generator=gen)
    grad_y, grad_h = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)

    def run(fn, run_dtype):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (wide, residual, weight, bias, x_bias)]
        y, h = fn(leaves[0][:, :hidden], leaves[1], leaves[2], leaves[3] if with_bias else None, 1e-5, keep_sum,
                  dropout_p, key, x_bias=leaves[4] if with_bias else None)
        outs, grads = [y], [grad_y]
        if keep_sum:
            outs.append(h)
            grads.append(grad_h)
        wanted = leaves if with_bias else leaves[:3]
        d_inputs = torch.autograd.grad(outs, wanted, [g.to(KERNEL_DEVICE, run_dtype) for g in grads])
        return [*outs, d_inputs[0][:, :hidden], *d_inputs[1:]]

    got, plain = run(add_layer_norm, dtype), run(add_layer_norm_reference, dtype)
    exact = run(add_layer_norm_reference, torch.float64)
    names = ["y", *(["h"] if keep_sum else []), "dx", "dresidual", "dweight",
             *(["dbias", "dx_bias"] if with_bias else [])]
    for name, g, p, e in zip(names, got, plain, exact):
        assert_as_accurate(f"add_layer_norm {name}", g.cpu(), p.cpu(), e.cpu(), dtype,
                           factor=2 if name in ("y", "h") else 3)


@pytest.mark.parametrize("rows, hidden", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])  # RoBERTa's LM head; ModernBERT's
@pytest.mark.parametrize("seed", [0, 1])
def test_layer_norm_matches_the_reference_forward_and_backward(rows, hidden, dtype, with_bias, seed, nan_empty,
                                                               monkeypatch):
    """The kernels without a residual (the LM head's norm): no residual read, none's gradient written, the backward
    reading x as the sum. Seed 1 runs the backward on two programs looping over several tiles."""
    if seed:
        monkeypatch.setattr(norm, "BACKWARD_PROGRAMS", 2)
    gen = torch.Generator().manual_seed(seed + 10)
    wide = 2 * torch.randn(rows, hidden + 5, generator=gen) + 0.5  # x as a strided view
    weight, bias = 1 + 0.2 * torch.randn(hidden, generator=gen), 0.3 * torch.randn(hidden, generator=gen)
    grad_y = torch.randn(rows, hidden, generator=gen)

    def run(fn, run_dtype):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (wide, weight, bias)]
        y = fn(leaves[0][:, :hidden], leaves[1], leaves[2] if with_bias else None, 0.1)  # an eps that tells x from 2x
        wanted = leaves if with_bias else leaves[:2]
        d_inputs = torch.autograd.grad(y, wanted, grad_y.to(KERNEL_DEVICE, run_dtype))
        return [y, d_inputs[0][:, :hidden], *d_inputs[1:]]

    got, plain = run(layer_norm, dtype), run(layer_norm_reference, dtype)
    exact = run(layer_norm_reference, torch.float64)
    for name, g, p, e in zip(["y", "dx", "dweight", "dbias"], got, plain, exact):
        assert_as_accurate(f"layer_norm {name}", g.cpu(), p.cpu(), e.cpu(), dtype, factor=2 if name == "y" else 3)


NORM_TILINGS = candidate_tilings(norm.tiles(768), norm.CANDIDATES)


@pytest.mark.parametrize("kernel, tiles", NORM_TILINGS,
                         ids=[f"{k}-{t.rows}x{t.warps}{'-prefetch' * t.prefetch}" for k, t in NORM_TILINGS])
def test_every_norm_tiling_the_gpu_benchmark_times_computes_the_reference(kernel, tiles, monkeypatch):
    """benchmarks/kernels.py times each candidate tiling on CUDA, where fastmae may ship the fastest: each computes
    what the reference does for RoBERTa's post-LN with dropout and the projection's bias at its width, forward and
    backward, on rows no tile divides, the backward's programs looping over several tiles."""
    monkeypatch.setattr(norm, "BACKWARD_PROGRAMS", 3)
    gen = torch.Generator().manual_seed(7)
    x, residual, grad_y = (torch.randn(21, 768, generator=gen) for _ in range(3))
    weight, bias = 1 + 0.2 * torch.randn(768, generator=gen), 0.3 * torch.randn(768, generator=gen)
    x_bias = torch.randn(768, generator=gen)
    key = torch.tensor([0x2545F491], dtype=torch.int64, device=KERNEL_DEVICE)
    tiling = {**norm.tiles(768), kernel: tiles}
    dtype = torch.bfloat16 if KERNEL_DEVICE == "cuda" else torch.float32

    def run(fn, run_dtype, **options):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (x, residual, weight, bias, x_bias)]
        y, _ = fn(*leaves[:4], 1e-5, False, 0.1, key, x_bias=leaves[4], **options)
        return (y, *torch.autograd.grad(y, leaves, grad_y.to(KERNEL_DEVICE, run_dtype)))

    got = run(add_layer_norm, dtype, tiling=tiling)
    plain, exact = run(add_layer_norm_reference, dtype), run(add_layer_norm_reference, torch.float64)
    for name, g, p, e in zip(("y", "dx", "dresidual", "dweight", "dbias", "dx_bias"), got, plain, exact):
        assert_as_accurate(f"add_layer_norm {name} ({kernel} {tiles})", g.cpu(), p.cpu(), e.cpu(), dtype,
                           factor=2 if name == "y" else 3)


def test_add_layer_norm_names_what_it_cannot_take():
    x = torch.randn(4, 8, device=KERNEL_DEVICE)
    weight = torch.ones(8, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="one dtype"):
        add_layer_norm(x, x.double(), weight, None)
    with pytest.raises(ValueError, match="contiguous"):
        add_layer_norm(x[:, ::2], x[:, ::2], weight[:4], None)
    with pytest.raises(ValueError, match="add_layer_norm: dropout_p=0.1 needs its key as one int64"):
        add_layer_norm(x, x, weight, None, dropout_p=0.1, key=torch.zeros(2, dtype=torch.int64, device=x.device))


@pytest.mark.parametrize("norm_position", ["post", "pre"])
def test_a_layer_under_autocast_adds_and_norms_as_torch_does(norm_position, monkeypatch):
    """Fine-tuning's bf16 autocast over fp32 weights mixes dtypes at the residual add (a bf16 sublayer output, an fp32
    stream) and runs LayerNorm in fp32: the layer keeps torch's add and norm there, with the Triton kernels on."""
    from conftest import tiny_config

    from fastmae.attention import VarlenMeta
    from fastmae.layers import TransformerLayer, finish_stack

    config = tiny_config("mlm", norm_position=norm_position)
    torch.manual_seed(0)
    layer = TransformerLayer(config, dropout=0.0, attention_dropout=0.0).to(KERNEL_DEVICE)
    layer.attention_backend = "padded"
    lengths = [5, 9]
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(2), torch.tensor(lengths))
    meta = VarlenMeta.build(cu.to(KERNEL_DEVICE), 9, seq_ids.to(KERNEL_DEVICE),
                            (torch.arange(14) - cu.long()[seq_ids]).int().to(KERNEL_DEVICE), consecutive=True)
    x = torch.randn(14, config.hidden_size, device=KERNEL_DEVICE)
    outs = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("FASTMAE_KERNELS", mode)
        with torch.autocast(KERNEL_DEVICE, dtype=torch.bfloat16):
            outs.append(finish_stack(*layer(x, meta, delta=x.flip(0) if norm_position == "pre" else None)))
    assert outs[1].dtype == outs[0].dtype
    torch.testing.assert_close(outs[1], outs[0])


def test_a_layers_fused_dropout_is_keyed_by_torchs_generator(monkeypatch):
    """On the Triton path a training layer's dropout runs inside the norm kernel under a key drawn from torch's
    generator: the same seed repeats its output, another seed drops other elements, and without dropout (eval) the
    Triton and torch paths agree."""
    from conftest import tiny_config

    from fastmae.attention import VarlenMeta
    from fastmae.layers import TransformerLayer

    config = tiny_config("mlm", norm_position="post")
    torch.manual_seed(0)
    layer = TransformerLayer(config, dropout=0.2, attention_dropout=0.0).to(KERNEL_DEVICE).train()
    layer.attention_backend = "padded"
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(2), torch.tensor([5, 9]))
    meta = VarlenMeta.build(cu.to(KERNEL_DEVICE), 9, seq_ids.to(KERNEL_DEVICE),
                            (torch.arange(14) - cu.long()[seq_ids]).int().to(KERNEL_DEVICE), consecutive=True)
    x = torch.randn(14, config.hidden_size, device=KERNEL_DEVICE)
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")
    outs = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        outs.append(layer(x, meta)[0])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    # activation checkpointing recomputes the forward in the backward: torch.utils.checkpoint restores the generator,
    # so the recomputation draws the same key and the gradients are the uncheckpointed ones
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(5)
        leaf = x.clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(layer, leaf, meta, use_reentrant=False)[0] if checkpointed else \
            layer(leaf, meta)[0]
        assert torch.equal(out, outs[0])
        grads.append(torch.autograd.grad(out.square().sum(), (leaf, layer.ffn_norm.weight)))
    for plain, recomputed in zip(*grads):
        assert torch.equal(plain, recomputed)
    layer.eval()
    fused = layer(x, meta)[0]
    monkeypatch.setenv("FASTMAE_KERNELS", "torch")
    torch.testing.assert_close(fused, layer(x, meta)[0])
    assert not torch.allclose(outs[0], fused)  # training dropped something
