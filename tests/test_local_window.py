"""Local layers (ModernBERT's) attend by original position: on every CPU backend against an independent
per-sequence oracle, forward and backward, on full and shortened streams; and in a 3ml / mae-lm model, whose encoder
runs its local layers on the shortened stream (the visible rows skip the removed positions), every local layer's
attention equals the oracle fed the rows' original positions. Needs no transformers."""

import math

import pytest
import torch
from conftest import tiny_batch, tiny_model
from fastmae.kernels import local_attention_reference

import fastmae.layers
from fastmae.attention import StreamBias, VarlenMeta, varlen_attention
from fastmae.masking import mask_batch
from fastmae.positions import window_by_distance


@pytest.mark.parametrize("seed", [0, 1])
def test_flex_skips_the_blocks_outside_a_window_and_computes_the_same(seed):
    """FlexAttention (forward only on CPU) with the window in its block mask: the rows of a 1,000-token sequence and
    a shortened one equal the oracle's, and most blocks are skipped (128 x 128 rows each)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [1000, 300]
    positions = torch.cat([torch.arange(1000), torch.sort(torch.randperm(600, generator=generator)[:300])[0]])
    cu = torch.tensor([0, 1000, 1300], dtype=torch.int32)
    meta = VarlenMeta.build(cu, 1000, torch.repeat_interleave(torch.arange(2), torch.tensor(lengths)),
                            positions.int())
    q, k, v = (torch.randn(1300, 2, 8, generator=generator) for _ in range(3))
    bias = StreamBias.build(window_by_distance(16, 2), meta, meta, "flex", torch.float32, window=16)
    with torch.no_grad():
        out = varlen_attention(q, k, v, meta, backend="flex", bias=bias)
    assert (out.double() - windowed_oracle(q, k, v, positions, cu, 16)).abs().max() <= 1e-5
    dense = StreamBias.build(window_by_distance(16, 2), meta, meta, "flex", torch.float32).block_mask
    # the stream padded to whole blocks (11 of 128 rows; the compiled kernel is told its length divides); the window
    # computes under half the blocks the document mask computes
    assert tuple(bias.block_mask.seq_lengths) == tuple(dense.seq_lengths) == (1408, 1408)
    assert 100 - bias.block_mask.sparsity() < 0.5 * (100 - dense.sparsity())  # sparsity: percent of blocks skipped


def windowed_oracle(q, k, v, positions, cu_seqlens, half):
    """Softmax attention per sequence, in fp64, each query seeing the keys within `half` of its original position
    (the local-attention kernel's reference, kernels/reference.py)."""
    return local_attention_reference(q.double(), k.double(), v.double(), cu_seqlens, positions, None, half)


@pytest.mark.parametrize("backend", ["padded", "math", "reference", "triton_window"])
@pytest.mark.parametrize("dtype, seed", [(torch.float32, 0), (torch.float32, 1), (torch.bfloat16, 2)])
def test_a_local_layer_attends_by_original_position_on_a_shortened_stream(backend, dtype, seed):
    """Visible rows of a 3ml-like stream (positions skip the removed tokens; sequences of 13, 1 and 29 rows):
    every key within 3 original positions and no other, forward and the gradients of q, k and v (triton_window: the
    kernel under the interpreter, as CUDA's auto runs it there)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [13, 1, 29]
    positions = torch.cat([torch.sort(torch.randperm(2 * n, generator=generator)[:n])[0] for n in lengths])
    positions[[0, 13, 14]] = 0  # each sequence keeps its first token (<s> is never removed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    meta = VarlenMeta.build(cu, max(lengths), seq_ids, positions.int())
    q, k, v = (torch.randn(sum(lengths), 2, 16, generator=generator).to(dtype).requires_grad_() for _ in range(3))
    bias = StreamBias.build(window_by_distance(3, 2), meta, meta, backend, dtype, window=3)
    assert_windowed_as_oracle(varlen_attention(q, k, v, meta, backend=backend, bias=bias), (q, k, v), positions, cu,
                              3, generator)
    if backend == "triton_window":
        with pytest.raises(ValueError, match="'triton_window' has no dropout"):
            varlen_attention(q, k, v, meta, dropout_p=0.1, backend=backend, bias=bias)


def assert_windowed_as_oracle(out, qkv, positions, cu_seqlens, half, generator):
    """`out` of q, k, v (`qkv`) and the gradients of q, k and v equal `windowed_oracle`'s (fp32: within 1e-5,
    bf16: 3e-2; the gradients 4x that)."""
    expected = windowed_oracle(*qkv, positions, cu_seqlens, half)
    grad = torch.randn(out.shape, generator=generator)
    ours = torch.autograd.grad(out.float(), qkv, grad)
    theirs = torch.autograd.grad(expected, qkv, grad.double())
    tolerance = 1e-5 if out.dtype == torch.float32 else 3e-2
    assert (out.double() - expected).abs().max() <= tolerance
    for mine, oracle in zip(ours, theirs):
        assert (mine.double() - oracle).abs().max() <= tolerance * 4


@pytest.mark.parametrize("dtype, seed", [(torch.float32, 0), (torch.float32, 1), (torch.bfloat16, 2)])
def test_padded_attention_on_cpu_runs_a_local_layer_in_bands(dtype, seed, monkeypatch):
    """Padded SDPA's form of a window on CPU (fastmae.banded): blocks of 16 rows against their neighbours' on a
    full sequence of 203 rows and a shortened one (positions skip), forward and the gradients of q, k and v equal the
    oracle's (in fp32 too, where it is not used: exact there); no dense mask is built, and attention dropout there
    is refused."""
    import fastmae.attention

    assert (torch.bfloat16 in fastmae.attention.BAND_DTYPES) and (torch.float32 not in fastmae.attention.BAND_DTYPES)
    monkeypatch.setattr(fastmae.attention, "BAND_DTYPES", (dtype,))
    generator = torch.Generator().manual_seed(seed)
    lengths = [203, 90]
    positions = torch.cat([torch.arange(203), torch.sort(torch.randperm(180, generator=generator)[:90])[0]])
    cu = torch.tensor([0, 203, 293], dtype=torch.int32)
    meta = VarlenMeta.build(cu, 203, torch.repeat_interleave(torch.arange(2), torch.tensor(lengths)), positions.int())
    q, k, v = (torch.randn(293, 3, 16, generator=generator).to(dtype).requires_grad_() for _ in range(3))
    bias = StreamBias.build(window_by_distance(16, 3), meta, meta, "padded", dtype, window=16)
    assert bias.band is not None and bias.dense is None
    assert_windowed_as_oracle(varlen_attention(q, k, v, meta, backend="padded", bias=bias), (q, k, v), positions,
                              cu, 16, generator)
    with pytest.raises(ValueError, match="no attention dropout"):
        varlen_attention(q, k, v, meta, dropout_p=0.1, backend="padded", bias=bias)


def test_the_band_ops_shapes_and_autograd_formula_hold_under_torch_library_opcheck():
    """The band's forward and backward custom ops (fastmae.banded): their fake functions give the shapes the ops
    return (dynamo and AOT autograd trace by them) and their autograd formula is registered, by torch's own check."""
    from fastmae import banded

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 48, 8, generator=generator, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 1, 3, 16, 48).masked_fill_(torch.rand(2, 1, 3, 16, 48, generator=generator) < 0.3, -math.inf)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")  # not AOT dispatch: 4 s more
    torch.library.opcheck(banded._forward, (q, k, v, mask, 0.25), test_utils=checks)
    out, probs, k_bands, v_bands = banded._forward(q.detach(), k.detach(), v.detach(), mask, 0.25)
    torch.library.opcheck(banded._backward, (torch.randn_like(out), q.detach(), probs, k_bands, v_bands, 0.25),
                          test_utils=checks)


