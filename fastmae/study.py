"""`fastmae study`: the papers' claims, measured on your data under one compute budget (ARCHITECTURE.md section 10).

    fastmae study --data DIR --objectives mlm,mae-lm,3ml --budget cpu-30min --out DIR [--task GLUE_DIR] [--seeds N]
    fastmae study --data DIR --quick --out DIR          # the CI-sized variant (minutes, shapes only)

Every objective trains through the normal trainer (`python -m fastmae.train`, or `deepspeed` with --ranks > 1) with
the same encoder width and depth, data order (train.seed = the study seed) and optimizer settings, for the most
steps whose training FLOPs (fastmae/flops.py) fit the budget, evaluated under the fixed held-out protocol after the
last step within every budget / eval_points FLOPs. Then, with --task, each encoder is fine-tuned (median over
fine-tuning seeds), and `analyze` measures its effective ranks with and without `<mask>` inputs.

Objectives: `mlm`, `mae-lm`, `3ml` (the presets), `k=N` (3ml's masking, 50% removed, with the insertion at encoder
layer N, 0 < N < L, and no decoder: the "mask later" family; k=L without a decoder is refused, nothing would
run after the insertion), each optionally followed by `:field=value` ModelConfig overrides
(`mae-lm:decoder_layers=2`). `mlm` must be one of them: it is the reference of "percent of mlm's compute".

    OUT/configs/NAME-seedS.yaml   the exact run config of each run (re-running with other settings is refused)
    OUT/runs/NAME-seedS/          each run directory (metrics.jsonl, checkpoints, model.safetensors)
    OUT/finetune/NAME-seedS/      fine-tuning results (with --task)
    OUT/analysis/NAME-seedS/      analyze's output
    OUT/study.json, OUT/report.md, OUT/loss_vs_flops.png, OUT/ranks.png

Re-running with the same arguments reuses every finished run, fine-tuning and analysis, and resumes an interrupted
run from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from .analyze import AnalyzeConfig
from .atomic import atomic_write_text
from .checkpoint import WEIGHTS, weights_metadata
from .config import PRESETS as MODEL_PRESETS
from .config import ModelConfig, load_run_config
from .data import PackedLoader
from .errors import FastmaeError, run_command
from .finetune import FinetuneConfig
from .flops import plan_budget
from .metrics import read_metrics
from .plot import pyplot, save_figure
from .tasks import GLUE_TASKS, write_word_order_task


# ------------------------------------------------------------------------------------------------ objectives
@dataclass(frozen=True)
class Objective:
    """One objective of the study: a model preset plus ModelConfig overrides, named as on the command line."""

    label: str
    preset: str
    overrides: dict = field(default_factory=dict)

    @property
    def slug(self) -> str:
        """The label as a file name."""
        return re.sub(r"[^A-Za-z0-9.-]+", "_", self.label)


def parse_objectives(text: str) -> list[Objective]:
    """`mlm,mae-lm,3ml,k=1,mae-lm:decoder_layers=2` -> Objectives (errors name the bad item)."""
    objectives = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, *fields = item.split(":")
        overrides = {}
        for entry in fields:
            key, sep, value = entry.partition("=")
            if not sep or not key:
                raise FastmaeError(f"--objectives {item!r}: expected NAME[:field=value...], got {entry!r}")
            overrides[key] = yaml.safe_load(value)
        layer = re.fullmatch(r"k=(\d+)", name)
        if layer:
            name, overrides = "3ml", {"insert_layer": int(layer.group(1)), "decoder_layers": 0, **overrides}
        elif name not in MODEL_PRESETS:
            raise FastmaeError(f"--objectives {item!r}: unknown objective {name!r}; choose from "
                               f"{sorted(MODEL_PRESETS)} or k=N")
        objectives.append(Objective(item, name, overrides))
    labels = [o.label for o in objectives]
    if len(set(labels)) != len(labels):
        raise FastmaeError(f"--objectives {text!r}: an objective is named twice")
    if "mlm" not in labels:
        raise FastmaeError(f"--objectives {text!r}: must include mlm (the reference of the compute comparison)")
    return objectives


# --------------------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class StudyPreset:
    """A budget with the settings that make it meaningful: per-run FLOPs and the run config every objective shares."""

    budget: float
    """Training FLOPs of each run (fastmae/flops.py's count)."""
    run: tuple[str, ...]
    """dotted.key=value run-config overrides shared by every objective (model size, data, optimizer)."""
    eval_points: int
    """Held-out evaluations over the budget."""
    seeds: int
    """Pretraining seeds per objective (the spread between them is the noise every comparison is held to)."""
    finetune: FinetuneConfig
    analyze_sequences: int
    what: str
    generated_task: tuple[int, int]
    """(train, dev) examples of `--task generated` (fastmae.tasks.write_word_order_task)."""
    mlm_steps: int = 0
    """If > 0, the budget is this many of mlm's optimizer steps on the study's data instead (any vocabulary fits)."""


SMALL_CPU_RUN = (
    # the tiny-cpu demo's recipe (configs/tiny-cpu.yaml says why each value), 6 layers deep: with 2 layers a 2-layer
    # decoder costs as much as the encoder and no objective can save compute
    "model.hidden_size=128", "model.num_heads=2", "model.encoder_layers=6", "model.max_seq_len=64",
    "model.position_embedding=rotary", "model.norm_position=pre", "model.dropout=0.0", "model.attention_dropout=0.0",
    "data.packing=full", "data.tokens_per_micro_batch=1024", "train.lr=1.0e-3", "train.warmup_steps=100",
    "train.schedule=polynomial", "train.clip=2.0", "train.zero_stage=2", "train.precision=auto",
    "eval.sequences=1024", "checkpoint.keep=1", "checkpoint.every=500", "log.every=50",
)
STUDY_PRESETS = {
    "cpu-30min": StudyPreset(
        budget=9.0e12, run=SMALL_CPU_RUN, eval_points=10, seeds=2,
        finetune=FinetuneConfig(seeds=2, epochs=4, batch_size=32, lr=1e-3), analyze_sequences=256,
        generated_task=(1500, 500),
        what="6 x 128 encoder, 64-token sequences, 1,024 tokens per step, lr 1e-3; fits 2 CPU cores in 30 minutes "
             "for mlm, mae-lm and 3ml with 2 seeds each and --task generated"),
    "quick": StudyPreset(
        budget=0.0, run=(
            "model.hidden_size=64", "model.num_heads=2", "model.encoder_layers=2", "model.max_seq_len=64",
            "model.position_embedding=rotary", "model.norm_position=pre", "model.dropout=0.0",
            "model.attention_dropout=0.0", "data.packing=full", "data.tokens_per_micro_batch=512", "train.lr=3.0e-3",
            "train.warmup_steps=5", "train.zero_stage=2", "train.precision=fp32", "eval.sequences=32",
            "checkpoint.keep=1", "checkpoint.every=1000", "log.every=5", "log.tensorboard=false"),
        eval_points=3, seeds=1, finetune=FinetuneConfig(seeds=2, epochs=1, batch_size=16, lr=1e-3),
        analyze_sequences=16, generated_task=(64, 32), mlm_steps=40,
        what="the CI-sized check of the pipeline: a 2 x 64 encoder for 40 mlm steps' FLOPs; its numbers mean "
             "nothing"),
}


def resolve_budget(text: str) -> tuple[float, StudyPreset]:
    """`--budget`: a preset name, or a FLOP count (then the cpu-30min preset's other settings). A preset that counts
    in mlm steps returns 0 (`study` measures it on the data)."""
    if text in STUDY_PRESETS:
        return STUDY_PRESETS[text].budget, STUDY_PRESETS[text]
    try:
        budget = float(text)
    except ValueError:
        raise FastmaeError(f"--budget {text!r}: expected a FLOP count (e.g. 3e15) or a preset: "
                           f"{sorted(STUDY_PRESETS)}") from None
    if not budget > 0 or not math.isfinite(budget):
        raise FastmaeError(f"--budget {text!r}: must be a positive FLOP count")
    return budget, STUDY_PRESETS["cpu-30min"]


# ------------------------------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    """One pretraining run of the study: an objective at a seed."""

    objective: Objective
    seed: int
    out: Path

    @property
    def name(self) -> str:
        return f"{self.objective.slug}-seed{self.seed}"

    @property
    def config_file(self) -> Path:
        return self.out / "configs" / f"{self.name}.yaml"

    @property
    def dir(self) -> Path:
        return self.out / "runs" / self.name

    @property
    def finetune_dir(self) -> Path:
        return self.out / "finetune" / self.name

    @property
    def analysis_dir(self) -> Path:
        return self.out / "analysis" / self.name


def run_config_text(run: Run, args, budget: float, preset: StudyPreset) -> str:
    """The resolved YAML config of `run`, validated by the trainer's own loader and its model config (so an
    objective that cannot learn from context is refused before any run starts)."""
    overrides = [*preset.run, *args.overrides,
                 f"model.preset={run.objective.preset}",
                 *(f"model.{key}={json.dumps(value)}" for key, value in run.objective.overrides.items()),
                 f"data.path={Path(args.data).resolve()}", f"log.dir={run.dir.resolve()}",
                 f"train.seed={run.seed}", f"train.flops_budget={budget!r}", "eval.every=0",
                 f"eval.every_flops={budget / preset.eval_points!r}"]
    try:
        config = load_run_config(args.config, overrides)
        config.model_config(json.loads((Path(args.data) / "meta.json").read_text())["vocab_size"])
    except ValueError as err:
        raise FastmaeError(f"objective {run.objective.label!r}: {err}") from None
    resolved = dataclasses.asdict(config)
    resolved["train"]["betas"] = list(resolved["train"]["betas"])
    return yaml.safe_dump(resolved, sort_keys=False)


def mlm_step_flops(args, preset: StudyPreset, ranks: int) -> float:
    """Training FLOPs of the first optimizer step of the study's mlm run on --data (all `ranks`)."""
    try:
        config = load_run_config(args.config, [*preset.run, *args.overrides, "model.preset=mlm",
                                               f"data.path={args.data}"]).for_world(ranks)
    except ValueError as err:
        raise FastmaeError(str(err)) from None
    loader = PackedLoader.for_run(config, 0, ranks)
    model_config = config.model_config(loader.vocab_size)
    return plan_budget(loader.every_rank(), model_config, loader.micro_batches_per_step, budget=0.0).flops_per_step


def launch_command(run: Run, ranks: int) -> list[str]:
    """How `run` is trained: one process, or the DeepSpeed launcher with `ranks` processes."""
    if ranks == 1:
        return [sys.executable, "-m", "fastmae.train", "--config", str(run.config_file)]
    train_py = Path(__file__).with_name("train.py")
    return [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(ranks), str(train_py),
            "--config", str(run.config_file)]


def train(run: Run, config_text: str, ranks: int) -> None:
    """Train `run` unless it finished (study() checked its config is this one); an interrupted run resumes from its
    newest checkpoint."""
    if (run.dir / WEIGHTS).is_file():
        return
    atomic_write_text(run.config_file, config_text)
    command = launch_command(run, ranks)
    print(f"fastmae study: training {run.name}: {shlex.join(command)}", file=sys.stderr)
    log = run.out / "logs" / f"{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with log.open("a") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ,
                              "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0 or not (run.dir / WEIGHTS).is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        raise FastmaeError(f"training {run.name} failed (exit {done.returncode}); last lines of {log}:\n"
                           + "\n".join(tail))
    atomic_write_text(run.dir / "study_run.json", json.dumps({"seconds": round(time.time() - started, 1),
                                                               "command": shlex.join(command)}) + "\n")


