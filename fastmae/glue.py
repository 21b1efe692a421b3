"""`fastmae glue`: every GLUE task found under a directory, fine-tuned the way the papers report it, several encoders
side by side.

    fastmae glue --model RUN_OR_EXPORT [--model OTHER ...] --data GLUE_DIR --out DIR
                 [--protocol papers|modernbert] [--from-mnli] [--seeds 5] [--max-cells N | --budget-hours H] [--quick]

GLUE_DIR holds the benchmark's own directories (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI; any subset).
A *cell* is one fine-tune: (model, task, learning rate, batch size, seed), scored on dev after every epoch (MNLI on
its matched and mismatched dev sets) and kept at its best epoch by the metric the task reports (`Task.metrics[0]`).
A cell is keyed by everything else that changes its result too (`CellContext`: its initialisation, the precision,
the maximum length, the model's weights and tokenizer, the task's files), so a finished cell is reused only for the
same settings. The protocols:

- `papers` (RoBERTa's GLUE recipe, which 3ML and MAE-LM follow): learning rates {1e-5, 2e-5, 3e-5} scaled by the
  model's width as `fastmae finetune` scales its default (`width_learning_rate`), batch sizes {16, 32}, 10 epochs,
  6% warm-up then linear decay, AdamW (0.9, 0.98, eps 1e-6, weight decay 0.1). A task's score is the median over
  seeds of its best grid cell on dev.
- `modernbert`: the settings of ModernBERT's `glue_jobs.py`, one cell per task and seed (MNLI 2 epochs at batch 64
  and 5e-5; RTE 3 at 16 and 1e-5; SST-2 3 at 16 and 3e-5; QQP 5 at 16 and 3e-5; QNLI 10 at 16 and 1e-5; CoLA 10 at
  32 and 5e-5; MRPC 10 at 32 and 8e-5; STS-B 10 at 32 and 3e-5; its decoupled weight decay converted to AdamW's),
  unscaled, so a fastmae encoder stands beside ModernBERT's reported scores. ModernBERT has no WNLI job.

`--from-mnli` starts RTE, MRPC and STS-B from the encoder of the model's best MNLI cell (its median seed), as RoBERTa
did; those cells are keyed by the MNLI cell they started from (its file and a digest of its weights), so a later run
whose best MNLI cell is another fine-tunes them again. Every finished cell is a file under DIR/cells; a rerun skips
them. `--max-cells` or `--budget-hours` plans the largest part of the grid that fits, smallest tasks first, and says
what it leaves out; a grid setting the budget cut short (fewer seeds than asked) competes for a task's best cell only
where no setting finished every seed, and the score says so (`complete: false`, marked ‡ in glue.md).

    DIR/glue.json   every cell (task, lr, batch, seed, metric per epoch, whether it trained) and each model's scores
    DIR/glue.md     one row per model: each task's score and the GLUE average (WNLI left out, as the papers average)
    DIR/glue.png    each task's score per model, with the range over seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .atomic import atomic_write_text
from .config import ModelConfig
from .data.shards import file_sha256
from .errors import FastmaeError, run_command
from .finetune import FinetuneConfig, framed_split, train_one_seed
from .glue_plan import (
    FROM_MNLI,
    QUICK,
    Cell,
    CellContext,
    TaskData,
    cell_cost,
    files_digest,
    find_tasks,
    plan,
    read_record,
    weights_digest,
    within_budget,
)
from .hardware import choose_precision
from .pretrained import MODEL_HELP, Pretrained, load_pretrained
from .tasks import GLUE_DIRS, GLUE_TASKS, load_split


# -------------------------------------------------------------------------------------------------- running
class Encoders:
    """Each model's pretrained weights and its tokenised tasks, read once; with `from_mnli`, the encoder of its best
    MNLI cell for the tasks that start from it."""

    def __init__(self, tasks: dict[str, TaskData], max_seq_len: int):
        self.tasks, self.max_seq_len = tasks, max_seq_len
        self._pretrained: dict[str, Pretrained] = {}
        self._framed: dict[tuple[str, str], tuple] = {}
        self._capped: set[int] = set()
        self._digests: dict[Path, str] = {}

    def pretrained(self, model: str) -> Pretrained:
        if model not in self._pretrained:
            self._pretrained[model] = load_pretrained(model)
        return self._pretrained[model]

    def length(self, config: ModelConfig) -> int:
        """The longest input for a model of `config`: --max-seq-len, at most the model's (a cap said once)."""
        most = config.position_capacity
        if self.max_seq_len > most and most not in self._capped:
            self._capped.add(most)
            log(f"--max-seq-len {self.max_seq_len}: capped at {most}, the most positions a model here has")
        return min(self.max_seq_len or config.max_seq_len, most)

    def data(self, model: str, task: str) -> tuple[tuple, tuple, dict[str, tuple]]:
        """(train, dev, other devs) of `task` in `model`'s tokens, each (sequences, labels)."""
        if (model, task) not in self._framed:
            files, pretrained = self.tasks[task], self.pretrained(model)
            length = self.length(pretrained.config)

            def framed(path: Path) -> tuple:
                return framed_split(load_split(path, files.task), pretrained.tokenizer, length)

            self._framed[model, task] = (framed(files.train), framed(files.dev),
                                         {name: framed(path) for name, path in files.other_devs.items()})
        return self._framed[model, task]

    def mnli_source(self, model: str, records: list[dict], seeds: int) -> tuple[Path, str]:
        """(the classifier of `model`'s best MNLI cell's median seed (cells of `seeds` seeds), what names it: its
        file and a digest of its weights). The cells that start from it are keyed by the second: a later run whose
        best MNLI cell is another fine-tunes them again."""
        best = task_scores([r for r in records if r["model"] == model and r["init"] == "pretrained"], "mnli", seeds)
        if best is None:
            raise FastmaeError(f"--from-mnli: {model} has no finished MNLI cell to start from (is MNLI under --data, "
                               "and inside the budget?)")
        weights_file = Path(best["median_cell"]).with_suffix(".safetensors")
        if weights_file not in self._digests:
            self._digests[weights_file] = file_sha256(weights_file)[:16]
        return weights_file, f"{weights_file.name}:{self._digests[weights_file]}"

    def from_mnli(self, model: str, records: list[dict], seeds: int) -> tuple[Pretrained, str]:
        """`model` with the encoder of its best MNLI cell (`mnli_source`), and what names that cell."""
        weights_file, source = self.mnli_source(model, records, seeds)
        from safetensors.torch import load_file

        classifier = load_file(str(weights_file))
        weights = {k.removeprefix("encoder."): v for k, v in classifier.items() if k.startswith("encoder.")}
        return dataclasses.replace(self.pretrained(model), weights=weights, weights_file=weights_file), source


