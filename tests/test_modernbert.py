"""ModernBERT's architecture in fastmae (issue 48, in part): local layers attend by original position, on every CPU
backend against an independent per-sequence oracle, forward and backward; a small random ModernBERT saved by
transformers (both kinds of layer, a window shorter than the sequences, the nested and the flat config keys) is read
computing transformers' hidden states (eager and sdpa) and MLM logits at step 0; what fastmae does not compute is
refused by name."""

import json
import math

import pytest
import torch
from test_foreign import TEXTS, byte_level_bpe

from fastmae import PackedBatch
from fastmae.attention import StreamBias, VarlenMeta, varlen_attention
from fastmae.data.tokenizer import load_tokenizer
from fastmae.errors import FastmaeError
from fastmae.positions import window_by_distance
from fastmae.pretrained import load_pretrained

transformers = pytest.importorskip("transformers")


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
    """Softmax attention per sequence, in fp64, each query seeing the keys within `half` of its original position."""
    outs = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qb, kb, vb = (t[start:end].double().transpose(0, 1) for t in (q, k, v))
        pos = positions[start:end].long()
        scores = qb @ kb.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill((pos[None, :] - pos[:, None]).abs()[None] > half, -math.inf)
        outs.append((scores.softmax(-1) @ vb).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["padded", "math", "reference"])
