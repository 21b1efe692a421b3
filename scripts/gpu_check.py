"""The GPU check in phases: each one command of at most 8 minutes on a lent machine, its set-up included, in the order
of what they decide (a lent machine gives 15 to 30 minutes in all, 10 per command, and each call may start a fresh, bare
machine).

    bash scripts/gpu_check.sh --plan               # one line per phase: name, minutes (timed or estimated), command
    bash scripts/gpu_check.sh PHASE [--force]      # run one phase (skipped when already done for this commit)
    bash scripts/gpu_check.sh --dry-run PHASE      # the phase's steps, their commands and files; runs nothing
    bash scripts/gpu_check.sh --collect DIR        # what a lent machine brought back from $OUT, into the tree
    bash scripts/gpu_check.sh all                  # every phase not yet done, in order (not under $OUT)

A phase first installs what the machine lacks, offline: the wheels `scripts/gpu_wheels.sh` put in .whl/ (carried with
the tree) for the modules that are missing, then fastmae itself with --no-deps (the image's torch stays as it is),
and names any module fastmae imports that is still missing. Then its steps run in order, each within what is left of
the phase's 8 minutes (a step past it is stopped and recorded as cut). Everything lands in
benchmarks/results/gpu/DEVICE/PHASE/: each step's log, the files it wrote, and phase.json (the commit measured, each
step's exit status and seconds), rewritten after every step. The commit comes from FASTMAE_COMMIT (a lent machine's
copy of the tree has no .git), else git.

How the files come home. A lent machine returns only files under $OUT at most two folders down, at most 8 of them,
16 MiB each, named in letters, digits, '.', '_' and '-'. So after every step a phase mirrors itself as $OUT/PHASE/:
phase.json, the files its steps keep (at most 6 a phase, flat) and logs.tar.gz (every step's log, each cut to its
last 4 MiB); a cut phase keeps what it measured. One phase per call: `all` refuses to run with $OUT set. Back here,
`bash scripts/gpu_check.sh --collect FILES_AT` (the folder the device tool put them in) rebuilds
benchmarks/results/gpu/DEVICE/PHASE/ (DEVICE from phase.json's machine), logs unpacked; commit that directory with the
commit it measured.

What a fresh machine has is the tree that travels (tracked files, untracked ones git does not ignore, and .whl/
carried), nothing a previous call left there. So the skip of a phase already done for this commit reads the
phase.json collected into the tree, and a step that reads another phase's results (recipe's micro-batch refit reads
headline's throughput) names them in `needs`: they must have been collected into the tree first, or the step is not
run and says which file it lacks. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("FASTMAE_GPU_RESULTS", ROOT / "benchmarks" / "results" / "gpu"))
WHEELS = ROOT / ".whl"
PHASE_BUDGET_S = 8 * 60
RECORD_MARGIN_S = 10  # kept back from the last step, to write the phase's record
# what the device tool brings back from $OUT (its README's limits)
OUT_MAX_FILES, OUT_MAX_BYTES, OUT_MAX_FOLDERS = 8, 16 * 2**20, 2
OUT_NAME = re.compile(r"[A-Za-z0-9._-]+")
KEPT_PER_PHASE = OUT_MAX_FILES - 2  # beside phase.json and logs.tar.gz
LOG_TAIL_BYTES = 4 * 2**20  # of each step's log in logs.tar.gz: a phase's 3 logs stay under 16 MiB unpacked
PY = "{python}"  # stands for the interpreter running this script

# Modules a phase needs, with the distribution that provides each. Those in CARRIED install from .whl/ when missing;
# a missing one of the others is named and the phase stops.
CARRIED = {"setuptools": "setuptools", "wheel": "wheel", "deepspeed": "deepspeed", "hjson": "hjson",
           "pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
           "typing_inspection": "typing-inspection", "zstandard": "zstandard", "einops": "einops",
           "msgpack": "msgpack", "cpuinfo": "py-cpuinfo", "ninja": "ninja"}
IMAGE = {"torch": "torch", "triton": "triton", "numpy": "numpy", "tqdm": "tqdm", "yaml": "pyyaml",
         "sentencepiece": "sentencepiece", "safetensors": "safetensors", "psutil": "psutil",
         "matplotlib": "matplotlib", "pytest": "pytest", "transformers": "transformers", "packaging": "packaging"}

RUN_3ML_BASE = ["--config", "configs/3ml-base.yaml", "--resume", "none", "data.path=builtin",
                "data.builtin_vocab_size=8000", "train.warmup_steps=1", "checkpoint.keep=1"]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    command: tuple[str, ...]
    keeps: tuple[str, ...] = ()  # files the command writes, copied into the phase's directory
    env: tuple[tuple[str, str], ...] = ()
    # files of another phase the command reads ({results} = benchmarks/results/gpu/DEVICE): on a fresh machine they
    # exist only where they were collected into the tree and travelled with it
    needs: tuple[str, ...] = ()
    # an earlier step of the phase whose seconds this one is expected to take again: it runs only when they are left
    fits_after: str = ""


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    minutes: int  # on a fresh machine, set-up from .whl/ and Triton compiles included
    decides: str
    steps: tuple[Step, ...]
    # `minutes` as the phase ran on a lent machine (headline: an H200, 2026-11-26, rounded up), else estimated (smoke
    # ran in 3 there before its FlashAttention and fused-kernel tests, about 30 s on an H100; modernbert's steps ran in
    # about 3 on an H100, 2026-11-26, outside the phase)
    timed: bool = False
    budget_s: int = 0  # the phase's limit, set-up included (0: PHASE_BUDGET_S)
    # what the command line must give the phase (`--corpus PATH`: {corpus} in its steps)
    arguments: tuple[str, ...] = ()
    # {name} in its steps: (name, value, the value under --quick, the same steps at the CPU's scale)
    values: tuple[tuple[str, str, str], ...] = ()


def _pytest(*args: str) -> tuple[str, ...]:
    return (PY, "-m", "pytest", "-q", *args)


PHASES = (
    Phase("smoke", 4, "torch's FlashAttention-2 kernels compute the windowed oracle; captured graphs compute what "
                      "eager computes; no host-device sync in a steady step", (
        # the torch_flash backend's CUDA kernels against the oracle (global, windows; lengths no block divides),
        # dropout redrawn from the rng state and in a recorded graph
        Step("flash_tests", _pytest("tests/test_flash.py", "tests/test_attention.py", "-k",
                                    "torch_flash or window or rng_state or recorded_graph or traces_whole")),
        # the layers' fused kernels (rotary of q and k; residual add + LayerNorm) compiled for this GPU, against
        # their references forward and backward
        Step("fused_kernel_tests", _pytest("-m", "not large", "tests/kernels/test_kernel_rotary.py",
                                           "tests/kernels/test_kernel_norm.py")),
        Step("graph_tests", _pytest("tests/test_graphs.py", "-k", "captured")),
        Step("sync_tests", _pytest("tests/test_train.py", "-k", "steady_state")),
        # one 3ml base step replayed from its recording under set_sync_debug_mode("error"): step 3 of 4 (the second
        # sight records; the last step is logged), at the recipe's 65,536 tokens per micro-batch
        Step("sync_step_3ml_base", (PY, "-m", "fastmae.train", *RUN_3ML_BASE, "train.steps=4",
                                    "train.tokens_per_step=65536", "eval.every=0", "checkpoint.every=1000",
                                    "log.every=4",
                                    "log.dir=runs/gpu-check/sync-3ml-base"),
             keeps=("runs/gpu-check/sync-3ml-base/metrics.jsonl", "runs/gpu-check/sync-3ml-base/run_info.json"),
             env=(("FASTMAE_SYNC_DEBUG", "1"),)),
    )),
    Phase("headline", 3, "3ml and mlm against Hugging Face RoBERTa at base size: tokens/s, MFU, GPU busy", (
        Step("throughput_headline", (PY, "benchmarks/throughput.py", "--size", "base", "--sequences", "128",
                                     "--systems", "hf-roberta,mlm,3ml", "--eager", "--name", "throughput_headline"),
             keeps=tuple(f"benchmarks/results/throughput_headline.{ext}" for ext in ("json", "md", "png"))),
    ), timed=True),
    Phase("modernbert", 5, "fastmae on ModernBERT's layers against transformers' ModernBertForMaskedLM at base size", (
        Step("throughput_modernbert", (PY, "benchmarks/throughput.py", "--size", "base", "--sequences", "128",
                                       "--systems", "hf-modernbert,modern-mlm,modern-3ml,modern-mae-lm",
                                       "--name", "throughput_modernbert_gpu"),
             keeps=tuple(f"benchmarks/results/throughput_modernbert_gpu.{ext}" for ext in ("json", "md", "png"))),
        Step("local_attention", (PY, "benchmarks/local_attention.py"),
             keeps=("benchmarks/results/local_attention_flex.json", "benchmarks/results/local_attention_flex.md")),
    )),
    Phase("kernels", 6, "every Triton kernel compiled for this GPU against its torch reference; their speed", (
        Step("kernel_tests", _pytest("-n", "8", "-m", "not large", "tests/kernels")),
        Step("kernel_benchmark", (PY, "benchmarks/kernels.py"),
             keeps=("benchmarks/results/kernels.json", "benchmarks/results/kernels.md")),
    )),
    Phase("attention", 6, "every attention backend against the naive reference; their speed", (
        Step("attention_tests", _pytest("-m", "large or not large", "tests/test_attention.py")),
        Step("relative_bias_tests", _pytest("tests/test_model.py", "-k", "relative_bias")),
        Step("attention_benchmark", (PY, "benchmarks/attention.py"),
             keeps=("benchmarks/results/attention.json", "benchmarks/results/attention.md")),
    )),
    Phase("overhead", 5, "device ops, launches and syncs per step, eager and replayed; bf16 fine-tuning", (
        Step("host_overhead_benchmark", (PY, "benchmarks/host_overhead.py"),
             keeps=("benchmarks/results/host_overhead.json", "benchmarks/results/host_overhead.md")),
        Step("host_overhead_graphs_benchmark", (PY, "benchmarks/host_overhead.py", "--zero-stage", "2",
                                                "--cuda-graphs", "--name", "host_overhead_zero2_graphs"),
             keeps=("benchmarks/results/host_overhead_zero2_graphs.json",
                    "benchmarks/results/host_overhead_zero2_graphs.md")),
        Step("finetune_tests", _pytest("tests/test_finetune.py", "-k", "bf16")),
    )),
    Phase("large_kernels", 7, "the kernels at realistic shapes (up to 14 GB each)", (
        Step("kernel_tests_large", _pytest("-m", "large", "tests/kernels")),
    )),
    Phase("recipe", 7, "the recipes' micro-batch from measured memory; 50 steps of 3ml-base", (
        Step("micro_batch", (PY, "benchmarks/micro_batch.py", "--device-dir", "{results}/headline"),
             keeps=("benchmarks/results/micro_batch.json", "benchmarks/results/micro_batch.md"),
             needs=("{results}/headline/throughput_headline.json",)),
        Step("train_3ml_base", (PY, "-m", "fastmae.train", *RUN_3ML_BASE, "train.steps=50",
                                "train.tokens_per_step=131072", "eval.every=50", "eval.sequences=256",
                                "checkpoint.every=50", "log.every=5", "log.dir=runs/gpu-check/3ml-base"),
             keeps=tuple(f"runs/gpu-check/3ml-base/{name}" for name in
                         ("metrics.jsonl", "curves.png", "config.yaml", "run_info.json"))),
    )),
)


STUDY_OUT = "runs/gpu-study"
STUDY_KEEPS = tuple(f"{STUDY_OUT}/study/{name}" for name in ("study.json", "report.md", "loss_vs_flops.png",
                                                              "ranks.png"))


def _study(seeds: int) -> tuple[str, ...]:
    """The masking study at the preset's scale (issue 56): mlm at 15% and 30% and 3ml at 50%, each run under one
    FLOP budget, 3 trained at once on the one GPU, fine-tuned on word order and on the real task given."""
    return (PY, "-m", "fastmae.study", "--data", f"{STUDY_OUT}/data", "--budget", "{budget}", "--objectives",
            "mlm,mlm:mask_rate=0.3,3ml", "--seeds", str(seeds), "--parallel", "3", "--task", "generated",
            "--task", "{task}", "--out", f"{STUDY_OUT}/study")


# the study's per-run records (training logs, metrics, configs, its GLUE cells' summaries) as one archive
PACK_RUNS = ("sh", "-c", f"cd {STUDY_OUT}/study && tar czf ../study_runs.tar.gz logs configs runs/*/metrics.jsonl "
             "runs/*/run_info.json glue*/glue.json")

PHASES += (
    Phase("study", 9, "does 3ml pay at 1e16 FLOPs a run? mlm 15% / 30% and 3ml 50% on real English text, "
                      "pretrained, evaluated, probed and fine-tuned in one command", (
        # the corpus's 32K-piece tokenizer on the machine's cores (lines sampled: sentencepiece's time grows with
        # them), held-out documents split off by document
        Step("prepare", (PY, "-m", "fastmae.prepare", "--input", "{corpus}", "--format", "jsonl", "--output",
                         f"{STUDY_OUT}/data", "--vocab-size", "{vocab}", "--valid-fraction", "0.02",
                         "--docs-per-shard", "500", "--input-sentence-size", "150000")),
        # one seed of each arm first: a result whatever the second costs
        Step("study_one_seed", _study(1), keeps=STUDY_KEEPS),
        Step("pack_one_seed", PACK_RUNS, keeps=(f"{STUDY_OUT}/study_runs.tar.gz",)),
        Step("study_two_seeds", _study(2), keeps=STUDY_KEEPS, fits_after="study_one_seed"),
        Step("pack_two_seeds", PACK_RUNS, keeps=(f"{STUDY_OUT}/study_runs.tar.gz",)),
    ), budget_s=9 * 60, arguments=("corpus", "task"),
        values=(("budget", "gpu-10min", "quick"), ("vocab", "32000", "1000"))),
)


# What a lent GPU should run for an issue but no lease holds: named by --plan, run on a machine held for hours.
MASK_MORE_OR_LATER = ("mlm,mlm:mask_rate=0.3,mlm:mask_rate=0.5,mlm:mask_rate=0.3:mask_rate_end=0.15,3ml,"
                      "3ml:mask_rate_end=0.3")
BEYOND_A_LEASE = (
    ("mask-more-or-later", "12 runs of about an hour each on one H100 (issue 49: cpu-1h's study at RoBERTa-base size, "
     "on a corpus of the user's prepared with `fastmae prepare`: the embedded one is far too small for it)",
     ("fastmae", "study", "--data", "DATASET_DIR", "--budget", "gpu-1h", "--task", "generated", "--out",
      "runs/study-mask-more-or-later-gpu", "--objectives", MASK_MORE_OR_LATER, "train.schedule=wsd",
      "train.decay_fraction=0.2", "train.decay_shape=1-sqrt")),
)


def phase_named(name: str) -> Phase:
    for phase in PHASES:
        if phase.name == name:
            return phase
    raise SystemExit(f"gpu_check: unknown phase {name!r}; phases: {', '.join(p.name for p in PHASES)}")


def command_line(step: Step, results: Path, values: dict[str, str] | None = None) -> list[str]:
    """The step's command with the interpreter, the results directory and the phase's `values` filled in."""
    filled = {PY: sys.executable, "{results}": str(results), **{f"{{{k}}}": v for k, v in (values or {}).items()}}
    return [re.sub("|".join(map(re.escape, filled)), lambda m: filled[m[0]], part) for part in step.command]


def phase_values(phase: Phase, given: dict[str, str | None], quick: bool = False) -> dict[str, str]:
    """What fills the phase's placeholders: its arguments as given (each required) and its values, the --quick ones
    under `quick`."""
    missing = [name for name in phase.arguments if not given.get(name)]
    if missing:
        raise SystemExit(f"gpu_check: the {phase.name} phase needs " + " ".join(f"--{name} ..." for name in missing))
    return {**{name: given[name] for name in phase.arguments},
            **{name: quick_value if quick else value for name, value, quick_value in phase.values}}


def needed_files(step: Step, results: Path) -> list[Path]:
    return [Path(need.replace("{results}", str(results))) for need in step.needs]


def plan_lines() -> list[str]:
    """One line per phase, then a comment line per run that no lease holds (BEYOND_A_LEASE)."""
    return [*(f"{phase.name} {phase.minutes} min ({'timed' if phase.timed else 'estimated'}) "
              f"bash scripts/gpu_check.sh {phase.name}"
              + "".join(f" --{name} {name.upper()}" for name in phase.arguments)
              + f"   # {phase.decides}" for phase in PHASES),
            *(f"# beyond a lease: {name}, {length}: {shlex.join(command)}" for name, length, command in BEYOND_A_LEASE)]


def out_files(phase: Phase) -> list[str]:
    """What `phase` leaves under $OUT, relative to it."""
    return [f"{phase.name}/phase.json", f"{phase.name}/logs.tar.gz",
            *(f"{phase.name}/{Path(kept).name}" for kept in _all_kept(phase))]


def _all_kept(phase: Phase) -> list[str]:
    return list(dict.fromkeys(kept for step in phase.steps for kept in step.keeps))


def out_problems(out: Path) -> list[str]:
    """Why the device tool would not bring back everything under `out` (empty when it would)."""
    problems, files = [], sorted(path for path in out.rglob("*") if not path.is_dir())
    if len(files) > OUT_MAX_FILES:
        problems.append(f"{len(files)} files (at most {OUT_MAX_FILES} come back)")
    for path in files:
        relative = path.relative_to(out)
        if len(relative.parts) - 1 > OUT_MAX_FOLDERS:
            problems.append(f"{relative}: {len(relative.parts) - 1} folders down (at most {OUT_MAX_FOLDERS})")
        if path.is_symlink() or not path.is_file():
            problems.append(f"{relative}: not a plain file")
        elif path.stat().st_size > OUT_MAX_BYTES:
            problems.append(f"{relative}: {path.stat().st_size} bytes (at most {OUT_MAX_BYTES})")
        problems += [f"{relative}: the name {part!r} has characters other than letters, digits, '.', '_', '-'"
                     for part in relative.parts if not OUT_NAME.fullmatch(part)]
    return problems


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def dry_run_lines(phase: Phase, results: Path, values: dict[str, str]) -> list[str]:
    lines = []
    for step in phase.steps:
        env = "".join(f"{key}={value} " for key, value in step.env)
        lines.append(f"+ [{step.name}] {env}{shlex.join(command_line(step, results, values))}")
        writes = [results / phase.name / f"{step.name}.log", *(results / phase.name / Path(kept).name
                                                               for kept in step.keeps)]
        lines.append("  writes: " + " ".join(map(_shown, writes)))
        if step.needs:
            lines.append("  needs: " + " ".join(_shown(path) for path in needed_files(step, results)))
    lines.append(f"  writes: {_shown(results / phase.name / 'phase.json')}")
    lines.append("  $OUT: " + " ".join(out_files(phase)))
    return lines


def current_commit() -> str:
    if os.environ.get("FASTMAE_COMMIT"):
        return os.environ["FASTMAE_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def device_directory() -> str:
    """The GPU's name as a directory name (FASTMAE_GPU_DEVICE overrides it)."""
    if os.environ.get("FASTMAE_GPU_DEVICE"):
        return os.environ["FASTMAE_GPU_DEVICE"]
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0) "
                           "if torch.cuda.is_available() else '')"], capture_output=True, text=True)
    name = done.stdout.strip()
    if not name:
        raise SystemExit("gpu_check: no CUDA device visible to torch (a GPU machine, with a CUDA build of torch?)")
    return directory_name(name)


