"""Continued pretraining (train.init_from): the shape comes from the source and the objective from model.preset,
the encoder computes the source's hidden states (and, for mlm, its loss) before any update, what cannot be mapped is
refused naming both values, a new decoder may start from the encoder's top layers, and a 2-rank DeepSpeed run switches a
Hugging Face ModernBERT (an mlm encoder with its own tokenizer) to 3ml, exports and fine-tunes it."""

import json

import pytest
import torch
from conftest import tiny_model
from synthetic import prepare_word_dataset, write_run_dir

from fastmae import MaskedLM, PackedBatch
from fastmae.config import load_run_config
from fastmae.data import PackedLoader
from fastmae.data.tokenizer import SENTENCEPIECE_FILE, load_tokenizer
from fastmae.errors import FastmaeError
from fastmae.pretrained import SHAPE_FIELDS, continued, initialise, load_pretrained, positions_note, source_kind

WORDS = "the cat dog bird sat ran flew on under over a big small red green blue mat tree sky".split()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepare_word_dataset(tmp_path_factory.mktemp("continued"), WORDS, 300, 40, vocab_size=40,
                                valid_fraction=0.1)


@pytest.fixture(scope="module")
def mlm_source(dataset, tmp_path_factory):
    """An mlm encoder (rotary, pre-LN: not the presets' shape) with the dataset's tokenizer, as a run directory."""
    vocab = load_tokenizer(dataset / SENTENCEPIECE_FILE).vocab_size
    model = tiny_model("mlm", seed=3, vocab_size=vocab, max_seq_len=64, position_embedding="rotary",
                       norm_position="pre", decoder_layers=0)
    return write_run_dir(tmp_path_factory.mktemp("source") / "run", model,
                         (dataset / SENTENCEPIECE_FILE).read_bytes())


def config_for(dataset, source, run_dir, *extra):
    return load_run_config(None, [f"data.path={dataset}", f"log.dir={run_dir}", f"train.init_from={source}",
                                  "data.tokens_per_micro_batch=256", *extra])


def a_batch(dataset):
    return next(iter(PackedLoader(dataset, max_seq_len=64, tokens_per_batch=256)))


