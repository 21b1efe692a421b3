"""ModernBERT's architecture in fastmae (issue 48, in part; its local layers' window against an oracle:
test_local_window.py): a small random ModernBERT saved by transformers (both kinds of layer, a window shorter than the
sequences, the nested and the flat config keys) is read computing transformers' hidden states (eager and sdpa) and MLM
logits at step 0; what fastmae does not compute is refused by name; the docs' recipe continues one keeping its
rotary bases."""

import json

import pytest
import torch
from test_foreign import TEXTS, byte_level_bpe

from fastmae import PackedBatch
from fastmae.data.tokenizer import load_tokenizer
from fastmae.errors import FastmaeError
from fastmae.pretrained import load_pretrained

transformers = pytest.importorskip("transformers")


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
        logits = model.head(ours) @ model.embeddings.tokens.weight.T + model.head.bias
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
            logits = model.head(ours) @ model.embeddings.tokens.weight.T + model.head.bias
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


def test_the_walk_throughs_recipe_continues_a_modernbert_keeping_its_rotary_bases(bpe_dir, tmp_path):
    """docs/after-pretraining.md's command: configs/modernbert-3ml-base.yaml with train.init_from a ModernBERT (here a
    small one, its width and depth given to match): the recipe's 1,024 tokens where the source read 128, the source's
    own rotary bases (the recipe writes none, so a released ModernBERT's 160000 stays)."""
    from pathlib import Path

    from fastmae.config import load_run_config
    from fastmae.pretrained import continued

    source = modernbert(bpe_dir, tmp_path / "modernbert")
    recipe = Path(__file__).resolve().parent.parent / "configs" / "modernbert-3ml-base.yaml"
    small = ["model.hidden_size=32", "model.num_heads=4", "model.encoder_layers=4", "model.intermediate_size=48",
             "model.local_window=8", f"model.vocab_size={load_tokenizer(bpe_dir).vocab_size}"]
    config, _ = continued(load_run_config(recipe, [f"train.init_from={source}", f"data.path={tmp_path}", *small]))
    assert (config.model.rotary_base, config.model.local_rotary_base, config.model.max_seq_len) == (1000.0, 50.0, 1024)