def directory_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device)


MACHINE = """
import importlib.metadata as m, json, torch
versions = {}
for name in ("torch", "triton", "deepspeed", "transformers", "flash-attn"):
    try:
        versions[name] = m.version(name)
    except m.PackageNotFoundError:
        versions[name] = None
print(json.dumps({"device": torch.cuda.get_device_name(0), "cuda": torch.version.cuda, "versions": versions}))
"""


def set_up() -> dict:
    """Install the carried wheels of the missing modules, then fastmae (no dependencies); name what is still missing.
    Returns what the machine is (device, CUDA, versions)."""
    missing = sorted({dist for module, dist in CARRIED.items() if importlib.util.find_spec(module) is None})
    if missing:
        if not WHEELS.is_dir():
            raise SystemExit(f"gpu_check: missing {', '.join(missing)} and no .whl/ to install them from: run "
                             "`bash scripts/gpu_wheels.sh` where a registry is in reach and carry .whl/ here")
        _pip("install", "--no-deps", "--no-index", "--find-links", str(WHEELS), *missing)
    installed = subprocess.run([sys.executable, "-c", "import fastmae; print(fastmae.__file__)"],
                               capture_output=True, text=True, cwd="/")
    if installed.returncode != 0 or not installed.stdout.strip().startswith(str(ROOT)):
        _pip("install", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(ROOT))
    check = ("import importlib.util, sys; missing = [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]; "
             "print(' '.join(missing))")
    done = subprocess.run([sys.executable, "-c", check, *IMAGE, *CARRIED, "fastmae"], capture_output=True, text=True)
    if done.stdout.strip():
        names = [IMAGE.get(module, CARRIED.get(module, module)) for module in done.stdout.split()]
        raise SystemExit(f"gpu_check: this machine lacks {', '.join(names)} (imported by fastmae or its steps)")
    machine = subprocess.run([sys.executable, "-c", MACHINE], capture_output=True, text=True)
    return json.loads(machine.stdout) if machine.returncode == 0 else {"error": machine.stderr[-2000:]}


