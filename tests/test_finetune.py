"""`fastmae finetune`: the GLUE layouts read right, metrics against hand-computed values, a model that learns a
generated task, the same score from a run directory and its export, and bad input refused with nothing written."""

import json

import numpy as np
import pytest
import torch
from conftest import CUDA_HEADS, tiny_model
from synthetic import keyword_split, vocab_of, word_tokenizer_bytes, write_run_dir

from fastmae.errors import FastmaeError
from fastmae.finetune import main as finetune_main
from fastmae.finetune import pair_lengths
from fastmae.tasks import GLUE_TASKS, load_split, score

WORDS = "the cat dog bird sat ran flew on under over a big small red green blue mat tree sky".split()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny randomly initialised `mae-lm` model with a word-level tokenizer, as a run directory."""
    model_bytes = word_tokenizer_bytes(WORDS, 40)
    model = tiny_model("mae-lm", vocab_size=vocab_of(model_bytes), max_seq_len=64, dropout=0.1,
                       attention_dropout=0.1, decoder_layers=1, **CUDA_HEADS)  # its bf16 case runs on CUDA too
    return write_run_dir(tmp_path_factory.mktemp("ft") / "run", model, model_bytes)


def test_glue_layouts(tmp_path):
    cola = tmp_path / "cola.tsv"  # no header: source, label, original judgement, sentence
    cola.write_text('gj04\t1\t\tThe "cat" sat.\nclc95\t0\t*\tCat the sat on.\n')
    split = load_split(cola, GLUE_TASKS["cola"])
    assert split.texts == [('The "cat" sat.',), ("Cat the sat on.",)] and split.labels.tolist() == [1, 0]

    mrpc = tmp_path / "mrpc.tsv"  # byte-order mark, quotes left alone, a pair
    mrpc.write_bytes("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t7\t8\t\"He said\t\"she said\n"
                     .encode("utf-8"))
    split = load_split(mrpc, GLUE_TASKS["mrpc"])
    assert split.texts == [('"He said', '"she said')] and split.labels.tolist() == [1]

    mnli = tmp_path / "mnli"  # dev_matched.tsv serves as dev; the label is the last column, by name
    mnli.mkdir()
    header = "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label"
    (mnli / "dev_matched.tsv").write_text(f"{header}\n0\t1\t2\tfiction\tA b.\tC d.\tneutral\tneutral\n")
    assert load_split(mnli / "dev_matched.tsv", GLUE_TASKS["mnli"]).labels.tolist() == [2]

    stsb = tmp_path / "stsb.tsv"
    stsb.write_text("index\tgenre\tsentence1\tsentence2\tscore\n0\tnews\ta\tb\t3.800\n1\tnews\tc\td\t0\n")
    assert load_split(stsb, GLUE_TASKS["stsb"]).labels.tolist() == pytest.approx([3.8, 0.0])


@pytest.mark.parametrize("content, task, message", [
    ("sentence\tlabel\nthe cat\t2\n", "sst2", ":2: label='2' is not one of 0, 1"),
    ("text\tlabel\nthe cat\t1\n", "sst2", ":1: header has no column 'sentence'"),
    ("sentence\tlabel\n", "sst2", "no examples"),
    ("gj04\t1\n", "cola", ":1: 2 columns, the cola layout needs 4"),
    ("index\tsentence1\tsentence2\tscore\n0\ta\tb\tnan\n", "stsb", "score='nan' is not a finite number"),
    ("index\tsentence1\tsentence2\tlabel\n0\ta\n", "rte", ":2: 2 columns, the header has 4"),
])
def test_bad_splits_name_file_line_and_value(content, task, message, tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text(content)
    with pytest.raises(FastmaeError, match=message.replace("(", r"\(")) as error:
        load_split(path, GLUE_TASKS[task])
    assert str(path) in str(error.value)


def test_metrics_against_hand_computed_values():
    predictions, labels = np.array([1, 1, 0, 0, 1, 0]), np.array([1, 0, 0, 1, 1, 0])
    # tp 2, fp 1, fn 1, tn 2
    assert score("accuracy", predictions, labels) == pytest.approx(4 / 6)
    assert score("f1", predictions, labels) == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))
    assert score("matthews_correlation", predictions, labels) == pytest.approx((2 * 2 - 1 * 1) / 9)
    assert score("matthews_correlation", np.ones(6, dtype=int), labels) == 0.0  # constant: 0, not NaN
    x, y = np.array([1.0, 2.0, 2.0, 4.0]), np.array([10.0, 20.0, 30.0, 40.0])
    assert score("pearson", x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    # ties get their average rank: x ranks 1, 2.5, 2.5, 4
    assert score("spearman", x, y) == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1])


def test_pair_truncation_is_longest_first():
    assert pair_lengths(3, 4, 10) == (3, 4)
    assert pair_lengths(20, 3, 10) == (7, 3)
    assert pair_lengths(3, 20, 10) == (3, 7)
    assert pair_lengths(20, 30, 10) == (5, 5)
    assert pair_lengths(20, 30, 11) == (5, 6)


def test_learns_a_generated_task_and_scores_the_same_from_run_and_export(run_dir, tmp_path):
    keyword_split(tmp_path / "sst2" / "train.tsv", WORDS, 256, seed=0)
    keyword_split(tmp_path / "sst2" / "dev.tsv", WORDS, 64, seed=1)
    common = ["--task", "sst2", "--data", str(tmp_path / "sst2"), "--seeds", "2", "--epochs", "8", "--lr", "1e-3",
              "--batch-size", "16"]
    assert finetune_main(["--model", str(run_dir), "--out", str(tmp_path / "a"), *common]) == 0
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    assert results["task"] == "sst2" and results["metric"] == "accuracy"
    assert [s["seed"] for s in results["per_seed"]] == [0, 1]
    assert results["median"]["accuracy"] >= 0.9, results["per_seed"]
    assert all(len(s["history"]) == 8 for s in results["per_seed"])
    assert (tmp_path / "a" / "seed1" / "best.safetensors").is_file()

    pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    from fastmae.export import export

    export(run_dir, tmp_path / "hf")
    assert finetune_main(["--model", str(tmp_path / "hf"), "--out", str(tmp_path / "b"), *common]) == 0
    again = json.loads((tmp_path / "b" / "results.json").read_text())
    assert untimed(again["per_seed"]) == untimed(results["per_seed"])


def untimed(per_seed: list[dict]) -> list[dict]:
    """per_seed results without the tokens/s of each epoch (a measurement, not a result)."""
    return [{**s, "history": [{k: v for k, v in e.items() if k != "tokens_per_s"} for e in s["history"]]}
            for s in per_seed]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="fine-tuning on CUDA (scripts/gpu_check.sh runs it)"))])
def test_bf16_autocast_scores_like_fp32(device, run_dir, tmp_path, monkeypatch, capsys):
    # on CUDA `auto` is bf16 autocast (sm_80+); on this CPU it is asked for: both learn the task as fp32 does
    if device == "cpu":
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    keyword_split(tmp_path / "sst2" / "train.tsv", WORDS, 256, seed=0)
    keyword_split(tmp_path / "sst2" / "dev.tsv", WORDS, 64, seed=1)
    common = ["--model", str(run_dir), "--task", "sst2", "--data", str(tmp_path / "sst2"), "--seeds", "1",
              "--epochs", "6", "--lr", "1e-3", "--batch-size", "16"]
    scores = {}
    for precision in ("fp32", "auto" if device == "cuda" else "bf16"):
        assert finetune_main([*common, "--out", str(tmp_path / precision), "--precision", precision]) == 0
        results = json.loads((tmp_path / precision / "results.json").read_text())
        assert results["resolved"]["precision"] == ("fp32" if precision == "fp32" else "bf16")
        err = capsys.readouterr().err
        assert results["tokens_per_s"] > 0 and "training tokens/s" in err
        # attention dropout on: CPU's math path; on CUDA flash-attn's varlen kernel where installed (bf16), else
        # padded SDPA
        attention = results["resolved"]["attention"]
        assert f"attention {attention}" in err
        assert attention.split()[0] in (("flash", "padded") if device == "cuda" else ("math",)), attention
        scores[precision] = results["median"]["accuracy"]
    assert min(scores.values()) >= 0.9 and max(scores.values()) - min(scores.values()) <= 0.05, scores


def test_regression_and_custom_jsonl(run_dir, tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 48), ("dev", 16)):
        rows = []
        for _ in range(n):
            a, b = " ".join(rng.choice(WORDS, 4)), " ".join(rng.choice(WORDS, 5))
            rows.append(json.dumps({"premise": a, "hypothesis": b, "score": float(a.count("cat") + b.count("cat"))}))
        (tmp_path / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    assert finetune_main(["--model", str(run_dir), "--task", "custom", "--train", str(tmp_path / "train.jsonl"),
                          "--dev", str(tmp_path / "dev.jsonl"), "--text-fields", "premise,hypothesis",
                          "--label-field", "score", "--problem", "regression", "--out", str(tmp_path / "out"),
                          "--seeds", "1", "--epochs", "1"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(results["median"]) == {"pearson", "spearman"} and results["labels"] is None


def test_the_summary_says_when_its_median_counts_a_seed_that_did_not_train(tmp_path, monkeypatch, capsys):
    import fastmae.finetune

    keyword_split(tmp_path / "sst2" / "train.tsv", WORDS, 8, seed=0)
    keyword_split(tmp_path / "sst2" / "dev.tsv", WORDS, 8, seed=1)
    args = ["--model", "unused", "--task", "sst2", "--data", str(tmp_path / "sst2"), "--out", str(tmp_path / "out"),
            "--seeds", "3"]
    for failed, said in (([], "median of 3 seeds: accuracy 0.8000"),
                         ([0], "median of 3 seeds (1 of them did not train; the median counts its score): accuracy"),
                         ([0, 2], "median of 3 seeds (2 of them did not train; the median counts theirs): accuracy")):
        per_seed = [{"seed": s, "did_not_train": "predicts one class" if s in failed else None} for s in range(3)]
        monkeypatch.setattr(fastmae.finetune, "finetune", lambda *a, per_seed=per_seed, failed=failed: {
            "median": {"accuracy": 0.8}, "per_seed": per_seed, "did_not_train": failed, "tokens_per_s": 1.0})
        assert finetune_main(args) == 0
        err = capsys.readouterr().err
        assert said in err and err.count("did not train: predicts one class") == len(failed), err


def test_bad_input_writes_nothing(run_dir, tmp_path, capsys):
    keyword_split(tmp_path / "sst2" / "train.tsv", WORDS, 8, seed=0)
    (tmp_path / "sst2" / "dev.tsv").write_text("sentence\tlabel\nthe cat\tpositive\n")
    out = tmp_path / "out"
    args = ["--task", "sst2", "--data", str(tmp_path / "sst2"), "--out", str(out), "--seeds", "1"]
    assert finetune_main(["--model", str(run_dir), *args]) == 1
    assert "dev.tsv:2: label='positive' is not one of 0, 1" in capsys.readouterr().err
    assert finetune_main(["--model", str(tmp_path), *args]) == 1
    assert "not a fastmae run directory" in capsys.readouterr().err
    assert finetune_main(["--model", str(run_dir), "--task", "sst2", "--data", str(tmp_path / "none"),
                          "--out", str(out)]) == 1
    assert "no such directory" in capsys.readouterr().err
    assert not out.exists()


def test_a_model_with_the_relative_bias_fine_tunes_with_its_table(tmp_path):
    """model.relative_attention_bias (the mae-lm recipes): `fastmae finetune --model RUN_DIR` loads the pretrained
    bias table, runs the encoder with it (attention dropout on: the CPU math backend) and learns the task."""
    from safetensors.torch import load_file

    model_bytes = word_tokenizer_bytes(WORDS, 40)
    model = tiny_model("mae-lm", vocab_size=vocab_of(model_bytes), max_seq_len=64, dropout=0.1,
                       attention_dropout=0.1, decoder_layers=1, relative_attention_bias=True)
    with torch.no_grad():
        model.relative_bias.normal_(mean=3.0, std=1.0)  # far from a fresh init (std initializer_range)
    run = write_run_dir(tmp_path / "run", model, model_bytes)
    keyword_split(tmp_path / "sst2" / "train.tsv", WORDS, 256, seed=0)
    keyword_split(tmp_path / "sst2" / "dev.tsv", WORDS, 64, seed=1)
    assert finetune_main(["--model", str(run), "--out", str(tmp_path / "out"), "--task", "sst2", "--data",
                          str(tmp_path / "sst2"), "--seeds", "1", "--epochs", "8", "--lr", "1e-3",
                          "--batch-size", "16"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["median"]["accuracy"] >= 0.9, results["per_seed"]
    tuned = {name: t for name, t in load_file(tmp_path / "out" / "seed0" / "best.safetensors").items()
             if name.endswith("relative_bias")}
    assert len(tuned) == 1, "the fine-tuned encoder has no bias table"
    (table,) = tuned.values()
    pretrained = model.relative_bias.detach()
    assert table.shape == pretrained.shape and 0 < (table - pretrained).abs().max() < 0.5  # loaded, then tuned
