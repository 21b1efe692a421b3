"""Fine-tuning tasks: the GLUE TSV layouts, custom TSV/JSONL files, label sets and metrics.

GLUE files are read as the benchmark ships them: tab-separated with no quote processing (text may hold `"`), a
header row (all but CoLA) or none (CoLA, whose header-less layout is source, label, original judgement, sentence),
and a byte-order mark at the start of MRPC's files. A file whose first row names the task's columns is read by
those names, whatever the task. Every error names the file, the line and the value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import FastmaeError


@dataclass(frozen=True)
class Task:
    """How to read one task and score it.

    text_fields: one (single sentence) or two (pair) column names. label_field: the label's column.
    labels: the label set in class-index order (None: regression). positional: column indices of
    (text fields..., label) for files without a header row (None: a header is required).
    metrics: names of the scores; the first is the one reported (what RoBERTa's, COCO-LM's and MAE-LM's GLUE dev
    tables give: accuracy for MRPC and QQP, Spearman for STS-B, Matthews for CoLA) and the one that picks the best
    epoch, the best grid cell and the median, so a score is chosen by what it reports. dev_files: the first that
    exists is the dev set; other_dev_files: (name, file) of dev sets scored beside it where they exist.
    """

    name: str
    text_fields: tuple[str, ...]
    label_field: str
    labels: tuple[str, ...] | None
    metrics: tuple[str, ...]
    positional: tuple[int, ...] | None = None
    dev_files: tuple[str, ...] = ("dev.tsv",)
    other_dev_files: tuple[tuple[str, str], ...] = ()  # (name, file): further dev sets scored beside, e.g. MNLI-mm

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_outputs(self) -> int:
        return 1 if self.labels is None else len(self.labels)


BINARY = ("0", "1")
ENTAILMENT = ("entailment", "not_entailment")
GLUE_TASKS = {
    "cola": Task("cola", ("sentence",), "label", BINARY, ("matthews_correlation", "accuracy"), positional=(3, 1)),
    "sst2": Task("sst2", ("sentence",), "label", BINARY, ("accuracy",)),
    "mrpc": Task("mrpc", ("#1 String", "#2 String"), "Quality", BINARY, ("accuracy", "f1")),
    "stsb": Task("stsb", ("sentence1", "sentence2"), "score", None, ("spearman", "pearson")),
    "qqp": Task("qqp", ("question1", "question2"), "is_duplicate", BINARY, ("accuracy", "f1")),
    "mnli": Task("mnli", ("sentence1", "sentence2"), "gold_label", ("contradiction", "entailment", "neutral"),
                 ("accuracy",), dev_files=("dev_matched.tsv", "dev.tsv"),
                 other_dev_files=(("mismatched", "dev_mismatched.tsv"),)),
    "qnli": Task("qnli", ("question", "sentence"), "label", ENTAILMENT, ("accuracy",)),
    "rte": Task("rte", ("sentence1", "sentence2"), "label", ENTAILMENT, ("accuracy",)),
    "wnli": Task("wnli", ("sentence1", "sentence2"), "label", BINARY, ("accuracy",)),
}


GLUE_DIRS = {"cola": "CoLA", "sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "qqp": "QQP", "mnli": "MNLI",
             "qnli": "QNLI", "rte": "RTE", "wnli": "WNLI"}
"""Each task's directory as the GLUE download names it."""


@dataclass
class Examples:
    """One split: texts[i] holds the example's one or two strings; labels are class indices or float targets."""

    source: Path
    texts: list[tuple[str, ...]]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)


def custom_task(text_fields: list[str], label_field: str, problem: str, train_labels: list | None) -> Task:
    """A task over named fields; classification labels are the train split's distinct values, sorted."""
    if not 1 <= len(text_fields) <= 2:
        raise FastmaeError(f"--text-fields {','.join(text_fields)!r}: give one field or two (a pair)")
    if problem not in ("classification", "regression"):
        raise FastmaeError(f"--problem {problem!r}: choose classification or regression")
    if problem == "regression":
        return Task("custom", tuple(text_fields), label_field, None, ("pearson", "spearman"))
    labels = tuple(sorted({str(v) for v in train_labels}))
    metrics = ("accuracy", "f1", "matthews_correlation") if len(labels) == 2 else ("accuracy",)
    return Task("custom", tuple(text_fields), label_field, labels, metrics)