def _pip(*args: str) -> None:
    # an image's system Python may be marked externally managed (PEP 668); older pips ignore the variable
    env = {**os.environ, "PIP_BREAK_SYSTEM_PACKAGES": "1"}
    done = subprocess.run([sys.executable, "-m", "pip", "-q", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: pip {' '.join(args)} failed:\n{done.stdout}{done.stderr}")


class PhaseRecord:
    """phase.json of one phase's directory, written after every step and mirrored as $OUT/PHASE/."""

    def __init__(self, phase: Phase, directory: Path, commit: str, machine: dict):
        self.phase, self.directory, self.path = phase, directory, directory / "phase.json"
        self.data = {"phase": phase.name, "commit": commit, "started": _now(), "machine": machine,
                     "complete": False, "steps": []}
        directory.mkdir(parents=True, exist_ok=True)

    def add(self, step: Step, status: str, seconds: float) -> None:
        self.data["steps"].append({"name": step.name, "status": status, "seconds": round(seconds, 1)})
        self.write()

    def finish(self, phase: Phase) -> None:
        statuses = [s["status"] for s in self.data["steps"]]
        self.data["complete"] = len(statuses) == len(phase.steps) and all(s == "exit 0" for s in statuses)
        self.write()

    def write(self) -> None:
        left_out = [name for name in (Path(kept).name for kept in _all_kept(self.phase))
                    if (self.directory / name).is_file() and (self.directory / name).stat().st_size > OUT_MAX_BYTES]
        self.data["left_out_of_out"] = left_out  # kept here, too large for the device tool to bring back
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")
        if os.environ.get("OUT"):
            self.mirror(Path(os.environ["OUT"]) / self.phase.name, left_out)

    def mirror(self, target: Path, left_out: list[str]) -> None:
        """$OUT/PHASE/: phase.json, the kept files (flat) and logs.tar.gz, within the device tool's limits."""
        target.mkdir(parents=True, exist_ok=True)
        for name in ["phase.json", *(Path(kept).name for kept in _all_kept(self.phase))]:
            if (self.directory / name).is_file() and name not in left_out:
                shutil.copy2(self.directory / name, target / name)
        partial = target / "logs.tar.gz.partial"
        with tarfile.open(partial, "w:gz") as archive:
            for step in self.phase.steps:
                log = self.directory / f"{step.name}.log"
                if log.is_file():
                    _add_tail(archive, log, LOG_TAIL_BYTES)
        partial.replace(target / "logs.tar.gz")


def _add_tail(archive: tarfile.TarFile, path: Path, limit: int) -> None:
    """`path` into `archive` under its own name, only its last `limit` bytes when longer."""
    with path.open("rb") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(max(0, size - limit))
        info = tarfile.TarInfo(path.name)
        info.size, info.mtime = min(size, limit), int(path.stat().st_mtime)
        archive.addfile(info, file)


def collect(brought: Path, results: Path) -> list[Path]:
    """Rebuild results/DEVICE/PHASE/ from what a lent machine brought back of $OUT (`brought` holds PHASE/ folders, or
    is one); DEVICE from each phase.json's machine (FASTMAE_GPU_DEVICE overrides it). Returns the directories."""
    records = [brought / "phase.json"] if (brought / "phase.json").is_file() else sorted(brought.glob("*/phase.json"))
    if not records:
        raise SystemExit(f"gpu_check: {brought} holds no phase.json (nor PHASE/phase.json): is it what $OUT brought "
                         "back?")
    written = []
    for record in records:
        data = json.loads(record.read_text())
        device = os.environ.get("FASTMAE_GPU_DEVICE") or directory_name(data.get("machine", {}).get("device", ""))
        if not device:
            raise SystemExit(f"gpu_check: {record} names no device (its machine: {data.get('machine')}); set "
                             "FASTMAE_GPU_DEVICE")
        directory = results / device / data["phase"]
        directory.mkdir(parents=True, exist_ok=True)
        for path in record.parent.iterdir():
            if path.name == "logs.tar.gz":
                with tarfile.open(path) as archive:
                    archive.extractall(directory, filter="data")
            elif path.is_file():
                shutil.copy2(path, directory / path.name)
        written.append(directory)
    return written


def done_for(directory: Path, commit: str) -> bool:
    record = directory / "phase.json"
    if not record.is_file():
        return False
    data = json.loads(record.read_text())
    return data.get("commit") == commit and data.get("complete", False) and not data.get("quick", False)


def run_phase(phase: Phase, results: Path, commit: str, force: bool, values: dict[str, str] | None = None,
              quick: bool = False) -> bool:
    """Run `phase` (unless done for `commit`) with its placeholders' `values` (`phase_values`); True when every step
    exited 0. A `quick` run (its values at the CPU's scale) is recorded as such and never counts as done."""
    directory = results / phase.name
    if not force and done_for(directory, commit):
        print(f"gpu_check: {phase.name} is done for commit {commit} ({_shown(directory / 'phase.json')}); --force "
              "runs it again")
        return True
    budget_s = phase.budget_s or PHASE_BUDGET_S
    deadline = time.monotonic() + budget_s
    record = PhaseRecord(phase, directory, commit, set_up())
    record.data["quick"] = quick
    for step in phase.steps:
        left = deadline - time.monotonic() - RECORD_MARGIN_S
        missing = [path for path in needed_files(step, results) if not path.is_file()]
        took = {s["name"]: s["seconds"] for s in record.data["steps"]}.get(step.fits_after, 0.0)
        if left <= 0 or missing or took > left:
            status = (f"not run: needs {', '.join(map(_shown, missing))} (another phase's, collected into the tree "
                      "with --collect before this call)" if missing else
                      f"not run: {max(left, 0):.0f} s left, {step.fits_after} took {took:.0f} s" if took > left > 0
                      else f"not run: the phase's {budget_s / 60:g} minutes were spent")
            record.add(step, status, 0.0)
            print(f"gpu_check: [{phase.name}] {step.name}: {status}", flush=True)
            continue
        started = time.monotonic()
        status = _run_step(step, command_line(step, results, values), directory / f"{step.name}.log", left)
        for kept in step.keeps:
            if (ROOT / kept).is_file():
                shutil.copy2(ROOT / kept, directory / Path(kept).name)
        record.add(step, status, time.monotonic() - started)
        print(f"gpu_check: [{phase.name}] {step.name}: {status} ({time.monotonic() - started:.0f} s)", flush=True)
    record.finish(phase)
    return record.data["complete"]


def _run_step(step: Step, command: list[str], log: Path, timeout_s: float) -> str:
    print(f"+ [{step.name}] {shlex.join(command)}", flush=True)
    env = {**os.environ, **dict(step.env), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return f"exit {process.wait(timeout=timeout_s)}"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return f"cut after {timeout_s:.0f} s (the phase's budget)"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", nargs="?", help=f"one of {', '.join(p.name for p in PHASES)}, or all")
    parser.add_argument("--plan", action="store_true", help="print the phases in order, with minutes and commands")
    parser.add_argument("--dry-run", action="store_true", help="print the phase's steps and files; run nothing")
    parser.add_argument("--force", action="store_true", help="run a phase already done for this commit")
    parser.add_argument("--corpus", help="the study phase's corpus (a JSONL file of documents, e.g. "
                        "english-wiki-books.jsonl.zst)")
    parser.add_argument("--task", help="the study phase's real GLUE task directory (e.g. SST-2/ with train.tsv and "
                        "dev.tsv)")
    parser.add_argument("--quick", action="store_true", help="the phase's steps at the CPU's scale (the study phase: "
                        "--budget quick, 1,000 pieces), into runs/gpu-check-quick/; never counts as done")
    parser.add_argument("--collect", metavar="DIR", type=Path,
                        help="copy what a lent machine brought back of $OUT into benchmarks/results/gpu/DEVICE/PHASE/")
    args = parser.parse_args(argv)
    if args.plan:
        print("\n".join(plan_lines()))
        return 0
    if args.collect:
        for directory in collect(args.collect, RESULTS):
            print(f"gpu_check: collected {_shown(directory)}; commit it with the commit it measured "
                  f"({json.loads((directory / 'phase.json').read_text())['commit']})")
        return 0
    if not args.phase:
        parser.error("name a phase (or --plan)")
    if args.phase == "all" and os.environ.get("OUT") and not args.dry_run:
        parser.error(f"one phase per call under $OUT: the device tool brings back {OUT_MAX_FILES} files, and `all` "
                     "would leave more")
    phases = PHASES if args.phase == "all" else (phase_named(args.phase),)
    given = {"corpus": args.corpus, "task": args.task}
    if args.dry_run:
        for phase in phases:
            shown = {**{name: name.upper() for name in phase.arguments}, **{k: v for k, v in given.items() if v}}
            print("\n".join(dry_run_lines(phase, RESULTS / "DEVICE", phase_values(phase, shown, args.quick))))
        return 0
    if args.phase == "all":  # a phase that needs arguments runs only when they are given
        phases = tuple(phase for phase in phases if all(given.get(name) for name in phase.arguments))
    if args.quick:  # the CPU's scale: into runs/, never the tree's GPU results
        results = ROOT / "runs" / "gpu-check-quick"
    else:
        results = RESULTS / device_directory()
    commit = current_commit()
    outcomes = [run_phase(phase, results, commit, args.force, phase_values(phase, given, args.quick), args.quick)
                for phase in phases]
    return 0 if all(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
