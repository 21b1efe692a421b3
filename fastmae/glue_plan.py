"""The plan of `fastmae glue`: the GLUE tasks under a directory, each protocol's grid, and the cells (model, task,
setting, seed) with the key of everything else that changes a cell's result (`CellContext`), their cost, the part a
budget keeps, and a finished cell's record."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .data.shards import file_sha256
from .errors import FastmaeError
from .finetune import other_dev_sets, width_learning_rate
from .pretrained import Pretrained
from .tasks import GLUE_DIRS, GLUE_TASKS, Task

FROM_MNLI = ("rte", "mrpc", "stsb")
PAPERS_RATES = (1e-5, 2e-5, 3e-5)
PAPERS_BATCHES = (16, 32)


@dataclass(frozen=True)
class Setting:
    """One grid cell's hyper-parameters (the seed apart)."""

    lr: float
    batch_size: int
    epochs: int
    weight_decay: float = 0.1


MODERNBERT = {  # task: (epochs, batch, lr, decoupled weight decay) from ModernBERT's glue_jobs.py
    "mnli": (2, 64, 5e-5, 1e-6), "rte": (3, 16, 1e-5, 1e-5), "sst2": (3, 16, 3e-5, 3e-6), "qqp": (5, 16, 3e-5, 3e-6),
    "qnli": (10, 16, 1e-5, 1e-6), "cola": (10, 32, 5e-5, 5e-6), "mrpc": (10, 32, 8e-5, 8e-6),
    "stsb": (10, 32, 3e-5, 3e-6)}

QUICK = ("one setting of each task for one epoch: a check that the pipeline runs, not the protocol's grid and epochs, "
         "so these are not scores to report")


def grid(task: str, width: int, protocol: str, quick: bool = False, epochs: int = 0,
         batch_sizes: tuple[int, ...] = ()) -> list[Setting]:
    """The (lr, batch, epochs) cells of `task` for a model of `width` under `protocol`; `quick`: the middle rate at
    batch 16 for one epoch (a check that everything runs, not a score). `epochs` and `batch_sizes` replace the
    papers' 10 epochs and {16, 32} (the study's presets size them to their budget)."""
    if protocol == "modernbert":
        if task not in MODERNBERT:
            return []
        epochs, batch, lr, decay = MODERNBERT[task]
        # Composer's DecoupledAdamW subtracts decay x (lr_t / lr_0) x w; torch's AdamW subtracts lr_t x wd x w
        return [Setting(lr, batch, 1 if quick else epochs, decay / lr)]
    scale = width_learning_rate(width) / 2e-5
    if quick:
        return [Setting(PAPERS_RATES[1] * scale, PAPERS_BATCHES[0], 1)]
    return [Setting(lr * scale, batch, epochs or 10) for lr in PAPERS_RATES for batch in batch_sizes or PAPERS_BATCHES]


@dataclass(frozen=True)
class TaskData:
    """One task's files under GLUE_DIR: train, dev and any further dev sets (MNLI's mismatched)."""

    task: Task
    train: Path
    dev: Path
    other_devs: dict[str, Path]
    train_examples: int


def task_directories(glue_dir: Path) -> dict[str, Path]:
    """{task: directory} of the GLUE task directories under `glue_dir` (CoLA, SST-2, ...: matched ignoring case and
    hyphens), whatever they hold."""
    directories = {p.name.lower().replace("-", ""): p for p in Path(glue_dir).iterdir() if p.is_dir()}
    return {name: path for name, path in directories.items() if name in GLUE_DIRS}


def find_tasks(glue_dir: Path) -> dict[str, TaskData]:
    """The GLUE tasks present under `glue_dir`, smallest training set first; an error naming what was expected when
    none is."""
    glue_dir = Path(glue_dir)
    if not glue_dir.is_dir():
        raise FastmaeError(f"--data {glue_dir}: no such directory")
    present = task_directories(glue_dir)
    found = {}
    for name, standard in GLUE_DIRS.items():
        directory = present.get(name)
        if directory is None:
            continue
        task = GLUE_TASKS[name]
        dev = next((directory / f for f in task.dev_files if (directory / f).is_file()), None)
        if not (directory / "train.tsv").is_file() or dev is None:
            raise FastmaeError(f"{directory}: {standard} needs train.tsv and {' or '.join(task.dev_files)}")
        lines = sum(1 for line in (directory / "train.tsv").open(encoding="utf-8-sig") if line.strip())
        found[name] = TaskData(task, directory / "train.tsv", dev, other_dev_sets(task, dev), lines)
    if not found:
        raise FastmaeError(f"{glue_dir}: no GLUE task directory (expected any of {', '.join(GLUE_DIRS.values())})")
    return dict(sorted(found.items(), key=lambda item: item[1].train_examples))