def finetune_run(run: Run, task_dir: Path, task_name: str, config: FinetuneConfig) -> dict:
    """Fine-tune `run`'s encoder (reusing results of the same weights and config)."""
    from .finetune import finetune, resolve_task

    results_file = run.finetune_dir / "results.json"
    if results_file.is_file():
        results = json.loads(results_file.read_text())
        if results.get("config") == dataclasses.asdict(config) and results.get("weights") == str(run.dir / WEIGHTS):
            return results
    task, train_file, dev_file = resolve_task(argparse.Namespace(task=task_name, data=str(task_dir)))
    return finetune(run.dir, task, train_file, dev_file, run.finetune_dir, config)


def analyze_run(run: Run, data: Path, sequences: int) -> dict:
    """analyze's record of `run`'s encoder (reusing one of the same weights)."""
    from .analyze import run as analyze

    record_file = run.analysis_dir / "analysis.json"
    _, step = weights_metadata(run.dir / WEIGHTS)
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        if record.get("step") == step and record.get("sequences") == sequences:
            return record
    return analyze(run.dir, data, run.analysis_dir, AnalyzeConfig(sequences=sequences))


def task_name_of(task_dir: Path, explicit: str | None) -> str:
    """The GLUE task of a directory (its name: RTE, SST-2, STS-B, ...) unless --task-name says."""
    name = explicit or re.sub(r"[^a-z0-9]", "", task_dir.name.lower())
    if name not in GLUE_TASKS:
        raise FastmaeError(f"--task {task_dir}: cannot tell the GLUE task from the directory name; pass --task-name "
                           f"(one of {sorted(GLUE_TASKS)})")
    return name


