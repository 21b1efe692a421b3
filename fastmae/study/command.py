"""`fastmae study`: the command line and the order of its work (train, fine-tune, analyze, summarize, report)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import yaml

from ..atomic import atomic_write_text
from ..errors import FastmaeError, run_command
from ..glue import best_cells, glue
from ..glue_plan import task_directories
from ..glue_report import glue_table
from ..probe import judged
from ..tasks import GLUE_DIRS, GLUE_TASKS, write_word_order_task
from .objectives import STUDY_PRESETS, parse_objectives, resolve_budget
from .report import plot_curves, plot_ranks, shared_settings, write_report
from .runs import (
    Run,
    analyze_run,
    default_ranks,
    device_text,
    eval_curve,
    launch_command,
    model_facts,
    run_config_text,
    step_flops,
    task_name_of,
    train,
)
from .schema import MatchedRanks, ObjectiveResult
from .summary import findings, left_plateau, matched_points, ranks_of, summarize


# ------------------------------------------------------------------------------------------------ the command
def study(args) -> dict:
    """Train, fine-tune and analyze every objective; write study.json, report.md and the plots."""
    objectives = parse_objectives(args.objectives)
    budget, preset = resolve_budget("quick" if args.quick else args.budget)
    seeds = args.seeds or preset.seeds
    data = Path(args.data)
    if not (data / "meta.json").is_file():
        raise FastmaeError(f"--data {data}: not a prepared dataset (no meta.json); run `fastmae prepare` first")
    out = Path(args.out)
    tasks = [glue_tasks(spec, args, out, data, preset) for spec in args.task or []]
    ranks = args.ranks or default_ranks()
    if args.parallel > 1 and ranks > 1:
        raise FastmaeError(f"--parallel {args.parallel} with --ranks {ranks}: runs trained at once share one device; "
                           "use --ranks 1")
    flops_per_step = {o.label: step_flops(o, args, preset, ranks) for o in objectives}  # each config checked here
    if preset.mlm_steps:
        budget = preset.mlm_steps * flops_per_step["mlm"]
    at_least_one_step(budget, flops_per_step, "--budget")
    print("fastmae study: FLOPs of the first optimizer step against mlm's: " + ", ".join(
        f"{label} {flops / flops_per_step['mlm']:.2f}x ({flops:.3g})" for label, flops in flops_per_step.items()),
        file=sys.stderr)
    lr_grid = learning_rate_grid(objectives, args, budget, preset, ranks, flops_per_step) if args.lr_grid else {}
    runs = {o.label: [Run(o, seed, out, lr=lr_grid[o.label]["chosen"] if lr_grid else None)
                      for seed in range(seeds)] for o in objectives}
    configs = checked_configs([run for rs in runs.values() for run in rs], args, budget, preset)
    seconds = {}
    with stage("train", seconds):
        train_all([run for rs in runs.values() for run in rs], configs, ranks, args.parallel)
    ft = preset.finetune
    ft_setup = {"seeds": args.finetune_seeds or ft.seeds, "epochs": ft.epochs, "batch_size": ft.batch_size}
    finetuned, glue_tables, lrs = {label: {} for label in runs}, {}, set()
    for index, (task_dir, task_label) in enumerate(tasks):
        with stage(f"fine-tune ({task_label})", seconds):
            glue_result = glue([str(run.dir) for rs in runs.values() for run in rs], task_dir,
                               out / ("glue" if index == 0 else f"glue-{task_label}"), seeds=ft_setup["seeds"],
                               precision=ft.precision, epochs=ft.epochs, batch_sizes=(ft.batch_size,))
        cells = glue_result["cells"]
        for label, rs in runs.items():
            finetuned[label].update({(task_label if task_label != "glue" else task): [
                best_cells([c for c in cells if c["model"] == str(run.dir)], task, ft_setup["seeds"]) for run in rs]
                for task in glue_result["tasks"]})
        glue_tables[task_label] = glue_table(glue_result["models"], glue_result["tasks"])
        lrs |= {c["lr"] for c in cells}
    if tasks:
        ft_setup["lrs"] = sorted(lrs)
    sequences = preset.analyze_sequences
    with stage("analyze", seconds):
        analyses = {label: [analyze_run(run, data, sequences) for run in rs] for label, rs in runs.items()}
    learned = {label: [judged(r["neighbour_probe"])["learned_context"] for r in records]
               for label, records in analyses.items()}
    with stage("ranks at matched loss", seconds):
        matched = ranks_at_matched_loss(runs, data, sequences, learned)
    summary = summarize(objectives, runs, finetuned, analyses, matched)
    first = runs["mlm"][0]
    facts = {label: {**model_facts(rs[0]), "flops_per_step": flops_per_step[label],
                     "flops_per_step_vs_mlm": flops_per_step[label] / flops_per_step["mlm"]}
             for label, rs in runs.items()}
    resolved = yaml.safe_load(configs[first.name])
    result = {
        "objectives": summary,
        "findings": findings(summary, {label: g["chosen_on_plateau"] for label, g in lr_grid.items()}),
        "lr_grid": {label: {**grid, "losses": {f"{lr:g}": loss for lr, loss in grid["losses"].items()},
                            "left_plateau": {f"{lr:g}": v for lr, v in grid["left_plateau"].items()}}
                    for label, grid in lr_grid.items()},
        "models": facts,
        "setup": {"data": str(data), "budget": budget, "preset": "quick" if args.quick else args.budget,
                  "seeds": seeds, "eval_points": preset.eval_points, "eval_sequences": resolved["eval"]["sequences"],
                  "analyze_sequences": sequences, "hidden_size": facts["mlm"]["hidden_size"],
                  "encoder_layers": facts["mlm"]["encoder_layers"], "ranks": ranks, "device": device_text(first),
                  "tasks": [{"name": label, "path": str(path)} for path, label in tasks],
                  "corpus": corpus_of(data), "tokens_per_step": resolved["train"]["tokens_per_step"],
                  "max_seq_len": resolved["model"]["max_seq_len"], "parallel": args.parallel,
                  "finetune": ft_setup,
                  "shared": shared_settings(resolved, lr_per_objective=bool(lr_grid))},
        "glue_tables": glue_tables,
        "command": shlex.join(["fastmae", "study", *args.argv]),
        "commands": {label: [shlex.join(launch_command(run, ranks)) for run in rs] for label, rs in runs.items()},
        "configs": [str(run.config_file.relative_to(out)) for rs in runs.values() for run in rs],
        "seconds": seconds,
    }
    as_json = {**result, "objectives": {label: entry.to_json() for label, entry in summary.items()}}
    atomic_write_text(out / "study.json", json.dumps(as_json, indent=1) + "\n")
    plot_curves(summary, out)
    plot_ranks(summary, facts["mlm"]["hidden_size"], out)
    write_report(result, out)
    return result


def rewrite_report(out: Path) -> dict:
    """--rewrite-report: the findings, study.json and report.md again from what OUT/study.json holds, its neighbour
    probes judged by today's test (`probe.context_verdict`); no run, weights or data needed. Refused where today's
    verdict changes which objectives the ranks at matched loss compare, or the level (they need the runs' weights:
    run the study again on the same --out)."""
    path = out / "study.json"
    if not path.is_file():
        raise FastmaeError(f"--out {out}: no study.json to rewrite the report from")
    stored = json.loads(path.read_text())
    summary = {label: ObjectiveResult.from_json(entry) for label, entry in stored["objectives"].items()}
    for entry in summary.values():
        entry.neighbour_probe = [judged(p) if "probe_accuracy" in p else p for p in entry.neighbour_probe]
    curves = {label: [[{**dataclasses.asdict(point), "unigram_entropy": seed.unigram_entropy} for point in seed.curve]
                      for seed in entry.per_seed] for label, entry in summary.items()}
    level, points = matched_points(curves, {label: [p["learned_context"] for p in entry.neighbour_probe]
                                            for label, entry in summary.items()})
    for label, entry in summary.items():
        matched = entry.ranks_at_matched_loss
        if matched is None:
            continue
        left_out = isinstance(points[label], str)
        if left_out != (matched.excluded is not None) or (not left_out and matched.level != level):
            raise FastmaeError(f"{path}: today's neighbour-probe verdict changes the ranks at matched loss "
                               f"(`{label}` {'left out' if left_out else 'compared'}, level {level}); they need the "
                               f"runs' weights: run the study again with --out {out}")
        if left_out:
            matched.excluded = points[label]
    lr_grid = stored.get("lr_grid") or {}
    result = {**stored, "objectives": summary,
              "findings": findings(summary, {label: g["chosen_on_plateau"] for label, g in lr_grid.items()})}
    as_json = {**result, "objectives": {label: entry.to_json() for label, entry in summary.items()}}
    atomic_write_text(path, json.dumps(as_json, indent=1) + "\n")
    write_report(result, out)
    return result


def glue_tasks(spec: str, args, out: Path, data: Path, preset) -> tuple[Path, str]:
    """(a GLUE directory for `fastmae glue`, the task's label) from one --task: a GLUE directory as it is ("glue"),
    one task's directory, or `generated` (word order, read as SST-2), each linked into OUT/task/glue[-LABEL] under its
    GLUE name; a task's directory is first cut to the preset's `task_train_examples` rows where it sets them."""
    if spec != "generated" and not Path(spec).is_dir():
        raise FastmaeError(f"--task {spec}: no such directory (a GLUE task or GLUE directory, or `generated`)")
    if spec != "generated" and task_directories(Path(spec)):
        return Path(spec), "glue"
    if spec == "generated":
        name, label = "sst2", "word-order"
        source = write_word_order_task(data, out / "task" / "word-order", *preset.generated_task)
    else:
        name = label = task_name_of(Path(spec), args.task_name)
        source = Path(spec).resolve()
        if preset.task_train_examples:
            source = sampled_task(source, GLUE_TASKS[name], preset.task_train_examples, out / "task" / label)
    link = out / "task" / ("glue" if spec == "generated" else f"glue-{label}") / GLUE_DIRS[name]
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink() or link.resolve() != source.resolve():
        link.unlink(missing_ok=True)
        link.symlink_to(source.resolve(), target_is_directory=True)
    return link.parent, label


def sampled_task(source: Path, task, rows: int, out: Path) -> Path:
    """OUT: `source`'s training split cut to `rows` rows drawn at random (seed 0, file order kept, header kept) and
    its dev files as they are; `source` itself when it has no more rows than that."""
    train = (source / "train.tsv").read_text(encoding="utf-8-sig").splitlines(keepends=True)
    header = 0 if task.positional else 1
    if len(train) - header <= rows:
        return source
    keep = sorted(random.Random(0).sample(range(header, len(train)), rows))
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "train.tsv", "".join(train[:header] + [train[i] for i in keep]))
    for name in (*task.dev_files, *(file for _, file in task.other_dev_files)):
        if (source / name).is_file():
            atomic_write_text(out / name, (source / name).read_text(encoding="utf-8-sig"))
    return out


def corpus_of(data: Path) -> dict:
    """What a prepared dataset was made from (its meta.json): input files, vocabulary, tokens per split."""
    meta = json.loads((data / "meta.json").read_text())
    return {"inputs": [Path(p).name for p in meta.get("inputs", [])], "vocab_size": meta["vocab_size"],
            "tokens": {split: entry["tokens"] for split, entry in meta["splits"].items()}}


def at_least_one_step(budget: float, flops_per_step: dict[str, float], setting: str) -> None:
    """Refuse a budget below one optimizer step of some objective before any run starts (each run's trainer would
    refuse it, one process at a time)."""
    for label, flops in flops_per_step.items():
        if budget < flops:
            raise FastmaeError(f"{setting}: {budget:.4g} FLOPs is less than one optimizer step of {label} "
                               f"({flops:.4g} FLOPs)")


@contextmanager
def stage(name: str, seconds: dict[str, float]):
    """Time one stage of the study: its wall seconds into `seconds[name]` and a line on stderr (a cut run's log says
    how far it got and what each stage cost)."""
    started = time.monotonic()
    yield
    seconds[name] = round(time.monotonic() - started, 1)
    print(f"fastmae study: {name} took {seconds[name]:.0f} s", file=sys.stderr)


def train_all(runs: list[Run], configs: dict[str, str], ranks: int, parallel: int) -> None:
    """Train every run (`train`), `parallel` at a time on the one device (each its own process; 1: in order)."""
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        for done in [pool.submit(train, run, configs[run.name], ranks) for run in runs]:
            done.result()


def checked_configs(runs: list[Run], args, budget: float, preset) -> dict[str, str]:
    """The config of each run by name, every one checked against a config its --out already holds before any of
    them trains."""
    configs = {run.name: run_config_text(run, args, budget, preset) for run in runs}
    for run in runs:
        if run.config_file.is_file() and run.config_file.read_text() != configs[run.name]:
            raise FastmaeError(f"{run.config_file} holds another config for this run: use another --out, or "
                               f"delete {run.config_file} and {run.dir} to retrain it with these settings")
    return configs


def learning_rate_grid(objectives, args, budget: float, preset, ranks: int,
                       flops_per_step: dict[str, float]) -> dict[str, dict]:
    """--lr-grid: each objective trained (seed 0) at each learning rate of the grid for --lr-grid-fraction of the
    budget (its own schedule over that budget); per objective the held-out loss each reached and the rate with the
    lowest, which the study's runs then train at from the start."""
    try:
        grid = sorted({float(text) for text in args.lr_grid.split(",") if text.strip()})
    except ValueError:
        raise FastmaeError(f"--lr-grid {args.lr_grid!r}: expected comma-separated learning rates") from None
    if not grid or min(grid) <= 0 or not 0 < args.lr_grid_fraction <= 1:
        raise FastmaeError(f"--lr-grid {args.lr_grid!r} --lr-grid-fraction {args.lr_grid_fraction}: rates must be "
                           "positive and the fraction in (0, 1]")
    short = budget * args.lr_grid_fraction
    at_least_one_step(short, flops_per_step, f"--lr-grid-fraction {args.lr_grid_fraction:g} of the budget")
    runs = {o.label: [Run(o, 0, Path(args.out), grid_lr=lr) for lr in grid] for o in objectives}
    configs = checked_configs([run for rs in runs.values() for run in rs], args, short, preset)
    train_all([run for rs in runs.values() for run in rs], configs, ranks, args.parallel)
    chosen = {}
    for label, rs in runs.items():
        losses = {run.grid_lr: eval_curve(run)[-1]["loss"] for run in rs}
        best = min(losses, key=losses.get)
        learned = {run.grid_lr: left_plateau(eval_curve(run)) for run in rs}
        chosen[label] = {"fraction": args.lr_grid_fraction, "flops": short, "losses": losses, "chosen": best,
                         "left_plateau": learned, "chosen_on_plateau": not any(learned.values())}
        print(f"fastmae study: {label}: learning rate {best:g} (held-out loss after {short:.3g} FLOPs: "
              + ", ".join(f"lr {lr:g} {loss:.3f}" for lr, loss in losses.items()) + ")", file=sys.stderr)
    return chosen


def ranks_at_matched_loss(runs: dict[str, list[Run]], data: Path, sequences: int,
                          encoder_learned: dict[str, list[bool]]) -> dict[str, MatchedRanks]:
    """Each objective's ranks at the held-out loss every run that learned reached (its loss left the unigram plateau
    and, `encoder_learned`, its encoder learned context): analyze's records of the weights each seed kept at its
    evaluation nearest that level (`summary.matched_points`)."""
    level, points = matched_points({label: [eval_curve(run) for run in rs] for label, rs in runs.items()},
                                   encoder_learned)
    matched = {}
    for label, rs in runs.items():
        if isinstance(points[label], str):
            matched[label] = MatchedRanks(level, excluded=points[label])
            continue
        records = [analyze_run(run, data, sequences, step=point["step"]) for run, point in zip(rs, points[label])]
        matched[label] = MatchedRanks(level, steps=[p["step"] for p in points[label]],
                                      losses=[p["loss"] for p in points[label]], ranks=ranks_of(records))
    return matched


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae study", description="The papers' claims, measured on your data "
                                     "under one compute budget: train, fine-tune and analyze each objective.")
    parser.add_argument("--data", help="a dataset directory written by `fastmae prepare` (required but with "
                        "--rewrite-report)")
    parser.add_argument("--objectives", default="mlm,mae-lm,3ml",
                        help="comma-separated: mlm, mae-lm, 3ml, k=N, each with optional :field=value (default "
                             "mlm,mae-lm,3ml)")
    presets = "; ".join(f"{name}: {preset.what}" for name, preset in STUDY_PRESETS.items()).replace("%", "%%")
    parser.add_argument("--budget", default="cpu-30min",
                        help=f"training FLOPs per run, or a preset ({presets}); default cpu-30min")
    parser.add_argument("--quick", action="store_true", help="the CI-sized preset (same as --budget quick)")
    parser.add_argument("--out", required=True, help="output directory (study.json, report.md, runs/, ...)")
    parser.add_argument("--task", action="append", help="a GLUE task directory (train.tsv, dev.tsv), a GLUE "
                        "directory of several (CoLA/, RTE/, ...) to fine-tune each encoder on through `fastmae glue`, "
                        "or `generated`: word order (10 words as written, or shuffled) from --data's own text; "
                        "repeat it for several (e.g. --task generated --task glue/SST-2)")
    parser.add_argument("--task-name", choices=sorted(GLUE_TASKS), help="the task, when the directory name does "
                        "not say it")
    parser.add_argument("--seeds", type=int, default=0, help="pretraining seeds per objective (default: the "
                        "preset's)")
    parser.add_argument("--finetune-seeds", type=int, default=0, help="fine-tuning seeds per encoder (default: the "
                        "preset's)")
    parser.add_argument("--lr-grid", help="comma-separated learning rates: each objective is first trained at each "
                        "for --lr-grid-fraction of the budget and the study's runs use the rate with the lowest "
                        "held-out loss, so no objective is held to a rate chosen for another (e.g. 5e-4,1e-3,2e-3)")
    parser.add_argument("--lr-grid-fraction", type=float, default=0.2, help="share of the budget each grid run "
                        "trains for (default 0.2)")
    parser.add_argument("--ranks", type=int, default=0, help="processes per run (default: the GPUs, or 1 on CPU)")
    parser.add_argument("--parallel", type=int, default=1, help="runs trained at once on the one device, each its "
                        "own process (small models leave a GPU idle between kernels; their seconds then overlap). "
                        "Default 1")
    parser.add_argument("--config", help="a run config YAML whose settings every run starts from")
    parser.add_argument("--rewrite-report", action="store_true", help="write --out's findings, study.json and "
                        "report.md again from its study.json alone (the neighbour probe judged by today's test); "
                        "runs nothing")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every run, e.g. model.hidden_size=256")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv

    def go():
        if args.seeds < 0 or args.finetune_seeds < 0 or args.ranks < 0 or args.parallel < 1:
            raise FastmaeError("--seeds, --finetune-seeds, --ranks and --parallel must be positive")
        if not args.rewrite_report and not args.data:
            raise FastmaeError("--data is required (a dataset directory written by `fastmae prepare`)")
        result = rewrite_report(Path(args.out)) if args.rewrite_report else study(args)
        for line in result["findings"]:
            print(f"fastmae study: {line}", file=sys.stderr)
        print(f"fastmae study: wrote {Path(args.out) / 'report.md'} and study.json", file=sys.stderr)

    return run_command("fastmae study", go)


if __name__ == "__main__":
    sys.exit(main())
