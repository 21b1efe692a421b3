"""`fastmae glue` on generated GLUE-format data: the protocols' grids, the plan under a budget (smallest tasks
first, finished cells free), a run of every task that resumes without redoing a finished cell, MNLI's two dev
sets, two models side by side, --from-mnli, the metrics against independent formulas, and fine-tunes that did not
train flagged."""

import json

import numpy as np
import pytest
from conftest import tiny_model
from synthetic import vocab_of, word_tokenizer_bytes, write_glue, write_run_dir

from fastmae.finetune import chance_loss, did_not_train
from fastmae.glue import main as glue_main
from fastmae.glue_plan import Setting, TaskData, find_tasks, grid, plan, within_budget
from fastmae.tasks import GLUE_TASKS, score

WORDS = "the cat dog bird sat ran flew on under over a big small red green blue mat tree sky".split()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny randomly initialised encoders (other seeds) with one word-level tokenizer, as run directories."""
    model_bytes = word_tokenizer_bytes(WORDS, 40)
    vocab = vocab_of(model_bytes)
    root = tmp_path_factory.mktemp("glue-models")
    return [str(write_run_dir(root / name, tiny_model("mae-lm", seed=seed, vocab_size=vocab, max_seq_len=64,
                                                      decoder_layers=1), model_bytes))
            for name, seed in (("first", 0), ("second", 1))]


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory):
    return write_glue(tmp_path_factory.mktemp("glue-data"), WORDS, n_train=96, n_dev=40)


def test_the_protocols_grids():
    papers = grid("rte", 768, "papers")
    assert [(s.lr, s.batch_size, s.epochs) for s in papers] == [
        (lr, b, 10) for lr in (1e-5, 2e-5, 3e-5) for b in (16, 32)]
    assert [s.lr for s in grid("rte", 384, "papers")] == pytest.approx([4 * s.lr for s in papers])  # by width
    assert grid("mnli", 768, "modernbert") == [Setting(5e-5, 64, 2, pytest.approx(1e-6 / 5e-5))]
    assert grid("rte", 128, "modernbert") == [Setting(1e-5, 16, 3, pytest.approx(1.0))]  # unscaled
    assert grid("wnli", 768, "modernbert") == []
    assert len(grid("cola", 768, "papers", quick=True)) == 1 and grid("cola", 768, "papers", True)[0].epochs == 1


def fake_tasks(sizes: dict[str, int]) -> dict[str, TaskData]:
    return {t: TaskData(GLUE_TASKS[t], None, None, {}, n) for t, n in sizes.items()}


def test_the_plan_under_a_budget_takes_the_smallest_tasks_first_and_counts_finished_cells_free():
    tasks = fake_tasks({"mnli": 1000, "rte": 100, "sst2": 500})
    cells = plan(["a", "b"], tasks, {"a": 768, "b": 768}, "papers", seeds=2, quick=False, from_mnli=False)
    assert len(cells) == 3 * 6 * 2 * 2
    assert [c.task for c in cells[:24]] == ["rte"] * 24 and cells[24].task == "sst2"
    assert [c.model for c in cells[:4]] == ["a", "b", "a", "b"]  # both models on each cell first
    kept, left = within_budget(cells, set(), tasks, max_cells=30, budget_s=0, examples_per_s=1)
    assert kept == cells[:30]
    assert left == ["SST-2: 18 of its 24 cells left out", "MNLI: 24 of its 24 cells left out"]
    kept, left = within_budget(cells, set(cells[24:26]), tasks, max_cells=30, budget_s=0, examples_per_s=1)
    assert len(kept) == 32 and left[0] == "SST-2: 16 of its 24 cells left out"  # two finished cells cost nothing
    # by time: each rte cell costs 10 epochs x 100 examples x 4/3 = 1333 s at 1 example/s
    kept, left = within_budget(cells, set(), tasks, max_cells=0, budget_s=1333.4 * 24, examples_per_s=1)
    assert kept == cells[:24] and left[0] == "SST-2: 24 of its 24 cells left out"
    with_mnli = plan(["a"], tasks, {"a": 768}, "papers", seeds=1, quick=False, from_mnli=True)
    assert with_mnli[0].task == "mnli"  # the tasks that start from MNLI come after it


def test_glue_runs_every_task_resumes_without_redoing_a_cell_and_reports_two_models(models, glue_dir, tmp_path,
                                                                                     capsys):
    out = tmp_path / "out"
    common = ["--model", models[0], "--model", models[1], "--data", str(glue_dir), "--out", str(out), "--quick",
              "--seeds", "2", "--precision", "fp32"]
    assert glue_main([*common, "--max-cells", "4"]) == 0
    first = json.loads((out / "glue.json").read_text())
    assert len(first["cells"]) == 4 and first["left_out"]
    done = {c["file"]: (out / c["file"]).stat().st_mtime_ns for c in first["cells"]}
    capsys.readouterr()
    assert glue_main(common) == 0
    said = capsys.readouterr().err
    result = json.loads((out / "glue.json").read_text())
    assert "24 cells planned (4 finished before), 20 to run" in said and result["left_out"] == []
    assert {c["file"]: (out / c["file"]).stat().st_mtime_ns for c in result["cells"] if c["file"] in done} == done
    assert sorted(result["tasks"]) == ["cola", "mnli", "mrpc", "rte", "sst2", "stsb"]
    for cell in result["cells"]:
        task = GLUE_TASKS[cell["task"]]
        assert len(cell["history"]) == 1 and set(task.metrics) <= set(cell["scores"])
        assert cell["scores"] == {k: v for k, v in cell["history"][0].items() if k in cell["scores"]}
        if cell["task"] == "mnli":  # both dev sets scored, every epoch
            assert "mismatched_accuracy" in cell["scores"]
    for model in models:
        scores = result["models"][model]
        assert set(scores["tasks"]) == set(result["tasks"]) and scores["average_over"] == list(result["tasks"])
        cola = [c["scores"]["matthews_correlation"] for c in result["cells"]
                if c["model"] == model and c["task"] == "cola"]
        assert scores["tasks"]["cola"]["headline"] == pytest.approx(float(np.median(cola)))
        assert scores["average"] == pytest.approx(np.mean([t["headline"] for t in scores["tasks"].values()]))
        assert scores["untrained"] == [t for t in scores["average_over"] if scores["tasks"][t]["did_not_train"]]
        if scores["untrained"]:  # an average counting a fine-tune that did not train is marked and said so
            assert f"{model}: GLUE average {100 * scores['average']:.1f} over 6 task(s); " \
                   f"{len(scores['untrained'])} of them with a seed that did not train" in said
    table = (out / "glue.md").read_text()
    assert "MNLI-m/mm (acc)" in table and "CoLA (MCC)" in table and "STS-B (Spearman)" in table
    assert table.startswith("# GLUE dev scores (papers protocol)\n\n**--quick**: one setting of each task for one")
    assert "not scores to report" in said and "CoLA lr 0.00512, batch 16, 1 epoch(s), 2 seed(s)" in table
    assert f"| `{models[0]}` |" in table and f"| `{models[1]}` |" in table
    assert "## Differences, held to the seed spread" in table and (out / "glue.png").stat().st_size > 0


def test_from_mnli_starts_rte_from_the_best_mnli_cell_and_never_reuses_a_cell_of_other_settings(models, glue_dir,
                                                                                                   tmp_path, capsys):
    """MNLI and RTE without --from-mnli, then with it: the second run fine-tunes RTE again from MNLI's encoder
    (glue.json's RTE cell says so), and MNLI again since the first run kept no classifier to start from; a third run
    reuses both; another maximum length runs every cell again. Each record names its context."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("MNLI", "RTE"):
        (data / name).symlink_to(glue_dir / name)
    out = tmp_path / "out"
    common = ["--model", models[0], "--data", str(data), "--out", str(out), "--quick", "--seeds", "1",
              "--precision", "fp32"]
    assert glue_main(common) == 0
    first = {c["task"]: c for c in json.loads((out / "glue.json").read_text())["cells"]}
    assert first["rte"]["init"] == "pretrained" and first["rte"]["context"]["init"] == "pretrained"
    capsys.readouterr()
    assert glue_main([*common, "--from-mnli"]) == 0
    assert "2 cells planned (0 finished before), 2 to run" in capsys.readouterr().err
    result = json.loads((out / "glue.json").read_text())
    cells = {c["task"]: c for c in result["cells"]}
    mnli_weights = (out / cells["mnli"]["file"]).with_suffix(".safetensors")
    assert cells["mnli"]["file"] == first["mnli"]["file"] and cells["mnli"]["init"] == "pretrained"
    assert mnli_weights.is_file() and result["from_mnli"] and cells["rte"]["init"].startswith(mnli_weights.name)
    assert cells["rte"]["context"]["init"] == "mnli" and cells["rte"]["file"] != first["rte"]["file"]
    assert glue_main([*common, "--from-mnli"]) == 0
    said = capsys.readouterr().err
    assert "2 cells planned (2 finished before), 0 to run" in said and "fine-tuned again" not in said
    # the MNLI cell RTE started from is no longer the one there (its weights changed): RTE is fine-tuned again from
    # the one there now, its record naming it
    from safetensors.torch import load_file, save_file

    save_file({k: v + 0.01 for k, v in load_file(str(mnli_weights)).items()}, str(mnli_weights))
    assert glue_main([*common, "--from-mnli"]) == 0
    assert "started from another MNLI cell than the model's best now; fine-tuned again" in capsys.readouterr().err
    again = {c["task"]: c for c in json.loads((out / "glue.json").read_text())["cells"]}
    assert again["rte"]["init"] != cells["rte"]["init"] and again["rte"]["init"].startswith(mnli_weights.name)
    assert glue_main([*common, "--from-mnli", "--max-seq-len", "32"]) == 0
    assert "2 cells planned (0 finished before), 2 to run" in capsys.readouterr().err
    assert {c["context"]["max_seq_len"] for c in json.loads((out / "glue.json").read_text())["cells"]} == {32}
    assert glue_main([*common, "--from-mnli", "--max-seq-len", "100000"]) == 0  # above the model's: said, capped
    said = capsys.readouterr().err
    assert "--max-seq-len 100000: capped at" in said and "2 cells planned (2 finished before)" in said


def test_the_grid_chooses_by_the_metric_it_reports_and_a_cell_cut_short_does_not_compete(models, glue_dir, tmp_path):
    """A real grid (3 rates x 2 seeds, one epoch) on MRPC, where accuracy is reported and F1 is not: the best cell is
    the setting whose median dev accuracy is highest, computed here from the cells. Then records where F1 and
    accuracy disagree, and a setting cut short by the budget with a better median: it competes only when no setting
    finished every seed, and the score says so."""
    from fastmae.glue import best_cells, glue, task_scores

    data = tmp_path / "data"
    data.mkdir()
    (data / "MRPC").symlink_to(glue_dir / "MRPC")
    result = glue([models[0]], data, tmp_path / "out", seeds=2, precision="fp32", epochs=1, batch_sizes=(16,))
    cells = result["cells"]
    assert len(cells) == 6 and GLUE_TASKS["mrpc"].metrics[0] == "accuracy"
    medians = {}
    for c in cells:
        medians.setdefault(c["lr"], []).append(c["scores"]["accuracy"])
    for c in cells:  # each cell's epoch was kept by accuracy too
        assert c["scores"]["accuracy"] == max(e["accuracy"] for e in c["history"])
    chosen = result["models"][models[0]]["tasks"]["mrpc"]
    assert chosen["headline_metric"] == "accuracy" and chosen["complete"]
    assert chosen["headline"] == pytest.approx(max(float(np.median(v)) for v in medians.values()))

    def record(lr, seed, accuracy, f1):
        return {"task": "mrpc", "lr": lr, "batch_size": 16, "epochs": 1, "weight_decay": 0.1, "seed": seed,
                "scores": {"accuracy": accuracy, "f1": f1}, "did_not_train": None, "file": f"{lr}-{seed}.json"}

    records = [record(1e-5, 0, 0.80, 0.50), record(1e-5, 1, 0.82, 0.52),  # accuracy's best
               record(2e-5, 0, 0.70, 0.90), record(2e-5, 1, 0.72, 0.92),  # F1's best
               record(3e-5, 0, 0.95, 0.95)]  # the budget cut it to one seed of two
    assert {r["lr"] for r in best_cells(records, "mrpc", seeds=2)} == {1e-5}
    assert {r["lr"] for r in best_cells(records, "mrpc")} == {3e-5}  # without the count it would win
    short = task_scores([records[-1]], "mrpc", seeds=2)  # nothing complete: it stands, and says so
    assert short["seeds"] == 1 and not short["complete"]
    stsb = [{**record(1e-5, 0, 0, 0), "task": "stsb", "scores": {"spearman": 0.9, "pearson": 0.1}},
            {**record(2e-5, 0, 0, 0), "task": "stsb", "scores": {"spearman": 0.1, "pearson": 0.9}}]
    assert task_scores(stsb, "stsb", 1)["lr"] == 1e-5 and task_scores(stsb, "stsb", 1)["headline_metric"] == "spearman"


def test_bad_input_is_named(models, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert glue_main(["--model", models[0], "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 1
    assert f"{tmp_path / 'empty'}: no GLUE task directory (expected any of CoLA, SST-2" in capsys.readouterr().err
    (tmp_path / "g" / "RTE").mkdir(parents=True)
    (tmp_path / "g" / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    with pytest.raises(Exception, match="RTE needs train.tsv and dev.tsv"):
        find_tasks(tmp_path / "g")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_match_independent_formulas(seed):
    """MCC is the Pearson correlation of two 0/1 variables; F1 from precision and recall; Spearman without ties is
    the correlation of argsort ranks."""
    rng = np.random.default_rng(seed)
    predictions, labels = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    assert score("matthews_correlation", predictions, labels) == pytest.approx(np.corrcoef(predictions, labels)[0, 1])
    precision = (predictions & labels).sum() / predictions.sum()
    recall = (predictions & labels).sum() / labels.sum()
    assert score("f1", predictions, labels) == pytest.approx(2 * precision * recall / (precision + recall))
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert score("pearson", x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert score("spearman", x, y) == pytest.approx(np.corrcoef(x.argsort().argsort(), y.argsort().argsort())[0, 1])


def test_a_fine_tune_that_predicts_one_class_or_stays_at_chance_is_flagged():
    sst2, stsb = GLUE_TASKS["sst2"], GLUE_TASKS["stsb"]
    assert chance_loss(sst2, np.array([0, 1, 0, 1])) == pytest.approx(np.log(2))
    assert chance_loss(sst2, np.array([0, 0, 0, 1])) == pytest.approx(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25)))
    assert chance_loss(stsb, np.array([1.0, 3.0])) == pytest.approx(1.0)

    def history(*epochs):
        return [{"train_loss": loss, "distinct_predictions": distinct} for loss, distinct in epochs]

    assert did_not_train(sst2, history((0.69, 2), (0.3, 2)), 2, np.log(2)) is None
    assert "predicts one class" in did_not_train(sst2, history((0.5, 1)), 1, np.log(2))
    stuck = did_not_train(sst2, history((0.70, 2), (0.692, 2)), 1, np.log(2))
    assert stuck.startswith("training loss 0.6920 stayed at chance (0.6931")
    assert "one value" in did_not_train(stsb, history((0.2, 1)), 1, 1.0)
