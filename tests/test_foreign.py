"""Hugging Face tokenizers and encoders fastmae did not make: a byte-level BPE (RoBERTa's specials, `<mask>` last)
and a WordPiece (BERT's) tokenizer trained with `tokenizers` on the embedded corpus prepare data whose special ids
travel with it; small random RoBERTa, BERT, ESM-2 and RoFormer models saved by transformers are read back computing
the same hidden states (fp32) and masked-LM predictions; what cannot be mapped is refused by name. The 2-rank run of 3ml
from the RoBERTa, its export and fine-tuning: test_continued.py."""

import dataclasses
import json
import shutil
from itertools import islice

import numpy as np
import pytest
import torch

from fastmae import PackedBatch
from fastmae.data import PackedLoader, ShardSet
from fastmae.data.builtin import builtin_documents
from fastmae.data.tokenizer import load_tokenizer
from fastmae.errors import FastmaeError
from fastmae.masking import mask_batch
from fastmae.model import MaskedLM
from fastmae.pretrained import load_pretrained, source_kind

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Naïve café façade in Zürich — “quoted” 東京 données",
         "emoji 🙂🚀 and accents: àéîõü ß Œ", "def f(x): return x ** 2  # a comment"]


def corpus(documents: int = 60) -> list[str]:
    return [text for _, text in islice(builtin_documents(), documents)]  # no module parsed for its docstrings


def save_tokenizer(rust, directory, **special):
    """`rust` (a tokenizers.Tokenizer) as the directory transformers saves: tokenizer.json, tokenizer_config.json."""
    transformers.PreTrainedTokenizerFast(tokenizer_object=rust, **special).save_pretrained(directory)
    return directory