# ------------------------------------------------------------------------------------------------ the numbers
def eval_curve(run: Run) -> list[dict]:
    """The held-out evaluation records of a finished run, one per step in step order (a resumed run logs again the
    evaluations after its checkpoint; the last record of a step is the one the finished run continued from)."""
    by_step = {r["step"]: r for r in read_metrics(run.dir) if r.get("kind") == "eval"}
    return [by_step[step] for step in sorted(by_step)]


def flops_to_reach(curve: list[dict], target: float) -> float | None:
    """Training FLOPs at which the held-out loss first falls to `target`, linearly interpolated between
    evaluations (None if it never does)."""
    previous = None
    for record in curve:
        if record["loss"] <= target:
            if previous is None:
                return record["flops"]  # reached by the first evaluation: no earlier point to interpolate from
            share = (previous["loss"] - target) / (previous["loss"] - record["loss"])
            return previous["flops"] + share * (record["flops"] - previous["flops"])
        previous = record
    return None


def spread(values: list[float]) -> float | None:
    """max - min over seeds (None with one seed: the noise was not measured)."""
    return float(max(values) - min(values)) if len(values) > 1 else None


def summarize(objectives: list[Objective], runs: dict[str, list[Run]], finetuned: dict, analyses: dict,
              task_label: str | None) -> dict:
    """study.json's per-objective numbers (mean over seeds, per-seed values, spreads)."""
    curves = {o.label: [eval_curve(r) for r in runs[o.label]] for o in objectives}
    mlm_final = [curve[-1] for curve in curves["mlm"]]
    out = {}
    for objective in objectives:
        per_seed = []
        for run, curve, reference in zip(runs[objective.label], curves[objective.label], mlm_final):
            final = curve[-1]
            info = run.dir / "study_run.json"  # absent when the run was trained before the study was pointed at it
            reached = flops_to_reach(curve, reference["loss"])
            per_seed.append({
                "seed": run.seed, "steps": final["step"], "flops": final["flops"], "final_eval_loss": final["loss"],
                "final_eval_accuracy": final["accuracy"],
                "percent_of_mlm_compute_to_match": None if reached is None else 100.0 * reached / reference["flops"],
                "curve": [{k: r[k] for k in ("step", "flops", "loss", "accuracy")} for r in curve],
                "unigram_entropy": final["unigram_entropy"], "unigram_accuracy": final["unigram_accuracy"],
                "seconds": json.loads(info.read_text())["seconds"] if info.is_file() else None,
            })
        losses = [s["final_eval_loss"] for s in per_seed]
        percents = [s["percent_of_mlm_compute_to_match"] for s in per_seed]
        entry = {
            "flops": float(np.mean([s["flops"] for s in per_seed])),
            "final_eval_loss": float(np.mean(losses)),
            "final_eval_accuracy": float(np.mean([s["final_eval_accuracy"] for s in per_seed])),
            "percent_of_mlm_compute_to_match": None if None in percents else float(np.mean(percents)),
            "seeds_reaching_mlm_loss": sum(p is not None for p in percents),
            "final_eval_loss_spread": spread(losses),
            "steps": [s["steps"] for s in per_seed],
            "model": {"preset": objective.preset, **objective.overrides},
            "per_seed": per_seed,
        }
        if finetuned.get(objective.label):
            results = finetuned[objective.label]
            metric = results[0]["metric"]
            scores = [s["scores"][metric] for r in results for s in r["per_seed"]]
            entry["finetune"] = {"task": task_label, "metric": metric, "median": float(np.median(scores)),
                                 "spread": spread(scores), "runs": len(scores), "scores": scores}
        records = analyses[objective.label]
        entry["effective_rank"] = {
            group: [float(np.mean([rec["layers"][i]["epsilon_rank"][group] for rec in records]))
                    for i in range(len(records[0]["layers"]))]
            for group in ("real_masked_input", "real_unmasked_input", "all_unmasked_input")}
        entry["centred_effective_rank"] = {
            group: [float(np.mean([rec["layers"][i]["centred_epsilon_rank"][group] for rec in records]))
                    for i in range(len(records[0]["layers"]))]
            for group in ("real_masked_input", "real_unmasked_input")}
        entry["effective_rank_last_layer_per_seed"] = {
            group: [rec["layers"][-1]["epsilon_rank"][group] for rec in records]
            for group in ("real_masked_input", "real_unmasked_input")}
        out[objective.label] = entry
    return out


