"""The GPU check in phases (scripts/gpu_phases.py: what each runs), each one command of at most 8 minutes on a lent
machine, its set-up included (the study's 9), in the order of what they decide; docs/gpu-check.md says how to run it.

    bash scripts/gpu_check.sh --plan               # one line per phase: name, minutes (timed or estimated), command
    bash scripts/gpu_check.sh PHASE [--force]      # run one phase (skipped when already done for this commit)
    bash scripts/gpu_check.sh smoke headline       # several in one call: each but the last comes back as PHASE.tar
    bash scripts/gpu_check.sh --dry-run PHASE      # the phase's steps, their commands and files; runs nothing
    bash scripts/gpu_check.sh --collect DIR        # what a lent machine brought back from $OUT, into the tree
    bash scripts/gpu_check.sh all                  # every phase not yet done, in order (not under $OUT)

A phase first installs what the machine lacks, offline (the wheels `scripts/gpu_wheels.sh` put in .whl/, then fastmae
with --no-deps), and names any module still missing. Its steps run in order, each within what is left of the phase's
minutes (a step past them is cut; a step that expects an earlier one's seconds again runs only when they are left;
the seconds of a closing step, one that packs what the others wrote, are kept back for it from those before).
Everything lands in benchmarks/results/gpu/DEVICE/PHASE/: each step's log, the files it wrote, and phase.json (the
commit measured: FASTMAE_COMMIT, else git; each step's exit status and seconds), rewritten after every step and
mirrored as $OUT/PHASE/ within what the device tool brings back (two folders down, 8 files, 16 MiB each, plain
names): phase.json, the files its steps keep (at most 6, flat) and logs.tar.gz (each step's log, its last 4 MiB).
Several phases in one call (a fresh machine's start is minutes of the lease) leave each but the last packed as
$OUT/PHASE.tar, one file, so that they come back together where the files fit. `--collect` rebuilds each phase's
directory from that. A fresh machine has only the tree that travels: a phase done for
the commit is skipped by the phase.json collected into the tree, and a step that reads another phase's results names
them in `needs` (not run, and says so, where they were not collected first). Standard library only: it runs before
anything is installed.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_out.py, gpu_phases.py beside it, however loaded
from gpu_out import OUT_MAX_BYTES, OUT_MAX_FILES, add_tail, collect, directory_name, pack_out  # noqa: E402
from gpu_phases import BEYOND_A_LEASE, CARRIED, IMAGE, PHASES, PY, Phase, Step  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(os.environ.get("FASTMAE_GPU_RESULTS", ROOT / "benchmarks" / "results" / "gpu"))
WHEELS = ROOT / ".whl"
PHASE_BUDGET_S = 8 * 60
RECORD_MARGIN_S = 10  # kept back from the last step, to write the phase's record
KEPT_PER_PHASE = OUT_MAX_FILES - 2  # beside phase.json and logs.tar.gz
LOG_TAIL_BYTES = 4 * 2**20  # of each step's log in logs.tar.gz: a phase's 3 logs stay under 16 MiB unpacked


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
            "# several phases in one call (a machine's start is minutes of the lease), those whose files come back "
            "together: bash scripts/gpu_check.sh smoke headline",
            *(f"# beyond a lease: {name}, {length}: {shlex.join(command)}" for name, length, command in BEYOND_A_LEASE)]


def out_files(phase: Phase) -> list[str]:
    """What `phase` leaves under $OUT, relative to it."""
    return [f"{phase.name}/phase.json", f"{phase.name}/logs.tar.gz",
            *(f"{phase.name}/{Path(kept).name}" for kept in _all_kept(phase))]


def _all_kept(phase: Phase) -> list[str]:
    return list(dict.fromkeys(kept for step in phase.steps for kept in step.keeps))


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
                    add_tail(archive, log, LOG_TAIL_BYTES)
        partial.replace(target / "logs.tar.gz")


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
    kept_back = sum(step.finally_s for step in phase.steps)  # for the steps that run however the others end
    for step in phase.steps:
        kept_back -= step.finally_s
        left = deadline - time.monotonic() - RECORD_MARGIN_S - kept_back
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


def call_problems(phases: tuple[Phase, ...]) -> list[str]:
    """Why these phases cannot run in one call under $OUT (empty: they can): each but the last comes back as one
    archive, the last as its own files, within the device tool's count."""
    files = len(phases) - 1 + len(out_files(phases[-1]))
    return [f"{' + '.join(p.name for p in phases)} leave {files} files under $OUT (at most {OUT_MAX_FILES} come "
            f"back): put the phase that keeps the most files last, or run fewer"] if files > OUT_MAX_FILES else []


def run_phases(phases: tuple[Phase, ...], results: Path, commit: str, force: bool, given: dict[str, str | None],
               quick: bool = False) -> bool:
    """Run `phases` in order (run_phase), packing each one's $OUT/PHASE/ but the last's (pack_out) where $OUT is set;
    True when every phase's steps all exited 0."""
    out = os.environ.get("OUT")
    outcomes = []
    for number, phase in enumerate(phases):
        outcomes.append(run_phase(phase, results, commit, force, phase_values(phase, given, quick), quick))
        if out and number < len(phases) - 1 and (Path(out) / phase.name).is_dir():
            pack_out(phase.name, Path(out))
    return all(outcomes)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("phase", nargs="*", help=f"one or more of {', '.join(p.name for p in PHASES)}, or all")
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
    everything = args.phase == ["all"]
    if "all" in args.phase and not everything:
        parser.error("`all` runs every phase: name it alone")
    if everything and os.environ.get("OUT") and not args.dry_run:
        parser.error(f"`all` is not for one call under $OUT: the device tool brings back {OUT_MAX_FILES} files; name "
                     "the phases that fit (`--plan`)")
    phases = PHASES if everything else tuple(phase_named(name) for name in args.phase)
    if os.environ.get("OUT") and not args.dry_run and call_problems(phases):
        parser.error(call_problems(phases)[0])
    given = {"corpus": args.corpus, "task": args.task}
    if args.dry_run:
        for number, phase in enumerate(phases):
            shown = {**{name: name.upper() for name in phase.arguments}, **{k: v for k, v in given.items() if v}}
            print("\n".join(dry_run_lines(phase, RESULTS / "DEVICE", phase_values(phase, shown, args.quick))))
            if not everything and number < len(phases) - 1:
                print(f"  then, under $OUT: {phase.name}/ packed as {phase.name}.tar (the next phase's files fit)")
        return 0
    if everything:  # a phase that needs arguments runs only when they are given
        phases = tuple(phase for phase in phases if all(given.get(name) for name in phase.arguments))
    if args.quick:  # the CPU's scale: into runs/, never the tree's GPU results
        results = ROOT / "runs" / "gpu-check-quick"
    else:
        results = RESULTS / device_directory()
    return 0 if run_phases(phases, results, current_commit(), args.force, given, args.quick) else 1


if __name__ == "__main__":
    sys.exit(main())