def byte_level_bpe(directory, vocab_size: int = 400):
    """RoBERTa's kind of tokenizer: <s> 0, <pad> 1, </s> 2, <unk> 3 and <mask> after the trained pieces."""
    from tokenizers import AddedToken, ByteLevelBPETokenizer, processors

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus(), vocab_size=vocab_size, special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    bpe.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return save_tokenizer(bpe._tokenizer, directory, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                          sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")


def wordpiece(directory, vocab_size: int = 400):
    """BERT's kind of tokenizer: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, `[CLS] A [SEP] B [SEP]`."""
    from tokenizers import BertWordPieceTokenizer, processors

    bert = BertWordPieceTokenizer(lowercase=True)
    bert.train_from_iterator(corpus(), vocab_size=vocab_size,
                             special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    bert.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return save_tokenizer(bert._tokenizer, directory, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                          unk_token="[UNK]", mask_token="[MASK]")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return byte_level_bpe(tmp_path_factory.mktemp("bpe") / "tokenizer")


@pytest.fixture(scope="module")
def wordpiece_dir(tmp_path_factory):
    return wordpiece(tmp_path_factory.mktemp("wordpiece") / "tokenizer")


SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def foreign_model(kind: str, tokenizer_dir, directory, seed: int = 0):
    """A small random `kind` masked-LM (every parameter moved off its initial value) saved with its tokenizer."""
    tokenizer = load_tokenizer(tokenizer_dir)
    special = tokenizer.special
    common = dict(SHAPE, vocab_size=tokenizer.vocab_size, pad_token_id=special.pad)
    if kind == "roberta":
        config = transformers.RobertaConfig(**common, max_position_embeddings=64 + special.pad + 1,
                                            bos_token_id=special.bos, eos_token_id=special.eos, type_vocab_size=1)
    elif kind == "bert":
        config = transformers.BertConfig(**common, max_position_embeddings=64, type_vocab_size=2)
    elif kind == "esm":
        config = transformers.EsmConfig(**common, max_position_embeddings=64 + special.pad + 1,
                                        mask_token_id=special.mask, position_embedding_type="rotary",
                                        emb_layer_norm_before=True, token_dropout=False, hidden_act="gelu")
    else:
        config = transformers.RoFormerConfig(**common, embedding_size=SHAPE["hidden_size"], max_position_embeddings=64,
                                             type_vocab_size=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForMaskedLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_positions" not in name:  # RoFormer's sinusoidal table is a fixed function, not a weight
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(directory)
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, directory / path.name)
    return directory


@pytest.mark.parametrize("kind, tokenizer", [("roberta", "bpe"), ("bert", "wordpiece"), ("esm", "bpe"),
                                             ("roformer", "wordpiece")])
def test_a_foreign_encoder_computes_its_hidden_states_and_predictions_at_step_0(kind, tokenizer, bpe_dir,
                                                                                wordpiece_dir, tmp_path):
    directory = foreign_model(kind, bpe_dir if tokenizer == "bpe" else wordpiece_dir, tmp_path / kind)
    assert source_kind(directory) == "foreign"
    pretrained = load_pretrained(directory)
    assert pretrained.foreign and pretrained.config.objective == "mlm"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = [pretrained.tokenizer.frame(row) for row in pretrained.tokenizer.encode(TEXTS)]
    assert ids == [hf_tokenizer(text).input_ids for text in TEXTS]  # fastmae frames as the tokenizer does
    ids[1][2] = ids[2][4] = pretrained.config.mask_token_id  # <mask> inputs agree too
    batch = PackedBatch.from_sequences(ids, special=pretrained.config.special_tokens)
    model = pretrained.encoder().eval()
    hf_mlm = transformers.AutoModelForMaskedLM.from_pretrained(directory).eval()
    padded = hf_tokenizer.pad({"input_ids": ids}, return_tensors="pt")
    with torch.no_grad():
        ours = model.encode(batch)
        outputs = hf_mlm(**padded, output_hidden_states=True)
        logits = model.head(ours) @ model.embeddings.tokens.weight.T + model.head.bias
    for i, row in enumerate(ids):
        rows = slice(int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]))
        assert (outputs.hidden_states[-1][i, :len(row)] - ours[rows]).abs().max() <= 1e-5
        theirs = outputs.logits[i, :len(row)]
        if kind == "roformer":  # its token-type row folded into the tied token rows: one constant per row moves
            theirs, mine = theirs.log_softmax(-1), logits[rows].log_softmax(-1)
        else:
            mine = logits[rows]
        assert (theirs - mine).abs().max() <= 1e-4
    assert ours.abs().max() > 0.5  # real, non-vanishing states


