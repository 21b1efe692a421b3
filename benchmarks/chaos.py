"""Random kills, measured: does a run killed at any moment resume to the same weights?

    python benchmarks/chaos.py [--trials 20] [--stages 2,3] [--seed 0] [--steps 120]

For each ZeRO stage, one uninterrupted run first (the reference: its wall time and final weights), then `--trials`
trials of the same command: each starts the run (2 CPU ranks under DeepSpeed's per-node launcher, in a process group
of its own), sends SIGKILL at a moment drawn uniformly over the reference's wall time (seeded, recorded), either to
the whole group (the launcher and its ranks: a preempted node) or to one rank alone (a crashed process; the launcher
then stops the other), and starts the same command again (`--resume auto`) until it finishes. A trial records where
the kill landed (`start-up`: no train record written yet; `checkpoint write`: a partial or half-deleted checkpoint
directory found after it; `training`: anywhere else, evaluations included), whether the resume fell back past a
damaged checkpoint, processes of the run still alive after the kill, half-written files left once the run ends
(`fastmae.checkpoint.leftovers`), complete checkpoints against `checkpoint.keep`, whether the final weights equal the
reference's (the sha256 of their contents: `weights_sha256`), and the wall time lost. The run: the demo's model
(2 x 128, pre-LN, rotary) with dropout 0.1 on the embedded corpus, fp32, a checkpoint every 10 steps (2 kept), an
evaluation every 40.

Writes benchmarks/results/chaos.{json,md}: one row per ZeRO stage (`zero_stage`, `trials`, `identical`, kills per
phase, fallbacks, leftover processes and files, keep honoured, wall time lost) and every trial in `trials_detail`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from common import write_results

from fastmae.checkpoint import complete_checkpoints, leftovers

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "runs" / "data" / "builtin-v1000"  # what the demo's config prepares on its first run


def run_args(data: Path, run_dir: Path, zero_stage: int, steps: int, extra: dict | None = None) -> list[str]:
    """The trials' command line: the demo's recipe, short, with dropout (a resume must restore every RNG)."""
    values = {"data.path": str(data), "train.steps": steps, "train.zero_stage": zero_stage, "train.precision": "fp32",
              "train.warmup_steps": 10, "model.dropout": 0.1, "eval.every": 40, "eval.sequences": 64,
              "checkpoint.every": 10, "checkpoint.keep": 2, "log.every": 10, "log.dir": str(run_dir),
              "log.tensorboard": False, **(extra or {})}
    return ["--config", str(REPO / "configs" / "tiny-cpu.yaml"), *(f"{k}={v}" for k, v in values.items())]


def free_port() -> int:
    """A loopback port no process listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEEPSPEED_LAUNCHER = ("-m", "deepspeed.launcher.launch")


def start(args: list[str], ranks: int = 2, env_extra: dict | None = None, stdout=subprocess.DEVNULL,
          launcher: tuple[str, ...] = DEEPSPEED_LAUNCHER) -> subprocess.Popen:
    """`ranks` ranks of fastmae/train.py under a per-node launcher, in a new process group; its stderr (text) in the
    returned process. `launcher`: DeepSpeed's by default (what `deepspeed --num_gpus N` starts on one node, minus that
    command's own process); the suite passes its stand-in, tests/rank_launcher.py, where the launcher is not what a
    test is about."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RANK", "WORLD_SIZE")}
    env.update({"PYTHONUNBUFFERED": "1", **(env_extra or {})})
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode()).decode()
    cmd = [sys.executable, "-u", *launcher, f"--world_info={world}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(REPO / "fastmae" / "train.py"), *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def run_to_end(args: list[str], timeout: float = 600) -> tuple[float, str]:
    """(seconds, stderr) of one whole run; raises when it fails."""
    began = time.perf_counter()
    process = start(args)
    _, stderr = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"run failed ({process.returncode}):\n{stderr[-3000:]}")
    return time.perf_counter() - began, stderr


def weights_sha256(run_dir: Path) -> str:
    """sha256 of the final weights' contents: every tensor's name, dtype, shape and bytes, and the metadata, in sorted
    order. Not of the file: safetensors writes its metadata in a hash map's order, which differs between processes."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    with safe_open(str(run_dir / "model.safetensors"), "pt") as weights:
        digest.update(json.dumps(weights.metadata(), sort_keys=True).encode())
        for name in sorted(weights.keys()):
            tensor = weights.get_tensor(name).contiguous()
            digest.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def processes_of(run_dir: Path) -> list[int]:
    """PIDs of live processes whose command line names `run_dir` (the launcher and ranks of a run there)."""
    return [process.pid for process in psutil.process_iter() if str(run_dir) in " ".join(_cmdline(process))]


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # the launcher has exited already
        return []