def compare(name: str, a: list[float], b: list[float], unit: str, higher_is: str) -> str:
    """One sentence comparing per-seed values `a` (objective) and `b` (mlm) that never claims a difference smaller
    than the seed spread (the larger of the two ranges)."""
    diff = float(np.mean(a) - np.mean(b))
    values = f"{np.mean(a):.4g} vs mlm's {np.mean(b):.4g}" + (f" {unit}" if unit else "")
    noise = [s for s in (spread(a), spread(b)) if s is not None]
    if not noise:
        return f"{name}: {values}; one seed each, so the seed noise is unmeasured and no difference is claimed"
    noise_level = max(noise)
    if abs(diff) <= noise_level:
        return (f"{name}: {values}: the difference ({diff:+.3g}) is within the seed spread ({noise_level:.3g}); no "
                "difference is claimed")
    direction = "higher" if diff > 0 else "lower"
    verdict = "better" if (direction == higher_is) else "worse"
    return f"{name}: {values}: {direction} by {abs(diff):.3g}, beyond the seed spread ({noise_level:.3g}) - {verdict}"


def findings(summary: dict) -> list[str]:
    """The report's claims, each held to the seed spread."""
    lines = []
    mlm = summary["mlm"]
    for label, entry in summary.items():
        if entry["final_eval_loss"] >= entry["per_seed"][0]["unigram_entropy"]:
            lines.append(f"`{label}` ended at or above the held-out unigram entropy "
                         f"({entry['per_seed'][0]['unigram_entropy']:.3f} nats): it had not learned from context "
                         "within the budget, so its other numbers (ranks, fine-tuning) say little.")
    for label, entry in summary.items():
        if label == "mlm":
            continue
        seeds = entry["per_seed"]
        lines.append(compare(f"`{label}` final held-out loss", [s["final_eval_loss"] for s in seeds],
                             [s["final_eval_loss"] for s in mlm["per_seed"]], "nats", "lower"))
        percents = [s["percent_of_mlm_compute_to_match"] for s in seeds]
        if None in percents:
            lines.append(f"`{label}` did not reach mlm's final held-out loss within the budget in "
                         f"{percents.count(None)} of {len(percents)} seed(s).")
        else:
            text = ", ".join(f"{p:.1f}%" for p in percents)
            width = spread(percents)
            claim = ""
            if width is not None and max(percents) < 100.0 and 100.0 - np.mean(percents) > width:
                claim = f": less compute than mlm, beyond the spread between seeds ({width:.1f} points)"
            elif width is not None:
                claim = f"; the seed spread ({width:.1f} points) does not separate it from 100%"
            else:
                claim = "; one seed, so this is not separated from seed noise"
            lines.append(f"`{label}` reached mlm's final held-out loss with {text} of mlm's compute{claim}.")
        ranks, reference = entry["effective_rank_last_layer_per_seed"], mlm["effective_rank_last_layer_per_seed"]
        lines.append(compare(f"`{label}` last-layer epsilon rank of real tokens, input without <mask>",
                             ranks["real_unmasked_input"], reference["real_unmasked_input"], "dimensions", "higher"))
        if "finetune" in entry and "finetune" in mlm:
            ft, ref = entry["finetune"], mlm["finetune"]
            lines.append(compare(f"`{label}` fine-tuned {ft['task']} {ft['metric']} (mean of every pretraining x "
                                 "fine-tuning seed)", ft["scores"], ref["scores"], "", "higher"))
    return lines


