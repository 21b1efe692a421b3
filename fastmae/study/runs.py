"""The study's runs: their configs, the training, fine-tuning and analysis subprocesses, and what each left behind."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..analyze import AnalyzeConfig
from ..atomic import atomic_write_text
from ..checkpoint import WEIGHTS, kept_eval_weights, weights_metadata
from ..config import ModelConfig, RunConfig, load_run_config
from ..data import PackedLoader
from ..errors import FastmaeError
from ..flops import plan_budget
from ..metrics import read_metrics
from ..tasks import GLUE_TASKS
from .objectives import Objective, StudyPreset


# ------------------------------------------------------------------------------------------------- the runs
@dataclass(frozen=True)
class Run:
    """One pretraining run of the study: an objective at a seed, at the learning rate the study chose for it (None:
    the preset's), or a run of its learning-rate grid (`grid_lr`: a short run at that rate, `--lr-grid`)."""

    objective: Objective
    seed: int
    out: Path
    lr: float | None = None
    grid_lr: float | None = None

    @property
    def name(self) -> str:
        grid = "" if self.grid_lr is None else f"-lrgrid{self.grid_lr:g}"
        return f"{self.objective.slug}-seed{self.seed}{grid}"

    @property
    def config_file(self) -> Path:
        return self.out / "configs" / f"{self.name}.yaml"

    @property
    def dir(self) -> Path:
        return self.out / "runs" / self.name

    @property
    def analysis_dir(self) -> Path:
        return self.out / "analysis" / self.name


def _objective_config(objective: Objective, args, preset: StudyPreset, extra: list[str]) -> RunConfig:
    """The run config of `objective` under the study's settings (preset, --config, overrides, --data) and `extra`,
    validated by the trainer's own loader (an objective that cannot learn from context is refused here)."""
    overrides = [*preset.run, *args.overrides, f"model.preset={objective.preset}",
                 *(f"model.{key}={json.dumps(value)}" for key, value in objective.overrides.items()),
                 f"data.path={Path(args.data).resolve()}", *extra]
    try:
        return load_run_config(args.config, overrides)
    except ValueError as err:
        raise FastmaeError(f"objective {objective.label!r}: {err}") from None


def run_config_text(run: Run, args, budget: float, preset: StudyPreset) -> str:
    """The resolved YAML config of `run` (FLOP `budget`, the preset's evaluations over it, its weights kept at each
    unless it is a grid run, its learning rate where the study chose one)."""
    lr = run.grid_lr if run.grid_lr is not None else run.lr
    return _objective_config(run.objective, args, preset, [
        f"log.dir={run.dir.resolve()}", f"train.seed={run.seed}", f"train.flops_budget={budget!r}", "eval.every=0",
        f"eval.every_flops={budget / preset.eval_points!r}",
        # weights at every evaluation for the ranks at matched loss (not for a grid run: it is never analyzed, and at
        # base size each copy is 0.5 GB)
        f"eval.keep_weights={str(run.grid_lr is None).lower()}",
        *([f"train.lr={lr!r}"] if lr is not None else [])]).to_yaml()


def step_flops(objective: Objective, args, preset: StudyPreset, ranks: int) -> float:
    """Training FLOPs of the first optimizer step of `objective`'s run on --data (all `ranks`)."""
    config = _objective_config(objective, args, preset, []).for_world(ranks)
    loader = PackedLoader.for_run(config, 0, ranks)
    return plan_budget(loader.every_rank(), config.model, loader.micro_batches_per_step, budget=0.0).flops_per_step


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
    seconds = round(time.time() - started, 1)
    atomic_write_text(run.dir / "study_run.json", json.dumps({"seconds": seconds, "command": shlex.join(command)})
                      + "\n")
    print(f"fastmae study: trained {run.name} in {seconds:.0f} s", file=sys.stderr)


def analyze_run(run: Run, data: Path, sequences: int, step: int | None = None) -> dict:
    """analyze's record of `run`'s encoder at the end of its budget, or of the weights it kept at its evaluation of
    `step` (eval.keep_weights), reusing a record of the same weights."""
    from ..analyze import run as analyze

    source, out = run.dir, run.analysis_dir
    if step is not None:
        kept = kept_eval_weights(run.dir)
        if step not in kept:
            raise FastmaeError(f"{run.dir}: no weights kept at the evaluation of step {step} (the run was trained "
                               "without eval.keep_weights)")
        source, out = kept[step], run.analysis_dir / f"step{step}"
    record_file = out / "analysis.json"
    _, weights_step = weights_metadata(source / WEIGHTS)
    if record_file.is_file():
        record = json.loads(record_file.read_text())
        if record.get("step") == weights_step and record.get("sequences") == sequences and "neighbour_probe" in record:
            return record  # (records written before the neighbour probe existed are measured again)
    return analyze(source, data, out, AnalyzeConfig(sequences=sequences))


def task_name_of(task_dir: Path, explicit: str | None) -> str:
    """The GLUE task of a directory (its name: RTE, SST-2, STS-B, ...) unless --task-name says."""
    name = explicit or re.sub(r"[^a-z0-9]", "", task_dir.name.lower())
    if name not in GLUE_TASKS:
        raise FastmaeError(f"--task {task_dir}: cannot tell the GLUE task from the directory name; pass --task-name "
                           f"(one of {sorted(GLUE_TASKS)})")
    return name


def eval_curve(run: Run) -> list[dict]:
    """The held-out evaluation records of a finished run, one per step in step order (a resumed run logs again the
    evaluations after its checkpoint; the last record of a step is the one the finished run continued from)."""
    by_step = {r["step"]: r for r in read_metrics(run.dir) if r.get("kind") == "eval"}
    return [by_step[step] for step in sorted(by_step)]


def model_facts(run: Run) -> dict:
    """Size facts of a run's network from its saved model config."""
    import torch

    from ..model import MaskedLM

    config = ModelConfig.from_dict(json.loads((run.dir / "model_config.json").read_text()))
    with torch.device("meta"):
        sizes = {name: p.numel() for name, p in MaskedLM(config).named_parameters()}
    return {"encoder_layers": config.encoder_layers, "decoder_layers": config.decoder_layers,
            "insert_layer": config.insert_layer, "hidden_size": config.hidden_size, "mask_rate": config.mask_rate,
            "mask_rate_end": config.mask_rate if config.mask_rate_end == -1.0 else config.mask_rate_end,
            "parameters": sum(sizes.values()),
            "encoder_parameters": sum(n for name, n in sizes.items() if name.startswith(("embeddings.", "encoder.")))}


def default_ranks() -> int:
    """GPUs when there are any; else one process (on 2 CPU cores, one process with both beat two ranks by 1.5x)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def device_text(run: Run) -> str:
    """Where and how a run trained, from the `run_info.json` its trainer wrote."""
    info_file = run.dir / "run_info.json"
    if not info_file.is_file():
        return "unknown (the run wrote no run_info.json)"
    info = json.loads(info_file.read_text())
    return (f"{info['ranks']} x {info['device']}, {info['precision']}, matmul peak "
            f"{info['peak_flops'] / 1e12:.3g} TFLOP/s")