@pytest.mark.parametrize("dtype, seed", [(torch.float32, 0), (torch.float32, 1), (torch.bfloat16, 2)])
def test_a_local_layer_attends_by_original_position_on_a_shortened_stream(backend, dtype, seed):
    """Visible rows of a 3ml-like stream (positions skip the removed tokens; sequences of 13, 1 and 29 rows):
    every key within 3 original positions and no other, forward and the gradients of q, k and v."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [13, 1, 29]
    positions = torch.cat([torch.sort(torch.randperm(2 * n, generator=generator)[:n])[0] for n in lengths])
    positions[[0, 13, 14]] = 0  # each sequence keeps its first token (<s> is never removed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    meta = VarlenMeta.build(cu, max(lengths), seq_ids, positions.int())
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=generator).to(dtype).requires_grad_() for _ in range(3))
    bias = StreamBias.build(window_by_distance(3, 2), meta, meta, backend, dtype, window=3)
    assert_windowed_as_oracle(varlen_attention(q, k, v, meta, backend=backend, bias=bias), (q, k, v), positions, cu,
                              3, generator)


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


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return byte_level_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer")


def modernbert(tokenizer_dir, directory, flat_keys: bool = False, seed: int = 0, **overrides):
    """A small random ModernBertForMaskedLM (every parameter moved off its init: the norms' weights too) saved with
    its tokenizer; 4 layers, global every 3rd, a window of 8 tokens; `flat_keys`: its config.json as the 2024-25 hub
    configs write it."""
    special = load_tokenizer(tokenizer_dir).special
    values = dict(vocab_size=load_tokenizer(tokenizer_dir).vocab_size, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=4, num_attention_heads=4, global_attn_every_n_layers=3, local_attention=8,
                  max_position_embeddings=128, pad_token_id=special.pad, bos_token_id=special.bos,
                  eos_token_id=special.eos, cls_token_id=special.bos, sep_token_id=special.eos,
                  global_rope_theta=1000.0, local_rope_theta=50.0)
    torch.manual_seed(seed)
    model = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**{**values, **overrides})).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    for path in tokenizer_dir.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    if flat_keys:
        config = json.loads((directory / "config.json").read_text())
        for key in ("layer_types", "rope_parameters"):
            config.pop(key)
        config.update(global_rope_theta=1000.0, local_rope_theta=50.0)
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("flat_keys", [False, True])
def test_a_modernbert_computes_its_hidden_states_and_predictions_at_step_0(bpe_dir, tmp_path, flat_keys):
    directory = modernbert(bpe_dir, tmp_path / "modernbert", flat_keys)
    pretrained = load_pretrained(directory)
    config = pretrained.config
    assert pretrained.foreign == "ModernBERT" and config.layer_kinds == ("global", "local", "local", "global")
    assert (config.rotary_base, config.local_rotary_base, config.local_window) == (1000.0, 50.0, 8)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = [pretrained.tokenizer.frame(row) for row in pretrained.tokenizer.encode(TEXTS)]
    assert ids == [hf_tokenizer(text).input_ids for text in TEXTS] and max(map(len, ids)) > 2 * 8
    batch = PackedBatch.from_sequences(ids, special=config.special_tokens)
    model = pretrained.encoder().eval()
    with torch.no_grad():
        ours = model.encode(batch)
        logits = model.head.transform(ours) @ model.embeddings.tokens.weight.T + model.head.bias
    for implementation in ("eager", "sdpa"):
        hf = transformers.AutoModelForMaskedLM.from_pretrained(directory, attn_implementation=implementation).eval()
        for i, row in enumerate(ids):  # one sequence at a time: no padding in either
            rows = slice(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]))
            with torch.no_grad():
                outputs = hf(input_ids=torch.tensor([row]), output_hidden_states=True)
            assert (outputs.hidden_states[-1][0] - ours[rows]).abs().max() <= 1e-5, implementation
            assert (outputs.logits[0] - logits[rows]).abs().max() <= 1e-4, implementation
    assert ours.abs().max() > 0.5


@pytest.mark.parametrize("overrides, message", [
    ({"hidden_activation": "relu"}, "hidden_activation='relu'"),
    ({"local_attention": 7}, "local_attention=7: fastmae's local layers take an even window"),
    ({"attention_bias": True}, "attention_bias=True: fastmae has one switch"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings=False"),
])
def test_what_fastmae_does_not_compute_is_refused_by_name(bpe_dir, tmp_path, overrides, message):
    directory = modernbert(bpe_dir, tmp_path / "m", **overrides)
    with pytest.raises(FastmaeError, match=message):
        load_pretrained(directory)


def test_a_layer_pattern_or_rotary_type_fastmae_does_not_compute_is_refused(bpe_dir, tmp_path):
    directory = modernbert(bpe_dir, tmp_path / "m")
    config = json.loads((directory / "config.json").read_text())
    edited = {**config, "layer_types": ["full_attention", "full_attention", "sliding_attention", "full_attention"]}
    (directory / "config.json").write_text(json.dumps(edited))
    with pytest.raises(FastmaeError, match="layer_types=.*alternate as global_attn_every_n_layers=3"):
        load_pretrained(directory)
    linear = {"rope_type": "linear", "rope_theta": 10.0, "factor": 2.0}
    (directory / "config.json").write_text(json.dumps({**config, "rope_parameters": {
        **config["rope_parameters"], "sliding_attention": linear}}))
    with pytest.raises(FastmaeError, match="sliding_attention's rope_type 'linear'"):
        load_pretrained(directory)


def test_export_writes_a_modernbert_that_transformers_loads_computing_fastmaes_states(bpe_dir, tmp_path):
    """A ModernBERT read into fastmae and exported: AutoModelForMaskedLM and AutoTokenizer load it without remote
    code, with the same ids and fastmae's hidden states and logits; the export reads back as the same weights. A
    model with one of ModernBERT's settings but not its shape is refused naming both."""
    from fastmae.export import export
    from fastmae.hf import export_architecture

    source = modernbert(bpe_dir, tmp_path / "source")
    exported = export(source, tmp_path / "hf")
    assert json.loads((exported / "config.json").read_text())["model_type"] == "modernbert"
    pretrained = load_pretrained(source)
    again = load_pretrained(exported)
    assert again.weights.keys() == pretrained.weights.keys()
    assert all(torch.equal(again.weights[name], pretrained.weights[name]) for name in pretrained.weights)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(exported).eval()
    model = pretrained.encoder().eval()
    for text in TEXTS:
        ids = pretrained.tokenizer.frame(pretrained.tokenizer.encode([text])[0])
        assert tokenizer(text).input_ids == ids
        with torch.no_grad():
            ours = model.encode(PackedBatch.from_sequences([ids], special=pretrained.config.special_tokens))
            logits = model.head.transform(ours) @ model.embeddings.tokens.weight.T + model.head.bias
            outputs = hf(input_ids=torch.tensor([ids]), output_hidden_states=True)
        assert (outputs.hidden_states[-1][0] - ours).abs().max() <= 1e-5
        assert (outputs.logits[0] - logits).abs().max() <= 1e-4
    post_ln = pretrained.config.replace(norm_position="post", first_attention_norm=True)
    with pytest.raises(FastmaeError, match=r"ffn_gated=True.*only ModernBERT.*norm_position='post'"):
        export_architecture(post_ln)


@pytest.fixture(scope="module")
def source_and_data(bpe_dir, tmp_path_factory):
    """A ModernBERT and a dataset prepared with its tokenizer."""
    from test_foreign import corpus

    from fastmae.prepare import prepare

    root = tmp_path_factory.mktemp("continued")
    source = modernbert(bpe_dir, root / "modernbert")
    (root / "corpus.txt").write_text("\n".join(doc.replace("\n", " ") for doc in corpus(30)) + "\n")
    prepare([root / "corpus.txt"], root / "data", tokenizer_path=str(source), valid_fraction=0.1, progress=False)
    return source, root / "data"


@pytest.mark.parametrize("preset", ["3ml", "mae-lm"])
def test_a_modernbert_continues_with_any_objective_from_its_own_encoder(source_and_data, tmp_path, preset):
    """train.init_from=MODERNBERT with data prepared by its tokenizer: the run's model takes the ModernBERT's layers
    (every shape field), computes its hidden states at step 0, and a 3ml / mae-lm step (global decoder layers after
    the insertion, local encoder layers on the shortened stream) trains: finite loss, gradients in every layer."""
    from fastmae import MaskedLM
    from fastmae.config import load_run_config
    from fastmae.data import PackedLoader
    from fastmae.pretrained import SHAPE_FIELDS, continued, initialise

    source, data = source_and_data
    config, pretrained = continued(load_run_config(None, [f"data.path={data}", f"log.dir={tmp_path / 'run'}",
                                                          f"train.init_from={source}", f"model.preset={preset}",
                                                          "data.tokens_per_micro_batch=256"]))
    assert all(getattr(config.model, f) == getattr(pretrained.config, f) for f in SHAPE_FIELDS)
    assert config.model.layer_kinds == ("global", "local", "local", "global") and config.model.decoder_layers > 0
    torch.manual_seed(0)
    model = MaskedLM(config.model)
    assert set(initialise(model, pretrained)) and all(name.startswith(("decoder", "insertion"))
                                                      for name in initialise(model, pretrained))
    batch = next(iter(PackedLoader(data, max_seq_len=128, tokens_per_batch=256)))
    assert int(batch.seqlens.max()) > 8  # longer than the window
    with torch.no_grad():
        expected = pretrained.encoder().eval().encode(batch)
        got = model.eval().encode(batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    out = model.train()(batch, seed=0, step=0)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(layer.qkv.weight.grad is not None and layer.qkv.weight.grad.abs().sum() > 0
               for layer in [*model.encoder, *model.decoder])