# ------------------------------------------------------------------------------------------------ the report
def plot_curves(summary: dict, out: Path) -> Path:
    """loss_vs_flops.png: held-out loss and accuracy against cumulative training FLOPs (seed mean, min-max band)."""
    fig, (ax_loss, ax_acc) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for label, entry in summary.items():
        curves = [s["curve"] for s in entry["per_seed"]]
        points = min(len(c) for c in curves)
        flops = np.mean([[r["flops"] for r in c[:points]] for c in curves], axis=0)
        for ax, key in ((ax_loss, "loss"), (ax_acc, "accuracy")):
            values = np.array([[r[key] for r in c[:points]] for c in curves])
            line, = ax.plot(flops, values.mean(0), "o-", label=label)
            if len(curves) > 1:
                ax.fill_between(flops, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
    first = next(iter(summary.values()))["per_seed"][0]
    ax_loss.axhline(summary["mlm"]["final_eval_loss"], color="black", linestyle=":", label="mlm's final loss")
    ax_loss.axhline(first["unigram_entropy"], color="gray", linestyle="--", label="unigram entropy")
    ax_acc.axhline(first["unigram_accuracy"], color="gray", linestyle="--", label="most frequent token")
    ax_loss.set(xlabel="cumulative training FLOPs", ylabel="held-out masked-token loss (nats)",
                title="held-out loss vs compute (band: min-max over seeds)")
    ax_acc.set(xlabel="cumulative training FLOPs", ylabel="held-out masked-token accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out / "loss_vs_flops.png")


def plot_ranks(summary: dict, hidden: int, out: Path) -> Path:
    """ranks.png: epsilon rank of real-token representations per layer, input with and without <mask>."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for label, entry in summary.items():
        without = entry["effective_rank"]["real_unmasked_input"]
        line, = ax.plot(range(len(without)), without, "o-", label=f"{label}: input without <mask>")
        ax.plot(range(len(without)), entry["effective_rank"]["real_masked_input"], "x--", color=line.get_color(),
                label=f"{label}: input with <mask>")
    ax.axhline(hidden, color="gray", linestyle=":", label="hidden size")
    ax.set(xlabel="encoder layer (0 = embeddings)", ylabel="epsilon rank (seed mean)",
           title="effective rank of real-token representations")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "ranks.png")


def _fmt(value, spec: str = ".4g", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def write_report(study: dict, out: Path) -> Path:
    """report.md from study.json's content."""
    summary, setup = study["objectives"], study["setup"]
    lines = ["# fastmae study", "",
             f"Data `{setup['data']}`; budget **{setup['budget']:.4g} training FLOPs per run** "
             f"(fastmae/flops.py: forward + backward of every layer and the head, embeddings and norms ignored); "
             f"preset `{setup['preset']}`; {setup['seeds']} pretraining seed(s) per objective; held-out loss and "
             f"accuracy on {setup['eval_sequences']} sequences, 15% of their tokens hidden the same way for every "
             f"objective, every {setup['budget'] / setup['eval_points']:.4g} FLOPs. Device: {setup['device']}.", "",
             f"Shared by every run: {setup['shared']}.", "",
             "![held-out loss against compute](loss_vs_flops.png)", "",
             "## Results", "",
             "| objective | encoder / decoder layers | steps | FLOPs used | held-out loss | accuracy "
             "| % of mlm's compute to reach mlm's final loss | fine-tuned | last-layer rank, without / with `<mask>` |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, e in summary.items():
        model = study["models"][label]
        loss = f"{e['final_eval_loss']:.3f}" + (f" ± {e['final_eval_loss_spread'] / 2:.3f}"
                                                 if e["final_eval_loss_spread"] is not None else "")
        percent = ("not reached" if e["percent_of_mlm_compute_to_match"] is None
                   else f"{e['percent_of_mlm_compute_to_match']:.1f}%")
        tuned = "-"
        if "finetune" in e:
            ft = e["finetune"]
            tuned = f"{ft['task']} {ft['metric']} {ft['median']:.3f}" + (
                f" (range {ft['spread']:.3f}, {ft['runs']} runs)" if ft["spread"] is not None else "")
        ranks = e["effective_rank"]
        layers = f"{model['encoder_layers']} / {model['decoder_layers']} (k={model['insert_layer']})"
        lines.append(f"| `{label}` | {layers} | {', '.join(map(str, e['steps']))} | {e['flops']:.4g} | {loss} "
                     f"| {e['final_eval_accuracy']:.3f} | {percent} | {tuned} "
                     f"| {ranks['real_unmasked_input'][-1]:.1f} / {ranks['real_masked_input'][-1]:.1f} |")
    first = next(iter(summary.values()))["per_seed"][0]
    lines += ["", f"Loss: mean over seeds ± half the range between seeds. Held-out baselines: unigram entropy "
              f"{first['unigram_entropy']:.3f} nats, most-frequent-token accuracy {first['unigram_accuracy']:.3f}. "
              "Ranks: MAE-LM's epsilon rank (epsilon 0.1) of the real tokens' representations, mean over seeds, "
              f"of {setup['analyze_sequences']} held-out sequences with 15% of their tokens replaced by `<mask>` "
              f"and without; width {setup['hidden_size']}. Centred: the same rows minus their mean (a pre-LN "
              "residual stream's shared mean direction alone can hold most of the uncentred energy).", "",
              *([f"Fine-tuning: {setup['task_name']} from `{setup['task']}`, {setup['finetune']['seeds']} seed(s) per "
                 f"encoder, {setup['finetune']['epochs']} epoch(s), lr {setup['finetune']['lr']:g}, batch "
                 f"{setup['finetune']['batch_size']}; the score is the median over every (pretraining seed, "
                 "fine-tuning seed) pair and the range is over the same runs.", ""] if setup["task"] else []),
              "## What the numbers say", "",
              "A difference is claimed only when it exceeds the spread between seeds.", ""]
    lines += [f"- {line}" for line in study["findings"]]
    lines += ["", "## Effective rank per layer", "", "![ranks](ranks.png)", "",
              "| objective | input | " + " | ".join(f"layer {i}" for i in range(setup["encoder_layers"] + 1)) + " |",
              "|---|---|" + "---|" * (setup["encoder_layers"] + 1)]
    for label, e in summary.items():
        for key, group, what in (("effective_rank", "real_unmasked_input", "without `<mask>`"),
                                 ("effective_rank", "real_masked_input", "with `<mask>`"),
                                 ("centred_effective_rank", "real_unmasked_input", "without `<mask>`, centred")):
            lines.append(f"| `{label}` | {what} | " + " | ".join(f"{v:.1f}" for v in e[key][group]) + " |")
    lines += ["", "## Sizes, steps and seeds", "",
              "| objective | seed | steps | FLOPs | final loss | final accuracy | % of mlm's compute | seconds |",
              "|---|---|---|---|---|---|---|---|"]
    for label, e in summary.items():
        for s in e["per_seed"]:
            lines.append(f"| `{label}` | {s['seed']} | {s['steps']} | {s['flops']:.4g} | {s['final_eval_loss']:.4f} "
                         f"| {s['final_eval_accuracy']:.4f} | {_fmt(s['percent_of_mlm_compute_to_match'], '.1f')} | "
                         f"{_fmt(s['seconds'], '.0f')} |")
    sizes = [f"`{k}` {v['encoder_parameters']:,} / {v['parameters']:,}" for k, v in study["models"].items()]
    lines += ["", "Parameters (embeddings + encoder, what fine-tuning keeps / whole pretraining network): "
              + "; ".join(sizes),
              "", "## Exactly what ran", "", "    " + study["command"], ""]
    for label, commands in study["commands"].items():
        lines += [f"`{label}`:", ""] + [f"    {c}" for c in commands] + [""]
    lines += ["Run configs (every objective shares all but `model.preset`, its overrides, `train.seed` and "
              "`log.dir`): " + ", ".join(f"[`{Path(p).name}`]({p})" for p in study["configs"]), ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


# ------------------------------------------------------------------------------------------------ the command
def model_facts(run: Run) -> dict:
    """Size facts of a run's network from its saved model config."""
    import torch

    from .model import MaskedLM

    config = ModelConfig.from_dict(json.loads((run.dir / "model_config.json").read_text()))
    with torch.device("meta"):
        sizes = {name: p.numel() for name, p in MaskedLM(config).named_parameters()}
    return {"encoder_layers": config.encoder_layers, "decoder_layers": config.decoder_layers,
            "insert_layer": config.insert_layer, "hidden_size": config.hidden_size, "mask_rate": config.mask_rate,
            "parameters": sum(sizes.values()),
            "encoder_parameters": sum(n for name, n in sizes.items() if name.startswith(("embeddings.", "encoder.")))}


def study(args) -> dict:
    """Train, fine-tune and analyze every objective; write study.json, report.md and the plots."""
    objectives = parse_objectives(args.objectives)
    budget, preset = resolve_budget("quick" if args.quick else args.budget)
    seeds = args.seeds or preset.seeds
    data = Path(args.data)
    if not (data / "meta.json").is_file():
        raise FastmaeError(f"--data {data}: not a prepared dataset (no meta.json); run `fastmae prepare` first")
    out = Path(args.out)
    task_name = task_dir = task_label = None
    if args.task == "generated":  # read as SST-2: one sentence, labels 0/1, accuracy
        task_name, task_dir = "sst2", write_word_order_task(data, out / "task" / "word-order", *preset.generated_task)
        task_label = "word-order"
    elif args.task:
        task_name, task_dir = task_name_of(Path(args.task), args.task_name), Path(args.task)
        task_label = task_name
    ranks = args.ranks or _default_ranks()
    if preset.mlm_steps:
        budget = preset.mlm_steps * mlm_step_flops(args, preset, ranks)
    runs = {o.label: [Run(o, seed, out) for seed in range(seeds)] for o in objectives}
    configs = {run.name: run_config_text(run, args, budget, preset) for rs in runs.values() for run in rs}
    for rs in runs.values():  # every config is checked before the first run starts
        for run in rs:
            if run.config_file.is_file() and run.config_file.read_text() != configs[run.name]:
                raise FastmaeError(f"{run.config_file} holds another config for this run: use another --out, or "
                                   f"delete {run.config_file} and {run.dir} to retrain it with these settings")
    for rs in runs.values():
        for run in rs:
            train(run, configs[run.name], ranks)
    finetuned = {}
    ft_config = dataclasses.replace(preset.finetune, **({"seeds": args.finetune_seeds} if args.finetune_seeds else {}))
    if task_name:
        finetuned = {label: [finetune_run(run, task_dir, task_name, ft_config) for run in rs]
                     for label, rs in runs.items()}
    sequences = preset.analyze_sequences
    analyses = {label: [analyze_run(run, data, sequences) for run in rs] for label, rs in runs.items()}
    summary = summarize(objectives, runs, finetuned, analyses, task_label)
    first = runs["mlm"][0]
    facts = {label: model_facts(rs[0]) for label, rs in runs.items()}
    resolved = yaml.safe_load(configs[first.name])
    result = {
        "objectives": summary,
        "findings": findings(summary),
        "models": facts,
        "setup": {"data": str(data), "budget": budget, "preset": "quick" if args.quick else args.budget,
                  "seeds": seeds, "eval_points": preset.eval_points, "eval_sequences": resolved["eval"]["sequences"],
                  "analyze_sequences": sequences, "hidden_size": facts["mlm"]["hidden_size"],
                  "encoder_layers": facts["mlm"]["encoder_layers"], "ranks": ranks, "device": _device_text(first),
                  "task": str(task_dir) if task_dir else None, "task_name": task_label,
                  "finetune": dataclasses.asdict(ft_config),
                  "shared": shared_settings(resolved)},
        "command": shlex.join(["fastmae", "study", *args.argv]),
        "commands": {label: [shlex.join(launch_command(run, ranks)) for run in rs] for label, rs in runs.items()},
        "configs": [str(run.config_file.relative_to(out)) for rs in runs.values() for run in rs],
    }
    atomic_write_text(out / "study.json", json.dumps(result, indent=1) + "\n")
    plot_curves(summary, out)
    plot_ranks(summary, facts["mlm"]["hidden_size"], out)
    write_report(result, out)
    return result


def shared_settings(resolved: dict) -> str:
    """One line of the settings every run of the study shares, from a resolved run config."""
    model, data, train = resolved["model"], resolved["data"], resolved["train"]
    keys = ("hidden_size", "num_heads", "encoder_layers", "max_seq_len", "position_embedding", "norm_position",
            "dropout")
    return (", ".join(f"{k} {model[k]}" for k in keys if k in model)
            + f"; {data['packing']} packing, {data['tokens_per_micro_batch']} tokens per micro-batch x "
            f"{train['grad_accum']}; {train['optimizer']} lr {train['lr']:g}, {train['warmup_steps']} warm-up steps, "
            f"{train['schedule']} decay, clip {train['clip']:g}, weight decay {train['weight_decay']:g}, "
            f"precision {train['precision']}, ZeRO-{train['zero_stage']}")


def _default_ranks() -> int:
    """GPUs when there are any; else one process (on 2 CPU cores, one process with both beat two ranks by 1.5x)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _device_text(run: Run) -> str:
    """The training device and precision as the run logged them."""
    log = run.out / "logs" / f"{run.name}.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = [line.split("fastmae: ", 1)[1].strip() for line in text.splitlines()
             if "fastmae: precision" in line or "fastmae: matmul peak" in line]
    return "; ".join(found) or "see the run logs"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a dataset directory written by `fastmae prepare`")
    parser.add_argument("--objectives", default="mlm,mae-lm,3ml",
                        help="comma-separated: mlm, mae-lm, 3ml, k=N, each with optional :field=value (default "
                             "mlm,mae-lm,3ml)")
    presets = "; ".join(f"{name}: {preset.what}" for name, preset in STUDY_PRESETS.items())
    parser.add_argument("--budget", default="cpu-30min",
                        help=f"training FLOPs per run, or a preset ({presets}); default cpu-30min")
    parser.add_argument("--quick", action="store_true", help="the CI-sized preset (same as --budget quick)")
    parser.add_argument("--out", required=True, help="output directory (study.json, report.md, runs/, ...)")
    parser.add_argument("--task", help="a GLUE task directory (train.tsv, dev.tsv) to fine-tune each encoder on, or "
                        "`generated`: word order (10 words as written, or shuffled) from --data's own text")
    parser.add_argument("--task-name", choices=sorted(GLUE_TASKS), help="the task, when the directory name does "
                        "not say it")
    parser.add_argument("--seeds", type=int, default=0, help="pretraining seeds per objective (default: the "
                        "preset's)")
    parser.add_argument("--finetune-seeds", type=int, default=0, help="fine-tuning seeds per encoder (default: the "
                        "preset's)")
    parser.add_argument("--ranks", type=int, default=0, help="processes per run (default: the GPUs, or 1 on CPU)")
    parser.add_argument("--config", help="a run config YAML whose settings every run starts from")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every run, e.g. model.hidden_size=256")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv

    def go():
        if args.seeds < 0 or args.finetune_seeds < 0 or args.ranks < 0:
            raise FastmaeError("--seeds, --finetune-seeds and --ranks must be positive")
        result = study(args)
        for line in result["findings"]:
            print(f"fastmae study: {line}", file=sys.stderr)
        print(f"fastmae study: wrote {Path(args.out) / 'report.md'} and study.json", file=sys.stderr)

    return run_command("fastmae study", go)


if __name__ == "__main__":
    sys.exit(main())
