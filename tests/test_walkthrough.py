"""The walk-through README gives a new user, end to end at tiny scale: a run with the demo's layers (pre-LN, rotary)
-> `fastmae export` (a Hugging Face directory with its model card) -> `transformers` loads it -> `fastmae finetune`
on a GLUE-format directory -> `fastmae analyze`; each command says where its outputs went and what to run next."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
import warm_python
from synthetic import keyword_split, prepare_word_dataset

from fastmae.analyze import main as analyze_main
from fastmae.export import main as export_main
from fastmae.finetune import main as finetune_main
from fastmae.finetune import width_learning_rate
from fastmae.hardware import choose_precision, has_native_bf16

transformers = pytest.importorskip("transformers")
pytest.importorskip("google.protobuf")

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the cat dog bird sat ran flew on under over a big small red green blue mat tree sky".split()


def test_run_export_transformers_finetune_analyze(tmp_path, capsys):
    data = prepare_word_dataset(tmp_path, WORDS, 300, 40, vocab_size=40, valid_fraction=0.1)
    run = tmp_path / "runs" / "tiny-cpu"
    settings = {"model.preset": "mlm", "model.hidden_size": 32, "model.num_heads": 2, "model.encoder_layers": 2,
                "model.intermediate_size": 64, "model.max_seq_len": 64, "model.norm_position": "pre",
                "model.position_embedding": "rotary", "data.path": str(data), "data.tokens_per_micro_batch": 256,
                "train.steps": 6, "train.warmup_steps": 2, "train.precision": "fp32", "eval.every": 3,
                "eval.sequences": 16, "checkpoint.every": 6, "log.every": 3, "log.dir": str(run),
                "log.tensorboard": False}
    trained = subprocess.run([*warm_python.COMMAND, "-m", "fastmae.train", *(f"{k}={v}" for k, v in settings.items())],
                             cwd=ROOT, env=warm_python.environment(), capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"next: fastmae export {run} exports/tiny-cpu" in trained.stderr
    assert "cuda graphs: eager: the device is cpu, not CUDA" in trained.stderr  # why the step is not replayed
    # what trains, and on how many tokens a step, before the first step
    assert ("model: objective `mlm`: insertion at layer 0 of 2, 0 decoder layer(s); pre-LN layers, rotary positions; "
            "width 32, 2 heads, vocabulary 40, sequences up to 64 tokens; ") in trained.stderr
    assert " parameters; a step: 1 rank(s) x 1 micro-batch(es) of 256 tokens" in trained.stderr
    plateau = "; it never fell 0.1 nats below the entropy: still on the unigram plateau"  # 6 steps learn no context
    assert plateau in trained.stderr

    exported = tmp_path / "exports" / "tiny-cpu"
    assert export_main([str(run), str(exported)]) == 0
    said = capsys.readouterr().err
    assert f"wrote {exported}" in said and "next: load it with transformers.AutoModel.from_pretrained" in said
    card = (exported / "README.md").read_text()
    for fact in ("library_name: transformers", "objective `mlm`: insertion at layer 0 of 2", "pre-LN layers, rotary "
                 "positions; width 32", "mask rate 0.15) and exported as Hugging Face ESM-2: ",
                 "Weights of step 6", "training tokens", "training FLOPs", "held-out masked-token loss at step 6",
                 "unigram entropy", "fastmae/train.py model.preset=mlm", "## Limitations",
                 "- learning rate: lr 0.0002: 2 warm-up steps, then polynomial (power 1) decay to 0 at step 6",
                 "- global batch: 1 rank(s) x 1 micro-batch(es) of at most 256 tokens (256 tokens a step)\n", plateau):
        assert fact in card, fact

    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModel.from_pretrained(exported).eval()
    with torch.no_grad():
        states = model(**tokenizer(["the cat sat on the mat"], return_tensors="pt")).last_hidden_state
    assert states.shape[0] == 1 and states.shape[2] == 32 and torch.isfinite(states).all()

    glue = tmp_path / "glue" / "SST-2"
    keyword_split(glue / "train.tsv", WORDS, 64, seed=0)
    keyword_split(glue / "dev.tsv", WORDS, 32, seed=1)
    assert finetune_main(["--model", str(exported), "--task", "sst2", "--data", str(glue), "--out",
                          str(tmp_path / "ft"), "--seeds", "1", "--epochs", "1"]) == 0
    said = capsys.readouterr().err
    assert f"wrote {tmp_path / 'ft' / 'results.json'}" in said and "next: fastmae analyze --model" in said
    # no --lr: the rate follows the width (RoBERTa's 2e-5 at 768 and ~1e-5 at 1024 would leave this one untrained)
    assert "learning rate 0.0115 for width 32" in said
    results = json.loads((tmp_path / "ft" / "results.json").read_text())
    assert results["resolved"]["lr"] == width_learning_rate(32) == pytest.approx(2e-5 * 24**2)
    # --precision auto: bf16 autocast on a CPU that multiplies bf16 natively and faster (measured once per process,
    # or pinned by FASTMAE_CPU_BF16), fp32 elsewhere; the log says which and why
    precision, why = choose_precision("auto", torch.device("cpu"))
    assert f"fastmae finetune: {why}" in said and results["resolved"]["precision"] == precision
    assert precision == "fp32" or has_native_bf16(torch.device("cpu"))
    assert results["config"]["lr"] == 0 and results["tokens_per_s"] > 0
    assert width_learning_rate(768) == 2e-5 and width_learning_rate(1024) == pytest.approx(1.125e-5)

    text = tmp_path / "held_out.txt"
    text.write_text("the big cat sat on the red mat\nthe small dog ran under a green tree\n" * 4)
    assert analyze_main(["--model", str(exported), "--data", str(text), "--out", str(tmp_path / "analysis"),
                         "--sequences", "8"]) == 0
    assert f"wrote {tmp_path / 'analysis' / 'analysis.json'}" in capsys.readouterr().err