def test_a_hugging_face_tokenizer_prepares_data_whose_special_ids_travel(bpe_dir, wordpiece_dir, tmp_path):
    from fastmae.config import load_run_config
    from fastmae.prepare import prepare

    (tmp_path / "corpus.txt").write_text("\n".join(doc.replace("\n", " ") for doc in corpus(40)) + "\n")
    for name, tokenizer_dir in (("bpe", bpe_dir), ("wordpiece", wordpiece_dir)):
        tokenizer = load_tokenizer(tokenizer_dir)
        out = tmp_path / name
        meta = prepare([tmp_path / "corpus.txt"], out, tokenizer_path=str(tokenizer_dir), valid_fraction=0.1,
                       progress=False)
        assert meta["special_tokens"] == tokenizer.special.as_dict() and meta["vocab_size"] == tokenizer.vocab_size
        assert load_tokenizer(out).sha256 == meta["tokenizer_sha256"] == tokenizer.sha256
        assert ShardSet(out).special_tokens == tokenizer.special
        # the model config takes the dataset's special ids (learned positions start after its pad id)
        model = load_run_config(None, [f"data.path={out}", "model.preset=mlm"]).model
        assert model.special_tokens == tokenizer.special and model.position_offset == tokenizer.special.pad + 1
        with pytest.raises(FastmaeError, match=rf"model.mask_token_id=7 but the dataset of data.path={out} has "
                                               rf"mask_token_id {tokenizer.special.mask}"):
            load_run_config(None, [f"data.path={out}", "model.preset=mlm", "model.mask_token_id=7"])
        batch = next(iter(PackedLoader(out, max_seq_len=64, tokens_per_batch=512)))
        tokens, cu = batch.tokens.numpy(), batch.cu_seqlens.numpy()
        assert (tokens[cu[:-1]] == tokenizer.special.bos).all() and (tokens[cu[1:] - 1] == tokenizer.special.eos).all()
        masked = mask_batch(batch, model.replace(mask_rate=0.5, mask_token_prob=0.5, random_token_prob=0.5), seed=0,
                            step=0)
        selection = masked.selection
        assert not np.isin(selection.labels.numpy(), tokenizer.special.unmaskable).any()  # specials never predicted
        changed = selection.input_tokens != batch.tokens
        assert (selection.input_tokens[selection.removed_index.long()] == tokenizer.special.mask).all()
        random_ids = selection.input_tokens[changed & (selection.input_tokens != tokenizer.special.mask)].numpy()
        assert random_ids.size and not np.isin(random_ids, list(tokenizer.special.as_dict().values())).any()
    # BERT's pairs: one separator; RoBERTa's: two (as each tokenizer's own post-processor frames them)
    for tokenizer_dir in (bpe_dir, wordpiece_dir):
        ours, theirs = load_tokenizer(tokenizer_dir), transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
        a, b = ours.encode(TEXTS[:2])
        assert ours.frame(a, b) == theirs(TEXTS[0], TEXTS[1]).input_ids