# ----------------------------------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class CellContext:
    """What changes a cell's result beside its grid setting and seed: a cell of another context is never reused."""

    init: str  # "pretrained", or "mnli": from the model's best MNLI cell (--from-mnli)
    precision: str  # as resolved on this machine
    max_seq_len: int  # the longest input, as resolved for the model
    weights: str  # sha256 of the model's weights and tokenizer (a retrained run directory is another model)
    data: str  # sha256 of the task's train and dev files

    def key(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Cell:
    """One fine-tune of the plan."""

    model: str
    task: str
    setting: Setting
    seed: int
    context: CellContext | None = None

    def file(self, out: Path) -> Path:
        """Where its finished record lives: the setting, the seed and the context's key in its name."""
        s = self.setting
        key = f"-{self.context.key()}" if self.context else ""
        return (out / "cells" / model_key(self.model) / self.task /
                f"lr{s.lr:.3g}-b{s.batch_size}-e{s.epochs}-wd{s.weight_decay:.3g}-seed{self.seed}{key}.json")


def model_key(model: str) -> str:
    """A directory name for a model: its own name and a hash of its resolved path."""
    path = Path(model).resolve()
    return f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def plan(models: list[str], tasks: dict[str, TaskData], widths: dict[str, int], protocol: str, seeds: int,
         quick: bool, from_mnli: bool, contexts: dict[tuple[str, str], CellContext] | None = None,
         **sizes) -> list[Cell]:
    """Every cell: tasks smallest first (MNLI first with `from_mnli`, since tasks start from it), then grid setting,
    seed and model, so that a plan cut short still compares the models on the same cells. `contexts`: each (model,
    task)'s `CellContext`; `sizes`: grid's epochs and batch_sizes."""
    order = sorted(tasks, key=lambda t: (not (from_mnli and t == "mnli"), tasks[t].train_examples))
    grids = {(m, t): grid(t, widths[m], protocol, quick, **sizes) for m in models for t in order}
    return [Cell(m, t, grids[m, t][i], seed, (contexts or {}).get((m, t))) for t in order
            for i in range(len(grids[models[0], t])) for seed in range(seeds) for m in models]


def weights_digest(pretrained: Pretrained) -> str:
    """sha256 of a model's weights (names, shapes and bytes) and its tokenizer's identity."""
    digest = hashlib.sha256(pretrained.tokenizer.sha256.encode())
    for name in sorted(pretrained.weights):
        tensor = pretrained.weights[name].detach().cpu().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def files_digest(paths: list[Path]) -> str:
    """sha256 of the files' own sha256s, in order."""
    return hashlib.sha256(" ".join(file_sha256(Path(path)) for path in paths).encode()).hexdigest()


def cell_cost(cell: Cell, tasks: dict[str, TaskData]) -> float:
    """A cell's work in training examples (each dev pass counted as a third of a training pass over it)."""
    return cell.setting.epochs * tasks[cell.task].train_examples * 4 / 3


def within_budget(cells: list[Cell], done: set[Cell], tasks: dict[str, TaskData], max_cells: int,
                  budget_s: float, examples_per_s: float) -> tuple[list[Cell], list[str]]:
    """(the cells to run, in order, finished ones free; lines naming what the budget leaves out per task)."""
    kept, new, spent, left = [], 0, 0.0, {}
    for cell in cells:
        if cell in done:
            kept.append(cell)
            continue
        cost = cell_cost(cell, tasks) / examples_per_s if budget_s else 0.0
        if (max_cells and new >= max_cells) or (budget_s and spent + cost > budget_s):
            left[cell.task] = left.get(cell.task, 0) + 1
            continue
        kept.append(cell)
        new, spent = new + 1, spent + cost
    totals = {t: sum(c.task == t for c in cells) for t in left}
    return kept, [f"{GLUE_DIRS[t]}: {n} of its {totals[t]} cells left out" for t, n in left.items()]


def read_record(cell: Cell, out: Path, from_mnli: bool) -> dict | None:
    """A finished cell's record of the same context, or None; with `from_mnli`, an MNLI cell counts as finished only
    where it kept its classifier (one fine-tuned without --from-mnli did not: it runs again, keeping it)."""
    file = cell.file(out)
    if not file.is_file() or (from_mnli and cell.task == "mnli" and not file.with_suffix(".safetensors").is_file()):
        return None
    record = json.loads(file.read_text())
    expected = dataclasses.asdict(cell.context) if cell.context else None
    return record if record.get("context") == expected else None