def _cmdline(process: psutil.Process) -> list[str]:
    """A process's command line; empty for one that has exited (or is a zombie) meanwhile."""
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def kill_phase(run_dir: Path) -> str:
    """Where a kill landed, read from what it left: no train record yet, a checkpoint half-written, or elsewhere."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file() or '"kind": "train"' not in metrics.read_text():
        return "start-up"
    checkpoints = run_dir / "checkpoints"
    if any(checkpoints.glob(".partial-*")) or any(checkpoints.glob(".deleting-*")):
        return "checkpoint write"
    return "training"


def kill(process: subprocess.Popen, whole_group: bool) -> str:
    """SIGKILL to `process`'s whole group, or to its rank 1 alone (the whole group while no rank has started yet);
    returns which, after the launcher has exited."""
    target = "group"
    rank = None if whole_group else next((c for c in _children(process.pid) if "--local_rank=1" in _cmdline(c)), None)
    if rank is None:
        os.killpg(process.pid, signal.SIGKILL)
    else:
        rank.kill()
        target = "rank 1"
    try:
        process.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # a launcher that never noticed its rank died: stopped, and it shows as lost time
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    return target


def trial(args: list[str], run_dir: Path, kill_after_s: float, whole_group: bool, max_runs: int = 4,
          clock_from: Path | None = None, launcher: tuple[str, ...] = DEEPSPEED_LAUNCHER) -> dict:
    """One kill `kill_after_s` after the start (or after `clock_from` appears: a moment inside training whatever the
    machine's start-up time), then the same command until a run of it exits cleanly. Returns what happened (module
    docstring). `launcher`: as `start` takes it."""
    began = time.perf_counter()
    process = start(args, launcher=launcher)
    while clock_from is not None and not clock_from.exists() and process.poll() is None:
        time.sleep(0.05)
    try:
        process.communicate(timeout=kill_after_s)
        target, landed = "none", "after the end"  # the run finished first
    except subprocess.TimeoutExpired:
        target = kill(process, whole_group)
        landed = kill_phase(run_dir)
    time.sleep(1.0)  # the launcher has exited; its ranks get a moment to follow
    left_alive = processes_of(run_dir)
    for pid in left_alive:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    runs, fallback = 0, False
    while landed != "after the end":
        runs += 1
        process = start(args, launcher=launcher)
        _, stderr = process.communicate(timeout=600)
        fallback |= "skipping checkpoint" in stderr
        if process.returncode == 0:
            break
        if runs == max_runs:
            raise RuntimeError(f"{run_dir}: still failing after {runs} resumes:\n{stderr[-3000:]}")
    return {"kill_after_s": round(kill_after_s, 2), "target": target, "landed": landed, "resumes": runs,
            "fallback": fallback, "processes_left": len(left_alive),
            "leftover_files": [str(p.relative_to(run_dir)) for p in leftovers(run_dir)],
            "checkpoints_kept": len(complete_checkpoints(run_dir / "checkpoints")),
            "sha256": weights_sha256(run_dir), "seconds": time.perf_counter() - began}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "chaos")
    args = parser.parse_args(argv)
    if not (DATA / "meta.json").is_file():
        from fastmae.prepare import prepare

        prepare([], DATA, fmt="builtin", vocab_size=1000, valid_fraction=0.1, workers=1, progress=False)
    draw = random.Random(args.seed)
    rows, trials = [], []
    for stage in (int(s) for s in args.stages.split(",")):
        reference_dir = args.work / f"zero{stage}-reference"
        subprocess.run(["rm", "-rf", str(reference_dir)], check=True)
        reference_s, _ = run_to_end(run_args(DATA, reference_dir, stage, args.steps))
        reference = weights_sha256(reference_dir)
        print(f"ZeRO-{stage}: reference run {reference_s:.1f} s", flush=True)
        done = []
        for index in range(args.trials):
            run_dir = args.work / f"zero{stage}-trial{index:02d}"
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            kill_after, whole_group = draw.uniform(0, reference_s), draw.random() < 0.5
            record = trial(run_args(DATA, run_dir, stage, args.steps), run_dir, kill_after, whole_group)
            record.update(zero_stage=stage, trial=index, identical=record["sha256"] == reference,
                          lost_s=record["seconds"] - reference_s)
            done.append(record)
            print(f"ZeRO-{stage} trial {index}: kill at {kill_after:.1f} s ({record['target']}, {record['landed']}),"
                  f" {record['resumes']} resume(s), identical {record['identical']}, lost {record['lost_s']:.1f} s",
                  flush=True)
        phases = {phase: sum(r["landed"] == phase for r in done)
                  for phase in ("start-up", "training", "checkpoint write", "after the end")}
        rows.append({"zero_stage": stage, "trials": len(done), "identical": sum(r["identical"] for r in done),
                     **{f"killed in {phase}": count for phase, count in phases.items()},
                     "fallbacks": sum(r["fallback"] for r in done),
                     "processes_left": sum(r["processes_left"] for r in done),
                     "leftover_files": sum(len(r["leftover_files"]) for r in done),
                     "keep_honoured": sum(r["checkpoints_kept"] <= 2 for r in done),
                     "reference_s": round(reference_s, 1),
                     "median_lost_s": round(statistics.median(r["lost_s"] for r in done), 1)})
        trials += done
    columns = list(rows[0])
    notes = (f"{args.trials} trials per ZeRO stage, seed {args.seed}: SIGKILL at a moment drawn uniformly over the "
             f"reference run's wall time, to the whole process group or to rank 1 alone (a coin flip), then the same "
             f"command until the run finished. The run: configs/tiny-cpu.yaml, {args.steps} steps, dropout 0.1, fp32, "
             "2 CPU ranks, a checkpoint every 10 steps (2 kept), an evaluation every 40. identical: final weights' "
             "sha256 equal to the uninterrupted run's (benchmarks/chaos.py).")
    path = write_results("chaos", rows, columns, "Random kills and resumes", notes,
                         {"seed": args.seed, "steps": args.steps, "trials_detail": trials})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