@pytest.mark.parametrize("preset", ["mlm", "3ml", "mae-lm"])
def test_the_source_shape_and_weights_with_the_presets_objective(dataset, mlm_source, tmp_path, preset):
    config, source = continued(config_for(dataset, mlm_source, tmp_path, f"model.preset={preset}"))
    assert source_kind(mlm_source) == "run" and source.config.objective == "mlm"
    assert config.model.objective == preset
    assert all(getattr(config.model, f) == getattr(source.config, f) for f in SHAPE_FIELDS)
    torch.manual_seed(0)
    model = MaskedLM(config.model).eval()
    new = initialise(model, source)
    assert all(name.startswith("decoder") or name.startswith("insertion") for name in new), new
    assert (preset == "mlm") == (not new)
    batch = a_batch(dataset)
    reference = source.encoder().eval()
    with torch.no_grad():  # step 0: the source's hidden states, fp32
        expected, got = reference.encode(batch), model.encode(batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if preset == "mlm":  # and its masked-LM loss on the same masks
        original = MaskedLM(source.config).eval()
        original.load_state_dict(source.weights)
        with torch.no_grad():
            torch.testing.assert_close(model(batch, seed=1, step=0).loss, original(batch, seed=1, step=0).loss,
                                       rtol=1e-5, atol=1e-6)


def test_a_new_decoder_can_start_from_the_source_encoders_top_layers(dataset, mlm_source, tmp_path):
    config, source = continued(config_for(dataset, mlm_source, tmp_path, "model.preset=3ml", "model.decoder_layers=1",
                                          "train.init_decoder=top"))
    assert config.train.init_decoder == "top"
    model = MaskedLM(config.model)
    new = initialise(model, source, config.train.init_decoder)
    top = source.config.encoder_layers - 1
    for name, tensor in model.state_dict().items():
        if name.startswith("decoder.0."):
            assert torch.equal(tensor, source.weights[f"encoder.{top}.{name.split('.', 2)[2]}"]), name
    assert torch.equal(model.insertion.norm.weight, source.weights["embeddings.norm.weight"])
    assert not any(name.startswith(("decoder.", "insertion.")) for name in new), new  # (rotary: no position table)
    with pytest.raises(FastmaeError, match=r"train.init_decoder='bottom': must be one of \('new', 'top'\)"):
        config_for(dataset, mlm_source, tmp_path, "train.init_decoder=bottom")


def test_what_cannot_be_mapped_is_refused_naming_both(dataset, mlm_source, tmp_path):
    with pytest.raises(FastmaeError, match=rf"model.hidden_size=96 but train.init_from={mlm_source} is a model with "
                                           r"hidden_size=48: a continued run keeps its source's shape"):
        continued(config_for(dataset, mlm_source, tmp_path, "model.preset=3ml", "model.hidden_size=96"))
    config, _ = continued(config_for(dataset, mlm_source, tmp_path, "model.preset=3ml", "model.hidden_size=48"))
    assert config.model.hidden_size == 48  # the same value, set again: fine
    (tmp_path / "other").mkdir()
    other = prepare_word_dataset(tmp_path / "other", WORDS[:12], 200, 20, vocab_size=30, valid_fraction=0.1)
    with pytest.raises(FastmaeError, match=r"was tokenised with .*, not the tokenizer of train.init_from="):
        continued(config_for(other, mlm_source, tmp_path, "model.preset=3ml"))
    with pytest.raises(FastmaeError, match="not a fastmae run directory"):
        continued(config_for(dataset, tmp_path, tmp_path, "model.preset=3ml"))


def test_a_continued_run_trains_at_any_length_keeping_or_growing_a_learned_table(dataset, mlm_source, tmp_path):
    """Every weight taken and the same hidden states at shorter or longer sequences, the positions the source holds
    kept for shorter ones (a learned table whole; the export declares them all) and more for longer ones (a learned
    table grown, BERT's 128 then 512 tokens: the source's rows first); rotary bases may change too."""
    from fastmae.export import export

    vocab = load_tokenizer(dataset / SENTENCEPIECE_FILE).vocab_size
    learned = write_run_dir(tmp_path / "learned", tiny_model("mlm", seed=4, vocab_size=vocab, max_seq_len=64,
                                                             decoder_layers=0),
                            (dataset / SENTENCEPIECE_FILE).read_bytes())
    batch = next(iter(PackedLoader(dataset, max_seq_len=32, tokens_per_batch=256)))
    kept = " (its 64 positions kept)"
    notes = {(mlm_source, 32): kept, (mlm_source, 128): "", (learned, 32): kept,
             (learned, 128): " (learned positions from 64 on new)"}
    for (origin, length), table in notes.items():
        config, source = continued(config_for(dataset, origin, tmp_path / f"{length}", "model.preset=mlm",
                                              f"model.max_seq_len={length}"))
        assert config.model.max_seq_len == length and source.config.max_seq_len == 64
        model = MaskedLM(config.model).eval()
        assert initialise(model, source) == []
        with torch.no_grad():
            torch.testing.assert_close(model.encode(batch), source.encoder().eval().encode(batch), rtol=1e-5,
                                       atol=1e-5)
        assert positions_note(config.model, source.config) == (f"; sequences up to {length} tokens, the source's 64"
                                                               f"{table}")
        if origin == learned:
            rows, theirs = model.embeddings.positions.weight, source.weights["embeddings.positions.weight"]
            assert rows.shape[0] == theirs.shape[0] + max(0, length - 64) and torch.equal(rows[:len(theirs)], theirs)
    assert not torch.equal(rows[len(theirs):], torch.zeros_like(rows[len(theirs):]))  # the new rows initialised
    config, source = continued(config_for(dataset, learned, tmp_path, "model.preset=mlm", "model.max_seq_len=32"))
    assert config.model.describe().endswith("sequences up to 32 tokens of the 64 positions it holds")
    model = MaskedLM(config.model).eval()
    initialise(model, source)
    longest = next(iter(PackedLoader(dataset, max_seq_len=64, tokens_per_batch=256)))
    with torch.no_grad():  # sequences as long as its table (fine-tuning may read them): the source's states
        torch.testing.assert_close(model.encode(longest), source.encoder().eval().encode(longest), rtol=1e-5,
                                   atol=1e-5)
    run = write_run_dir(tmp_path / "at32", model, (dataset / SENTENCEPIECE_FILE).read_bytes())
    second, trained = continued(config_for(dataset, run, tmp_path, "model.preset=mlm", "model.max_seq_len=64"))
    assert (second.model.max_seq_len, second.model.max_positions) == (64, 0)  # BERT's second phase: all its table
    assert initialise(MaskedLM(second.model), trained) == []
    export(run, tmp_path / "hf")  # the table whole: 64 positions and RoBERTa's pad offset
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["max_position_embeddings"] == 64 + config.model.position_offset
    assert load_pretrained(tmp_path / "hf").config.position_capacity == 64
    with pytest.raises(FastmaeError, match="model.rotary_base=20000.0 but .* keeps its source's shape"):
        continued(config_for(dataset, learned, tmp_path, "model.preset=mlm", "model.rotary_base=20000"))
    config, source = continued(config_for(dataset, mlm_source, tmp_path, "model.preset=mlm",
                                          "model.rotary_base=20000"))
    assert config.model.rotary_base == 20000 and positions_note(config.model, source.config) == (
        "; rotary_base 20,000, the source's 10,000")


def test_a_two_rank_run_switches_a_modernbert_to_3ml_and_its_export_fine_tunes(tmp_path):
    """From a Hugging Face ModernBERT (random, small: local and global layers, a window shorter than the sequences)
    and data prepared with its byte-level BPE tokenizer, through DeepSpeed on 2 CPU ranks (ZeRO-2): 8 steps of 3ml
    (its local layers on the shortened stream). The run names its source and starts from its encoder; a rerun
    resumes from its own checkpoint; the export loads in AutoModelForMaskedLM and AutoTokenizer (the source's ids,
    fastmae's hidden states) and fine-tunes. (The other architectures take the same path: test_foreign.)"""
    transformers = pytest.importorskip("transformers")
    from synthetic import keyword_split
    from test_foreign import TEXTS, byte_level_bpe, corpus
    from test_modernbert import modernbert
    from test_train import launch, overrides

    from fastmae.export import export
    from fastmae.finetune import main as finetune_main
    from fastmae.prepare import prepare
    from fastmae.pretrained import read_origin

    source_dir = modernbert(byte_level_bpe(tmp_path / "bpe"), tmp_path / "modernbert")
    (tmp_path / "corpus.txt").write_text("\n".join(doc.replace("\n", " ") for doc in corpus(60)) + "\n")
    dataset = tmp_path / "data"
    prepare([tmp_path / "corpus.txt"], dataset, tokenizer_path=str(source_dir), valid_fraction=0.1, progress=False)
    run_dir = tmp_path / "continued"
    args = overrides(dataset, run_dir, steps=8, **{"model.preset": "3ml", "model.decoder_layers": 1,
                                                    "train.init_from": str(source_dir), "eval.every": 0,
                                                    "checkpoint.every": 4})
    args = [a for a in args if a.split("=")[0] not in ("model.hidden_size", "model.num_heads",
                                                         "model.encoder_layers", "model.intermediate_size",
                                                         "model.max_seq_len")]
    # its 128 rotary positions trained at 64, its global layers' rotary base doubled: no weight depends on either
    args += ["model.max_seq_len=64", "model.rotary_base=2000"]
    run = launch(args)
    assert run.returncode == 0, run.stderr[-3000:]
    said = next(line for line in run.stderr.splitlines() if "initialised from " in line)
    assert "new: decoder" in said and said.endswith("; sequences up to 64 tokens, the source's 128 (its 128 "
                                                    "positions kept); rotary_base "
                                                    "2,000, the source's 1,000"), said
    assert "local attention: 2 of 4 encoder layers" in run.stderr
    info = json.loads((run_dir / "run_info.json").read_text())
    assert info["init_from"]["foreign"] == "ModernBERT" and info["init_from"]["weights"].startswith(str(source_dir))
    trained, source = load_pretrained(run_dir), load_pretrained(source_dir)
    assert trained.config.objective == "3ml" and trained.tokenizer.sha256 == source.tokenizer.sha256
    changed = ("max_seq_len", "max_positions", "rotary_base")
    assert all(getattr(trained.config, f) == getattr(source.config, f) for f in SHAPE_FIELDS if f not in changed)
    assert [(getattr(trained.config, f), getattr(source.config, f)) for f in changed] == [(64, 128), (128, 0),
                                                                                            (2000, 1000)]
    assert trained.config.special_tokens == source.config.special_tokens
    assert max(len(row) for row in trained.tokenizer.encode(corpus(60))) > 8  # documents longer than the window
    moved = trained.weights["embeddings.tokens.weight"] - source.weights["embeddings.tokens.weight"]
    assert 0 < moved.abs().max() < 0.1  # trained on from the ModernBERT's embedding, not from a new one
    again = launch(args)  # a rerun resumes from its own checkpoint, not from the source
    assert again.returncode == 0 and "initialised from" not in again.stderr

    assert read_origin(run_dir).name == "ModernBERT"  # what its exports write back of the source (issue 57)
    export(run_dir, tmp_path / "hf")
    card = (tmp_path / "hf" / "README.md").read_text()
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 128  # trained at 64, still the source's 128 positions
    assert load_pretrained(tmp_path / "hf").config.rotary_base == 2000
    assert f"started from the Hugging Face ModernBERT encoder `{source.weights_file}`, then trained as `3ml`; " \
           "sequences up to 64 tokens, the source's 128 (its 128 positions kept); rotary_base 2,000, the source's " \
           "1,000\n" in card
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = [hf_tokenizer(text).input_ids for text in TEXTS]
    assert ids == [trained.tokenizer.frame(row) for row in trained.tokenizer.encode(TEXTS)]
    hf_model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    batch = PackedBatch.from_sequences(ids, special=trained.config.special_tokens)
    with torch.no_grad():
        ours = trained.encoder().eval().encode(batch)
        theirs = hf_model(**hf_tokenizer.pad({"input_ids": ids}, return_tensors="pt"),
                          output_hidden_states=True).hidden_states[-1]
    for i, row in enumerate(ids):
        assert (theirs[i, :len(row)] - ours[int(batch.cu_seqlens[i]):int(batch.cu_seqlens[i + 1])]).abs().max() <= 1e-5

    words = "the cat dog bird sat ran on under a big small red".split()
    keyword_split(tmp_path / "sst2" / "train.tsv", words, 96, seed=0)
    keyword_split(tmp_path / "sst2" / "dev.tsv", words, 32, seed=1)
    assert finetune_main(["--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ft"), "--task", "sst2", "--data",
                          str(tmp_path / "sst2"), "--seeds", "1", "--epochs", "2", "--batch-size", "16"]) == 0
    results = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert len(results["per_seed"][0]["history"]) == 2