def choosing_as_on_cuda(monkeypatch):
    """`auto` picks, for a local window on a shortened stream, what it picks on CUDA in bf16 (fastmae's own kernel,
    run here under the Triton interpreter); every other choice stays the CPU's."""
    import fastmae.attention

    real = fastmae.attention.resolve_backend

    def resolve(backend, device, dropout_p, dtype=torch.bfloat16, biased=False, window_rows=False, rectangular=True,
                window=False):
        if biased and window and not window_rows:
            device, dtype = torch.device("cuda"), torch.bfloat16
        return real(backend, device, dropout_p, dtype, biased, window_rows, rectangular, window)

    monkeypatch.setattr(fastmae.attention, "resolve_backend", resolve)
    monkeypatch.setattr(fastmae.layers, "resolve_backend", resolve)


@pytest.mark.parametrize("preset, seed, cuda_choice", [("3ml", 0, False), ("3ml", 1, False), ("mae-lm", 2, False),
                                                       ("3ml", 3, True), ("mae-lm", 4, True)])
def test_a_models_local_layers_on_the_shortened_stream_see_the_window_of_original_positions(preset, seed, cuda_choice,
                                                                                            monkeypatch):
    """A 3ml / mae-lm model with ModernBERT's layers (local every layer but each third, a window of 8): its encoder's
    local layers run on the visible rows, and each one's attention output equals the oracle fed those rows' original
    positions (the batch's positions at the rows masking kept), not their indices in the shortened stream, which
    would see other keys here. cuda_choice: on the backend CUDA's `auto` gives those layers (triton_window)."""
    if cuda_choice:
        choosing_as_on_cuda(monkeypatch)
    model = tiny_model(preset, seed=seed, global_attention_every=3, local_window=8, position_embedding="rotary",
                       norm_position="pre", encoder_layers=5, attention_dropout=0.0, dropout=0.0, num_heads=3)
    batch = tiny_batch(num_sequences=4, seed=seed, min_len=30, max_len=60)
    masked = mask_batch(batch, model.config, seed, 0, 0)
    seen = []

    def recording(q, k, v, meta, meta_k=None, **kwargs):
        out = varlen_attention(q, k, v, meta, meta_k, **kwargs)
        bias = kwargs.get("bias")
        if bias is not None and q.shape[0] == masked.visible.positions.shape[0]:
            assert bias.backend == ("triton_window" if cuda_choice else "padded")
            seen.append((q.detach(), k.detach(), v.detach(), out.detach()))
        return out

    monkeypatch.setattr(fastmae.layers, "varlen_attention", recording)
    with torch.no_grad():
        model(masked, seed=seed)
    local_layers = sum(kind == "local" for kind in model.config.layer_kinds[:model.config.insert_layer])
    assert len(seen) == local_layers >= 3
    visible = masked.selection.visible_index.long()
    positions = batch.positions.long()[visible]  # the rows' original positions, from the batch itself
    cu = masked.visible.cu_seqlens.long()
    starts = torch.repeat_interleave(cu[:-1], torch.diff(cu))
    indices = torch.arange(len(visible)) - starts  # each row's index in its shortened sequence
    half = model.config.local_half_window
    for q, k, v, out in seen:
        expected = windowed_oracle(q, k, v, positions, cu, half)
        assert (out.double() - expected).abs().max() <= 1e-5
        assert (windowed_oracle(q, k, v, indices, cu, half) - expected).abs().max() > 1e-3  # the test can tell


def test_the_log_says_when_a_window_spans_every_sequence():
    """A window wider than the sequences (ModernBERT's 128 continued at 64 tokens) leaves its layers global in effect:
    the log's line says so, and says nothing of it where the window is narrower."""
    from fastmae.config import ModelConfig
    from fastmae.layers import local_attention_note

    def note(max_seq_len: int) -> str:
        config = ModelConfig.preset("mlm", hidden_size=32, num_heads=2, encoder_layers=3, max_seq_len=max_seq_len,
                                    position_embedding="rotary", global_attention_every=3, local_window=128)
        return local_attention_note(config, torch.device("cpu"), torch.float32)

    assert "(sequences of at most 64 tokens: each sees its whole sequence, as a global layer does" in note(64)
    assert note(65).startswith("local attention: 2 of 3 encoder layers see the tokens within 64 original positions of"
                               " each token (sequences of at most 65")
    assert "whole sequence" not in note(66) and note(66).startswith("local attention: 2 of 3 encoder layers")