def cell_contexts(encoders: Encoders, models: list[str], from_mnli: bool,
                  precision: str) -> dict[tuple[str, str], CellContext]:
    """The `CellContext` of every (model, task)."""
    weights = {m: weights_digest(encoders.pretrained(m)) for m in models}
    data = {t: files_digest([files.train, files.dev, *files.other_devs.values()])
            for t, files in encoders.tasks.items()}
    return {(m, t): CellContext("mnli" if from_mnli and t in FROM_MNLI else "pretrained", precision,
                                encoders.length(encoders.pretrained(m).config), weights[m], data[t])
            for m in models for t in encoders.tasks}


def run_cell(cell: Cell, encoders: Encoders, out: Path, precision: str, device: torch.device, records: list[dict],
             from_mnli: bool, seeds: int) -> dict:
    """Fine-tune one cell and write its record (MNLI cells keep their classifier when others start from it)."""
    pretrained, init = encoders.pretrained(cell.model), "pretrained"
    if from_mnli and cell.task in FROM_MNLI:
        pretrained, init = encoders.from_mnli(cell.model, records, seeds)
    train, dev, others = encoders.data(cell.model, cell.task)
    s = cell.setting
    config = FinetuneConfig(seeds=1, epochs=s.epochs, lr=s.lr, batch_size=s.batch_size, weight_decay=s.weight_decay,
                            precision=precision)
    file = cell.file(out)
    keep = file.with_suffix(".safetensors") if from_mnli and cell.task == "mnli" else None
    started = time.perf_counter()
    result = train_one_seed(pretrained, encoders.tasks[cell.task].task, train, dev, config, cell.seed, device, keep,
                            others)
    record = {"model": cell.model, "task": cell.task, **dataclasses.asdict(s), "seed": cell.seed, "init": init,
              "context": dataclasses.asdict(cell.context) if cell.context else None,
              "file": str(file), "seconds": round(time.perf_counter() - started, 2),
              "cost_examples": cell_cost(cell, encoders.tasks), **result}
    atomic_write_text(file, json.dumps(record, indent=1) + "\n")
    return record


