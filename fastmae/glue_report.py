"""What `fastmae glue` writes from its cells' records: glue.json, glue.md (one row per model, the differences held to
the seed spread) and glue.png."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .atomic import atomic_write_text
from .claims import compare
from .glue_plan import QUICK
from .plot import pyplot, save_figure
from .tasks import GLUE_DIRS

NAMES = {**GLUE_DIRS, "mnli": "MNLI-m/mm"}
METRIC_NAMES = {"matthews_correlation": "MCC", "spearman": "Spearman", "accuracy": "acc", "f1": "F1",
                "pearson": "Pearson"}


def _cell(scores: dict | None) -> str:
    """A task's score as the papers print it (x 100), MNLI as matched/mismatched, a dagger where a seed did not
    train, a double dagger where the budget cut its best cell short of the seeds asked for."""
    if scores is None:
        return "-"
    text = f"{100 * scores['headline']:.1f}"
    if "mismatched_accuracy" in scores["median"]:
        text += f"/{100 * scores['median']['mismatched_accuracy']:.1f}"
    return text + (" †" if scores["did_not_train"] else "") + ("" if scores.get("complete", True) else " ‡")


def glue_table(models: dict[str, dict], tasks: list[str]) -> str:
    """The Markdown table: one row per model, each task's headline score and the GLUE average."""
    header = ["model", *(f"{NAMES[t]} ({METRIC_NAMES.get(_headline(models, t), 'acc')})" for t in tasks), "average"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model, result in models.items():
        average = "-" if result["average"] is None else f"{100 * result['average']:.1f}"
        average += " †" if result.get("untrained") else ""
        rows.append("| " + " | ".join([f"`{model}`", *(_cell(result["tasks"].get(t)) for t in tasks), average])
                    + " |")
    return "\n".join(rows)


def _headline(models: dict[str, dict], task: str) -> str:
    return next((r["tasks"][task]["headline_metric"] for r in models.values() if task in r["tasks"]), "accuracy")


def differences(models: dict[str, dict], tasks: list[str]) -> list[str]:
    """Each model after the first against the first, task by task, on the per-seed scores of each one's best grid
    cell; a task where a seed did not train is named instead of compared."""
    names = list(models)
    lines = []
    for other in names[1:]:
        for task in tasks:
            a, b = models[other]["tasks"].get(task), models[names[0]]["tasks"].get(task)
            if a is None or b is None:
                continue
            failed = [f"`{m}` {s['did_not_train'][0]}" for m, s in ((other, a), (names[0], b)) if s["did_not_train"]]
            if failed:
                lines.append(f"`{other}` {NAMES[task]}: no comparison, a fine-tune did not train ({'; '.join(failed)})")
                continue
            metric = a["headline_metric"]
            lines.append(compare(f"`{other}` {NAMES[task]} {metric}", a["per_seed"][metric], b["per_seed"][metric],
                                 "", "higher", reference=f"`{names[0]}`"))
    return lines


def write_report(out: Path, result: dict) -> list[Path]:
    """glue.json, glue.md and glue.png under `out` from `result` (glue.glue's return value)."""
    models, tasks = result["models"], result["tasks"]
    atomic_write_text(out / "glue.json", json.dumps(result, indent=1) + "\n")
    given_sizes = result["sizes"]
    sizes = {"epochs": given_sizes.get("epochs"), "batch": "/".join(map(str, given_sizes.get("batch_sizes", ())))}
    given = ", ".join(f"{k} {v}" for k, v in sizes.items() if v)
    grid = f"{result['protocol']} protocol" + (f"'s rates, {given} in place of its own" if given else "")
    lines = [f"# GLUE dev scores ({grid})", "",
             *([f"**--quick**: {QUICK}.", ""] if result["quick"] else []),
             glue_table(models, tasks), "",
             "Each score is the median over seeds of the best grid cell on dev (x 100); MNLI shows matched/"
             "mismatched accuracy. The average is over the tasks shown, WNLI left out, as the papers average dev "
             "scores. † : at least one seed of that cell did not train (one class predicted, or its training loss "
             "at chance), so its score says nothing about the encoder; an average marked † counts such a score. "
             "‡ : the budget left that task no grid setting with every seed, so its best cell has fewer seeds than "
             "asked for.", ""]
    for model, entry in models.items():
        average_over = ", ".join(NAMES[t] for t in entry["average_over"])
        lines.append(f"- `{model}`: average over {len(entry['average_over'])} task(s) ({average_over}); "
                     + "; ".join(f"{NAMES[t]} lr {s['lr']:.3g}, batch {s['batch_size']}, {s['epochs']} epoch(s), "
                                 f"{s['seeds']} seed(s)"
                                 for t, s in entry["tasks"].items()))
    if result["left_out"]:
        lines += ["", "Left out by the budget: " + "; ".join(result["left_out"]) + "."]
    if len(models) > 1:
        lines += ["", "## Differences, held to the seed spread", "", *(f"- {line}" for line in
                                                                        differences(models, tasks))]
    atomic_write_text(out / "glue.md", "\n".join(lines) + "\n")
    return [out / "glue.json", out / "glue.md", plot_scores(models, tasks, out / "glue.png")]


def plot_scores(models: dict[str, dict], tasks: list[str], path: Path) -> Path:
    """Grouped bars: each task's headline score per model, the whiskers spanning its seeds."""
    fig, ax = pyplot().subplots(figsize=(max(6, 1.2 * len(tasks) * max(1, len(models))), 4))
    width = 0.8 / max(1, len(models))
    for i, (model, entry) in enumerate(models.items()):
        x, heights, low, high = [], [], [], []
        for j, task in enumerate(tasks):
            scores = entry["tasks"].get(task)
            if scores is None:
                continue
            seeds = scores["per_seed"][scores["headline_metric"]]
            x.append(j + i * width)
            heights.append(scores["headline"])
            low.append(scores["headline"] - min(seeds))
            high.append(max(seeds) - scores["headline"])
        ax.bar(x, heights, width, yerr=[low, high], capsize=3, label=model)
    ax.set_xticks(np.arange(len(tasks)) + width * (len(models) - 1) / 2, [NAMES[t] for t in tasks])
    ax.set(ylabel="dev score (median over seeds)", title="GLUE dev: best grid cell per task (whiskers: seeds)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
