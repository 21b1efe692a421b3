"""train.compile: regional compilation of the transformer layers (inductor's CPU backend here; gcc is present)."""

import dataclasses

import pytest
import torch
import torch._dynamo
from simple_training import LoopConfig, demo_config, demo_documents, train_on_documents

from fastmae import MaskedLM


def _train(objective: str, compiled: bool, steps: int, backend: str = "inductor", **overrides) -> list[float]:
    """Losses of `steps` steps; compiled as train.compile does (inductor), or traced by dynamo and run eagerly."""
    torch.manual_seed(0)
    config = dataclasses.replace(demo_config(objective), **overrides)
    model = MaskedLM(config)
    if compiled and backend == "inductor":
        model.compile_layers()
    elif compiled:
        for layer in [*model.encoder, *model.decoder]:
            layer.compile(dynamic=True, backend=backend)
    documents = demo_documents(config.vocab_size, seed=0)
    return train_on_documents(model, documents, LoopConfig(steps=steps, warmup_steps=2, sequences_per_batch=4, seed=0))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def test_compiled_layers_train_like_eager_without_recompiling(fresh_dynamo):
    """3ml runs its layers on two streams (visible rows, then all rows) whose lengths change every batch: after the
    first steps no new graph is compiled, and the losses are eager's."""
    eager = _train("3ml", compiled=False, steps=8)
    warm = _train("3ml", compiled=True, steps=3)
    graphs_after_warm_up = fresh_dynamo["stats"]["unique_graphs"]
    compiled = _train("3ml", compiled=True, steps=8)
    assert 0 < graphs_after_warm_up <= 2  # the layer; at most a second one for the other stream layout
    assert fresh_dynamo["stats"]["unique_graphs"] == graphs_after_warm_up, "recompiled after warm-up"
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    torch.testing.assert_close(torch.tensor(warm), torch.tensor(eager[:3]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-4)


def test_dropout_compiles_without_graph_breaks(fresh_dynamo):
    """fastmae's CPU dropout draws with random_, which dynamo cannot trace: compiled graphs use F.dropout instead.
    (Graph breaks are dynamo's: the eager backend finds them without inductor's C++ compile.)"""
    losses = _train("mlm", compiled=True, steps=3, backend="eager", dropout=0.1, attention_dropout=0.1)
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    assert fresh_dynamo["stats"]["unique_graphs"] >= 1 and all(loss == loss for loss in losses)


@pytest.mark.parametrize("objective, bias", [
    ("mae-lm", {"relative_attention_bias": True}),
    # ModernBERT's local layers: on CPU their window runs in bands, custom ops with an autograd formula (fastmae.banded)
    ("3ml", {"global_attention_every": 2, "local_window": 8, "position_embedding": "rotary", "norm_position": "pre"}),
])
def test_position_biases_compile_like_eager(fresh_dynamo, objective, bias, monkeypatch):
    """model.relative_attention_bias, and local layers' windows, under train.compile: the bias table's lookups happen
    outside the compiled layers, which take the padded bias (or the window's band) as an input; the losses are eager's,
    no graph breaks, no recompiles. The graphs dynamo captures run on its eager backend: a cold inductor compile of
    another model cost ~25 s of a 2-core CI run; inductor's numerics are the 3ml test's above and the compiled
    DeepSpeed run's (tests/test_train.py)."""
    import fastmae.attention

    monkeypatch.setattr(fastmae.attention, "BAND_DTYPES", (torch.float32,))  # the bands, as bf16 runs them, in fp32
    bias = {**bias, "dropout": 0.0, "attention_dropout": 0.0}
    eager = _train(objective, compiled=False, steps=6, **bias)
    warm = _train(objective, compiled=True, steps=2, backend="eager", **bias)
    graphs_after_warm_up = fresh_dynamo["stats"]["unique_graphs"]
    compiled = _train(objective, compiled=True, steps=6, backend="eager", **bias)
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    assert fresh_dynamo["stats"]["unique_graphs"] == graphs_after_warm_up, "recompiled after warm-up"
    torch.testing.assert_close(torch.tensor(warm), torch.tensor(eager[:2]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-4)


def test_flex_attention_in_compiled_layers_traces_once(fresh_dynamo):
    """The CUDA path of the relative bias, traced by dynamo as train.compile does (run by the eager backend here: torch
    has no compiled FlexAttention on CPU, and forward only): the stream's BlockMask and the score_mod's captured
    tensors go into the layer graph without graph breaks, batches of other lengths reuse the graph, and the losses
    are the per-sequence reference's."""
    from conftest import tiny_batch

    from fastmae import ModelConfig

    config = ModelConfig.preset("mae-lm", vocab_size=60, hidden_size=32, num_heads=4, encoder_layers=2,
                                max_seq_len=160, relative_attention_bias=True, dropout=0.0, attention_dropout=0.0)
    batches = [tiny_batch(num_sequences=n, seed=n, vocab_size=60, max_len=150) for n in (9, 14, 11, 6, 12)]
    losses = {}
    for backend in ("reference", "flex"):
        torch.manual_seed(0)
        model = MaskedLM(config).eval()
        for layer in model.encoder:
            layer.attention_backend = backend
            if backend == "flex":
                layer.compile(dynamic=True, backend="eager")
        with torch.no_grad():
            losses[backend] = [model(batch, seed=1, step=i).loss for i, batch in enumerate(batches[:2])]
            graphs_after_warm_up = fresh_dynamo["stats"]["unique_graphs"]
            losses[backend] += [model(batch, seed=1, step=i + 2).loss for i, batch in enumerate(batches[2:])]
    assert graphs_after_warm_up == 1 and fresh_dynamo["stats"]["unique_graphs"] == 1, "recompiled for another batch"
    assert not fresh_dynamo["graph_break"], dict(fresh_dynamo["graph_break"])
    torch.testing.assert_close(torch.stack(losses["flex"]), torch.stack(losses["reference"]), rtol=1e-5, atol=1e-6)