# --------------------------------------------------------------------------------------------------- scores
def best_cells(records: list[dict], task: str, seeds: int = 0) -> list[dict]:
    """One model's finished cells of `task` at the grid setting whose median over seeds of the metric the task
    reports (`Task.metrics[0]`) is best on dev (the papers' choice), ordered by that metric; [] without a finished
    cell. With `seeds`, settings that finished fewer seeds (cut short by a budget) compete only where none finished
    them all."""
    reported = GLUE_TASKS[task].metrics[0]
    by_setting: dict[tuple, list[dict]] = {}
    for r in records:
        if r["task"] == task:
            by_setting.setdefault((r["lr"], r["batch_size"], r["epochs"], r["weight_decay"]), []).append(r)
    complete = [rows for rows in by_setting.values() if len(rows) >= seeds]
    candidates = complete or list(by_setting.values())
    if not candidates:
        return []
    cells = max(candidates, key=lambda rows: np.median([r["scores"][reported] for r in rows]))
    return sorted(cells, key=lambda r: r["scores"][reported])


def task_scores(records: list[dict], task: str, seeds: int = 0) -> dict | None:
    """One model's score on `task` from its finished cells (`best_cells`): every metric's median and per-seed values
    there, and whether that cell finished `seeds` seeds (`complete`); None without a finished cell."""
    cells = best_cells(records, task, seeds)
    if not cells:
        return None
    metrics = list(cells[0]["scores"])
    headline = GLUE_TASKS[task].metrics[0]
    return {"lr": cells[0]["lr"], "batch_size": cells[0]["batch_size"], "epochs": cells[0]["epochs"],
            "seeds": len(cells), "complete": len(cells) >= seeds,
            "median": {m: float(np.median([r["scores"][m] for r in cells])) for m in metrics},
            "per_seed": {m: [r["scores"][m] for r in cells] for m in metrics},
            "headline_metric": headline, "headline": float(np.median([r["scores"][headline] for r in cells])),
            "did_not_train": [f"seed {r['seed']}: {r['did_not_train']}" for r in cells if r["did_not_train"]],
            "median_cell": cells[(len(cells) - 1) // 2]["file"]}


def model_scores(records: list[dict], model: str, tasks: list[str], seeds: int = 0) -> dict:
    """{task: task_scores} of one model, and its GLUE average over the tasks it has, WNLI left out, with the tasks
    among those whose best cell holds a seed that did not train (`untrained`: the average then says nothing)."""
    mine = [r for r in records if r["model"] == model]
    scores = {t: task_scores(mine, t, seeds) for t in tasks}
    counted = [t for t, v in scores.items() if v is not None and t != "wnli"]
    average = float(np.mean([scores[t]["headline"] for t in counted])) if counted else None
    return {"tasks": {t: v for t, v in scores.items() if v is not None}, "average": average,
            "average_over": counted, "untrained": [t for t in counted if scores[t]["did_not_train"]]}


# -------------------------------------------------------------------------------------------------- command
def glue(models: list[str], data: Path, out: Path, protocol: str = "papers", seeds: int = 5, from_mnli: bool = False,
         max_cells: int = 0, budget_hours: float = 0.0, quick: bool = False, max_seq_len: int = 0,
         precision: str = "auto", **sizes) -> dict:
    """Plan, run (skipping finished cells) and report; returns what glue.json holds. `sizes`: `grid`'s epochs and
    batch_sizes in place of the protocol's (the study's presets)."""
    from .glue_report import write_report

    out = Path(out)
    tasks = find_tasks(data)
    encoders = Encoders(tasks, max_seq_len)
    widths = {m: encoders.pretrained(m).config.hidden_size for m in models}  # every model read before any work
    for model in models:
        for name, files in tasks.items():
            encoders.pretrained(model).refuse_pairs(GLUE_DIRS[name], len(files.task.text_fields) == 2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision, line = choose_precision(precision, device)
    if line:
        log(line)
    contexts = cell_contexts(encoders, models, from_mnli, precision)
    cells = plan(models, tasks, widths, protocol, seeds, quick, from_mnli, contexts, **sizes)
    if not cells:
        raise FastmaeError(f"--data {data}: the {protocol} protocol has no settings for "
                           f"{', '.join(GLUE_DIRS[t] for t in tasks)}")
    records = {c: r for c in cells if (r := read_record(c, out, from_mnli)) is not None}
    if budget_hours and not records:  # the first cell measures the speed the rest are planned at
        records[cells[0]] = run_cell(cells[0], encoders, out, precision, device, [], from_mnli, seeds)
    rate = sum(r["cost_examples"] for r in records.values()) / max(sum(r["seconds"] for r in records.values()), 1e-9)
    kept, left_out = within_budget(cells, set(records), tasks, max_cells, budget_hours * 3600, rate)
    for line in left_out:
        log(f"left out by the budget: {line}")
    todo = [c for c in kept if c not in records]
    log(f"{len(kept)} cells planned ({len(kept) - len(todo)} finished before), {len(todo)} to run; {len(tasks)} "
        f"task(s): {', '.join(GLUE_DIRS[t] for t in tasks)}")

    def started_elsewhere(cell: Cell) -> bool:  # (MNLI runs first: its cells are finished when this is asked)
        init = records[cell]["init"]
        return init != "pretrained" and init != encoders.mnli_source(cell.model, list(records.values()), seeds)[1]

    for cell in tqdm(kept, desc="cells", unit="cell", dynamic_ncols=True):
        if cell in records and not started_elsewhere(cell):
            continue
        if cell in records:
            log(f"{GLUE_DIRS[cell.task]} cell {cell.file(out).name}: started from another MNLI cell than the "
                "model's best now; fine-tuned again")
        records[cell] = run_cell(cell, encoders, out, precision, device, list(records.values()), from_mnli, seeds)
    finished = [records[c] for c in kept]
    result = {"protocol": protocol, "from_mnli": from_mnli, "seeds": seeds, "quick": quick, "sizes": sizes,
              "precision": precision, "max_seq_len": max_seq_len, "device": str(device), "tasks": list(tasks),
              "left_out": left_out, "models": {m: model_scores(finished, m, list(tasks), seeds) for m in models},
              "cells": finished}
    for path in write_report(out, result):
        log(f"wrote {path}")
    return result


def log(line: str) -> None:
    print(f"fastmae glue: {line}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae glue", description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--model", action="append", required=True,
                        help=f"{MODEL_HELP}; repeat for models side by side")
    parser.add_argument("--data", required=True, type=Path, help="GLUE directory (CoLA/, SST-2/, ... any subset)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (cells/, glue.json, glue.md)")
    parser.add_argument("--protocol", choices=["papers", "modernbert"], default="papers",
                        help="papers: RoBERTa's grid of rates x batch sizes, 10 epochs (default); modernbert: "
                             "ModernBERT's per-task settings")
    parser.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds per grid cell (default 5)")
    parser.add_argument("--from-mnli", action="store_true", help="start RTE, MRPC and STS-B from the best MNLI cell")
    parser.add_argument("--max-cells", type=int, default=0, help="run at most N new cells, smallest tasks first")
    parser.add_argument("--budget-hours", type=float, default=0.0,
                        help="run the new cells that fit in H hours (at the speed of the cells run so far)")
    parser.add_argument("--quick", action="store_true", help="one rate, batch 16, one epoch: checks that it runs")
    parser.add_argument("--max-seq-len", type=int, default=0, help="longest input (0: the model's)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go():
        if args.seeds < 1 or args.max_cells < 0 or args.budget_hours < 0:
            raise FastmaeError("--seeds must be positive, --max-cells and --budget-hours not negative")
        result = glue(args.model, args.data, args.out, args.protocol, args.seeds, args.from_mnli, args.max_cells,
                      args.budget_hours, args.quick, args.max_seq_len, args.precision)
        for model, entry in result["models"].items():
            average = "-" if entry["average"] is None else f"{100 * entry['average']:.1f}"
            untrained = (f"; {len(entry['untrained'])} of them with a seed that did not train (†), so the average "
                         "says nothing about the encoder" if entry["untrained"] else "")
            quick = f" (--quick: {QUICK})" if args.quick else ""
            log(f"{model}: GLUE average {average} over {len(entry['average_over'])} task(s){untrained}{quick}")

    return run_command("fastmae glue", go)


if __name__ == "__main__":
    sys.exit(main())
