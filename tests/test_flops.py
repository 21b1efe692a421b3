"""flops.py's count against torch's own count (FlopCounterMode) of a real forward + backward: exactly equal, both
from the forward's own mask counts and from the host counts the FLOP-budget plan uses before any step."""

import pytest
from conftest import tiny_batch, tiny_model
from torch.utils.flop_counter import FlopCounterMode

from fastmae.flops import batch_training_flops, training_flops


@pytest.mark.parametrize("preset, extra", [
    pytest.param("mlm", {}, id="mlm"),
    pytest.param("mae-lm", {}, id="mae-lm"),
    pytest.param("3ml", {}, id="3ml"),
    pytest.param("3ml", {"decoder_kind": "cross", "decoder_layers": 2}, id="3ml-cross"),
    pytest.param("mae-lm", {"encoder_layers": 4, "insert_layer": 2, "decoder_layers": 0}, id="k=2-of-4"),
    # kept and random tokens are predicted but stay visible: the visible count is not tokens - predicted
    pytest.param("3ml", {"encoder_layers": 4, "insert_layer": 2, "decoder_layers": 0, "mask_token_prob": 0.8,
                         "random_token_prob": 0.1}, id="k=2-of-4-80-10-10"),
    # ModernBERT's feed-forward and projections: GeGLU, no biases, pre-LN
    pytest.param("3ml", {"ffn_gated": True, "linear_bias": False, "norm_bias": False, "norm_position": "pre",
                         "first_attention_norm": False}, id="3ml-geglu"),
])
def test_training_flops_match_the_flop_counter(preset, extra):
    model = tiny_model(preset, **extra).train()
    model.set_attention_backend("reference")  # per-sequence matmuls: the counter sees exactly sum(n^2) pairs
    batch = tiny_batch(6, seed=3, min_len=20, max_len=100)
    with FlopCounterMode(display=False) as counter:
        out = model(batch, seed=0, step=0)
        out.loss.backward()
    counts = out.masked.counts
    assert counter.get_total_flops() == training_flops(model.config, batch.seqlens, batch.seqlens - counts.removed,
                                                       counts.predicted)
    assert counter.get_total_flops() == batch_training_flops(model.config, batch)  # the plan's count, before the step


@pytest.mark.parametrize("half_window", [0, 1, 3, 8])
def test_a_local_layer_counts_the_pairs_within_its_window(half_window):
    """window_pairs against counting every (query, key) pair of consecutive positions within the window."""
    import numpy as np

    from fastmae.flops import window_pairs

    lengths = np.array([1, 2, 3, 7, 8, 9, 17, 40])
    brute = [sum(abs(i - j) <= half_window for i in range(n) for j in range(n)) for n in lengths]
    assert window_pairs(lengths, half_window).tolist() == brute