def test_special_tokens_a_config_does_not_name_are_the_tokenizers_conventional_ones(bpe_dir, wordpiece_dir, tmp_path):
    """roberta-base's and bert-base-uncased's hub tokenizer_config.json name no special token (transformers' classes
    default them): fastmae finds the same ids among tokenizer.json's special tokens."""
    for tokenizer_dir in (bpe_dir, wordpiece_dir):
        bare = tmp_path / tokenizer_dir.parent.name
        shutil.copytree(tokenizer_dir, bare)
        (bare / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
        (bare / "special_tokens_map.json").unlink(missing_ok=True)
        assert load_tokenizer(bare).special == load_tokenizer(tokenizer_dir).special


def test_what_cannot_be_mapped_is_refused_by_name(bpe_dir, tmp_path):
    partial = tmp_path / "no-mask"  # no file names a mask token, and <mask> is not a special token
    shutil.copytree(bpe_dir, partial)
    config_file = partial / "tokenizer_config.json"
    values = json.loads(config_file.read_text())
    values.pop("mask_token")
    config_file.write_text(json.dumps(values))
    (partial / "special_tokens_map.json").unlink(missing_ok=True)
    pipeline = json.loads((partial / "tokenizer.json").read_text())
    for token in pipeline["added_tokens"]:
        token["special"] = token["special"] and token["content"] != "<mask>"
    (partial / "tokenizer.json").write_text(json.dumps(pipeline))
    with pytest.raises(FastmaeError, match="no mask_token in tokenizer_config.json or special_tokens_map.json, and "
                                           "none of <mask> \\[MASK\\] among tokenizer.json's special tokens: "
                                           "fastmae needs the mask token"):
        load_tokenizer(partial)
    (partial / "tokenizer.json").unlink()
    with pytest.raises(FastmaeError, match=r"no-mask: no tokenizer \(tokenizer.model or tokenizer.json\)"):
        load_tokenizer(partial)

    model = foreign_model("roberta", bpe_dir, tmp_path / "roberta")
    config = json.loads((model / "config.json").read_text())
    for change, message in (({"hidden_act": "relu"}, "hidden_act='relu': fastmae's RoBERTa reader needs 'gelu'"),
                            ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
                            ({"model_type": "deberta-v2"}, "model_type 'deberta-v2': fastmae reads RoBERTa, BERT"),
                            ({"pad_token_id": 3}, "pad_token_id=3 but the tokenizer's pad token is 1"),
                            ({"hidden_size": None}, "config.json: no whole-number hidden_size")):
        (model / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(FastmaeError, match=message):
            load_pretrained(model)
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    with pytest.raises(FastmaeError, match=r"tokens, but .* was trained with vocab_size"):
        load_pretrained(model)


def test_a_foreign_encoder_is_taken_wherever_fastmae_takes_a_model(wordpiece_dir, tmp_path, capsys):
    """export (re-exported, transformers computes the BERT's hidden states, pairs with their segment ids included),
    analyze and finetune read the BERT directory itself, by the same path as fastmae's own models; fine-tuning it on
    a pair task, which would drop its second-segment embedding, is refused (finetune and glue)."""
    from synthetic import keyword_split

    from fastmae.analyze import main as analyze_main
    from fastmae.export import export
    from fastmae.finetune import main as finetune_main

    bert = foreign_model("bert", wordpiece_dir, tmp_path / "bert")
    export(bert, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "bert"  # a BERT comes back
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [tokenizer(t).input_ids for t in TEXTS] == [
        transformers.AutoTokenizer.from_pretrained(bert)(t).input_ids for t in TEXTS]
    # pairs with the segment ids the BERT tokenizer gives: the export keeps the BERT's second token-type row
    padded = tokenizer(TEXTS, TEXTS[::-1], padding=True, return_tensors="pt", return_token_type_ids=True)
    assert padded["token_type_ids"].any()
    with torch.no_grad():
        original = transformers.AutoModel.from_pretrained(bert).eval()(**padded).last_hidden_state
        again = transformers.AutoModel.from_pretrained(tmp_path / "hf").eval()(**padded).last_hidden_state
    real = padded["attention_mask"].bool()
    assert (original[real] - again[real]).abs().max() <= 1e-5
    # fine-tuning it on a pair task would drop that row: refused, by the BERT and by its export, naming why
    for model in (bert, tmp_path / "hf"):
        with pytest.raises(FastmaeError, match="MRPC is a pair task.*second-segment"):
            load_pretrained(model).refuse_pairs("MRPC", True)
        load_pretrained(model).refuse_pairs("SST-2", False)
    load_pretrained(foreign_model("roberta", wordpiece_dir, tmp_path / "roberta")).refuse_pairs("MRPC", True)
    from synthetic import write_glue

    from fastmae.glue import main as glue_main

    glue_dir = write_glue(tmp_path / "glue", "the cat dog bird sat ran on under a big small red".split(), 16, 8)
    capsys.readouterr()
    assert glue_main(["--model", str(bert), "--data", str(glue_dir), "--out", str(tmp_path / "g"), "--quick"]) == 1
    assert "is a pair task" in capsys.readouterr().err and not (tmp_path / "g").exists()  # before any work

    (tmp_path / "text.txt").write_text("\n".join(corpus(3)) + "\n")
    assert analyze_main(["--model", str(bert), "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "a"),
                         "--sequences", "8"]) == 0
    assert json.loads((tmp_path / "a" / "analysis.json").read_text())["objective"] == "mlm"
    words = "the cat dog bird sat ran on under a big small red".split()
    keyword_split(tmp_path / "sst2" / "train.tsv", words, 64, seed=0)
    keyword_split(tmp_path / "sst2" / "dev.tsv", words, 16, seed=1)
    assert finetune_main(["--model", str(bert), "--out", str(tmp_path / "ft"), "--task", "sst2", "--data",
                          str(tmp_path / "sst2"), "--seeds", "1", "--epochs", "1", "--batch-size", "16"]) == 0
    assert json.loads((tmp_path / "ft" / "results.json").read_text())["per_seed"][0]["history"]


def test_a_headless_bert_with_a_pooler_comes_back_a_bert(wordpiece_dir, tmp_path):
    """A `BertModel` (no MLM head, a pooler: every sentence-transformers model) exports as a BERT without a head:
    model_type bert, positions from 0, its token-type rows and pooler, computing the source's hidden states and pooled
    output on pairs (fp32, within 1e-5); so do an export of that export, and a run continued from it (the source's
    origin kept in the run directory; with the MLM head the run trained)."""
    from fastmae.checkpoint import write_weights
    from fastmae.export import export
    from fastmae.pretrained import write_origin

    tokenizer = load_tokenizer(wordpiece_dir)
    config = transformers.BertConfig(**SHAPE, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.special.pad,
                                     max_position_embeddings=64, type_vocab_size=2)
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=True)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    model.save_pretrained(tmp_path / "st")
    for path in wordpiece_dir.iterdir():
        shutil.copy(path, tmp_path / "st" / path.name)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "st")
    pairs = hf_tokenizer(TEXTS, TEXTS[::-1], padding=True, return_tensors="pt", return_token_type_ids=True)
    with torch.no_grad():
        expected = model.eval()(**pairs)

    def same_bert(directory, head: bool):
        hf = json.loads((directory / "config.json").read_text())
        assert hf["model_type"] == "bert" and hf["architectures"] == ["BertForMaskedLM" if head else "BertModel"]
        again, info = transformers.BertModel.from_pretrained(directory, output_loading_info=True)
        assert not info["missing_keys"], info  # the pooler came back
        with torch.no_grad():
            got = again.eval()(**pairs)
        real = pairs["attention_mask"].bool()
        assert (got.last_hidden_state[real] - expected.last_hidden_state[real]).abs().max() <= 1e-5
        assert (got.pooler_output - expected.pooler_output).abs().max() <= 1e-5

    export(tmp_path / "st", tmp_path / "hf")
    same_bert(tmp_path / "hf", head=False)
    export(tmp_path / "hf", tmp_path / "hf2")
    same_bert(tmp_path / "hf2", head=False)

    source = load_pretrained(tmp_path / "st")
    run_dir = tmp_path / "run"  # what a run continued from it leaves: its weights (a head trained), its origin
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    for path in wordpiece_dir.iterdir():
        shutil.copy(path, run_dir / path.name)
    torch.manual_seed(1)
    head = {name: t for name, t in MaskedLM(source.config).state_dict().items() if name.startswith("head.")}
    write_weights(run_dir / "model.safetensors", {**source.weights, **head}, dataclasses.asdict(source.config), 7)
    write_origin(run_dir, source.origin)
    export(run_dir, tmp_path / "hf3")
    same_bert(tmp_path / "hf3", head=True)
    masked = transformers.BertForMaskedLM.from_pretrained(tmp_path / "hf3")
    torch.testing.assert_close(masked.cls.predictions.transform.dense.weight, head["head.dense.weight"])


def test_sharded_and_pytorch_bin_checkpoints_read_the_same_weights(bpe_dir, tmp_path):
    """Larger models come as shards (model.safetensors.index.json), older ones as pytorch_model.bin."""
    single = load_pretrained(foreign_model("roberta", bpe_dir, tmp_path / "single"))
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "single")
    sharded, legacy = tmp_path / "sharded", tmp_path / "legacy"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    shutil.copytree(tmp_path / "single", legacy)
    (legacy / "model.safetensors").unlink()
    torch.save(model.state_dict(), legacy / "pytorch_model.bin")
    for directory in (sharded, legacy):
        for path in bpe_dir.iterdir():
            shutil.copy(path, directory / path.name)
        other = load_pretrained(directory)
        assert other.weights.keys() == single.weights.keys() and other.weights_file == directory
        assert all(torch.equal(other.weights[k], single.weights[k]) for k in single.weights)
    (legacy / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(FastmaeError, match="pytorch_model.bin: unreadable"):
        load_pretrained(legacy)