def read_rows(path: Path, task: Task) -> list[tuple[int, dict]]:
    """(line number, {field: raw value}) of every row of a GLUE-style TSV or a JSONL file (by extension)."""
    path = Path(path)
    if not path.is_file():
        raise FastmaeError(f"{path}: no such file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: MRPC's files start with a byte-order mark
    except UnicodeDecodeError as err:
        raise FastmaeError(f"{path}: not UTF-8 ({err.reason} at byte {err.start})") from None
    lines = text.splitlines()
    if path.suffix in (".jsonl", ".json"):
        return _jsonl_rows(path, lines)
    return _tsv_rows(path, lines, task)


def _jsonl_rows(path: Path, lines: list[str]) -> list[tuple[int, dict]]:
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise FastmaeError(f"{path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise FastmaeError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    return rows


def _tsv_rows(path: Path, lines: list[str], task: Task) -> list[tuple[int, dict]]:
    """Split on tabs only (no quote processing). A first row naming the task's fields is the header; without
    one, the task's positional layout applies (CoLA), or the header's absence is the error."""
    if not lines:
        return []
    first = lines[0].split("\t")
    wanted = [*task.text_fields, task.label_field]
    if set(wanted) <= set(first):
        names, body, start = first, lines[1:], 2
    elif task.positional is not None:
        names, body, start = None, lines, 1
    else:
        missing = [f for f in wanted if f not in first]
        raise FastmaeError(f"{path}:1: header has no column {missing[0]!r} (columns: {', '.join(first)})")
    rows = []
    for number, line in enumerate(body, start):
        if not line.strip():
            continue
        cells = line.split("\t")
        if names is not None:
            if len(cells) < len(names):
                raise FastmaeError(f"{path}:{number}: {len(cells)} columns, the header has {len(names)}")
            rows.append((number, dict(zip(names, cells))))
        else:
            if len(cells) <= max(task.positional):
                raise FastmaeError(f"{path}:{number}: {len(cells)} columns, the {task.name} layout needs "
                                   f"{max(task.positional) + 1}")
            rows.append((number, {name: cells[i] for name, i in zip(wanted, task.positional)}))
    return rows


def load_split(path: Path, task: Task) -> Examples:
    """Read and check one split: every field present, every label in the task's label set (or a finite number)."""
    rows = read_rows(path, task)
    if not rows:
        raise FastmaeError(f"{path}: no examples")
    texts, labels = [], []
    index = {label: i for i, label in enumerate(task.labels or ())}
    for number, row in rows:
        for field in (*task.text_fields, task.label_field):
            if field not in row:
                raise FastmaeError(f"{path}:{number}: no field {field!r}")
        texts.append(tuple(str(row[field]) for field in task.text_fields))
        value = row[task.label_field]
        if task.is_regression:
            try:
                target = float(value)
            except (TypeError, ValueError):
                target = math.nan
            if not math.isfinite(target):
                raise FastmaeError(f"{path}:{number}: {task.label_field}={value!r} is not a finite number")
            labels.append(target)
        else:
            if str(value) not in index:
                raise FastmaeError(f"{path}:{number}: {task.label_field}={value!r} is not one of "
                                   f"{', '.join(task.labels)}")
            labels.append(index[str(value)])
    dtype = np.float32 if task.is_regression else np.int64
    return Examples(Path(path), texts, np.asarray(labels, dtype=dtype))


# ------------------------------------------------------------------------------------------------------ metrics
def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1 with ties given their average rank (Spearman's convention)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    denominator = math.sqrt(float((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / denominator) if denominator > 0 else 0.0


def score(metric: str, predictions: np.ndarray, labels: np.ndarray) -> float:
    """One metric of predictions (class indices, or floats for regression) against labels. F1 and Matthews
    correlation treat class 1 as positive; a constant prediction scores 0 on correlations (not NaN)."""
    if metric == "accuracy":
        return float((predictions == labels).mean())
    if metric == "pearson":
        return _pearson(predictions.astype(np.float64), labels.astype(np.float64))
    if metric == "spearman":
        return _pearson(_ranks(predictions), _ranks(labels))
    tp = float(((predictions == 1) & (labels == 1)).sum())
    fp = float(((predictions == 1) & (labels != 1)).sum())
    fn = float(((predictions != 1) & (labels == 1)).sum())
    tn = float(len(labels)) - tp - fp - fn
    if metric == "f1":
        return 2 * tp / (2 * tp + fp + fn) if tp > 0 else 0.0
    if metric == "matthews_correlation":
        denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
        return (tp * tn - fp * fn) / denominator if denominator > 0 else 0.0
    raise ValueError(f"unknown metric {metric!r}")


WORD_ORDER_WORDS = 10
"""Words per sentence of the generated word-order task."""


def write_word_order_task(dataset: Path, out: Path, train_examples: int, dev_examples: int, seed: int = 0) -> Path:
    """Write a GLUE-format (SST-2 layout) task generated from a prepared dataset's own text into `out`: sentences of
    WORD_ORDER_WORDS consecutive words, label 1 as written, 0 with the words shuffled. A bag-of-words model scores
    50%; telling them apart needs word order, i.e. context. Train sentences come from the train split, dev
    sentences from the valid split (train again if it has none). Returns `out`."""
    from .data.shards import ShardSet
    from .data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(dataset)
    rng = np.random.default_rng(seed)
    for split, count, file in (("train", train_examples, "train.tsv"), ("valid", dev_examples, "dev.tsv")):
        shards = ShardSet(dataset, split)
        if shards.num_tokens == 0:
            shards = ShardSet(dataset, "train")
        windows = []
        for shard in shards.shards:
            for begin, end in zip(shard.offsets[:-1].tolist(), shard.offsets[1:].tolist()):
                words = tokenizer.decode(np.asarray(shard.tokens[begin:end]).tolist()).split()
                windows += [words[i:i + WORD_ORDER_WORDS]
                            for i in range(0, len(words) - WORD_ORDER_WORDS + 1, WORD_ORDER_WORDS)]
        if len(windows) < count:
            raise FastmaeError(f"{dataset}: split {split!r} holds {len(windows)} sentences of {WORD_ORDER_WORDS} "
                               f"words, fewer than the {count} asked for")
        rows = ["sentence\tlabel"]
        for index in rng.permutation(len(windows))[:count].tolist():
            words, label = list(windows[index]), int(rng.integers(2))
            if label == 0:
                shuffled = [words[i] for i in rng.permutation(WORD_ORDER_WORDS)]
                label = int(shuffled == words)  # a shuffle that changes nothing leaves the sentence as written
                words = shuffled
            rows.append(f"{' '.join(words)}\t{label}")
        out.mkdir(parents=True, exist_ok=True)
        (out / file).write_text("\n".join(rows) + "\n", encoding="utf-8")
    return out
