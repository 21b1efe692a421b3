"""scripts/gpu_check.sh on a machine without a GPU: the plan, each phase's commands and the files it would write, and
that every step's files, selections and training overrides are valid (so the first lent GPU does not fail on a typo);
the phase runner itself (records after every step, copies under $OUT, a step cut by the phase's budget, a phase done
for a commit skipped) on stand-in steps."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fastmae.config import load_run_config
from fastmae.train import build_parser

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def script(*args, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=env)


def test_the_plan_puts_what_decides_first_and_every_phase_fits_a_command():
    done = script("--plan")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    names = [line.split()[0] for line in lines]
    assert names[:2] == ["smoke", "headline"] and len(names) == len(set(names)) >= 5
    for line, name in zip(lines, names):
        minutes, unit, *command = line.split("   #")[0].split()[1:]
        assert unit == "min" and 1 <= int(minutes) <= 8 and command == ["bash", "scripts/gpu_check.sh", name]


def dry_run(phase: str) -> tuple[dict, list[str]]:
    done = script("--dry-run", phase)
    assert done.returncode == 0, done.stderr
    steps = {line.split("]", 1)[0][3:]: shlex.split(line.split("] ", 1)[1])
             for line in done.stdout.splitlines() if line.startswith("+ [")}
    writes = [path for line in done.stdout.splitlines() if line.startswith("  writes: ") for path in line.split()[1:]]
    return steps, writes


def test_every_phase_names_real_files_and_valid_runs():
    seen = []
    for phase in gpu_check.PHASES:
        steps, writes = dry_run(phase.name)
        assert list(steps) == [step.name for step in phase.steps]
        seen += list(steps)
        for name, command in steps.items():
            while re.fullmatch(r"[A-Z_]+=\S*", command[0]):  # the step's environment
                command = command[1:]
            assert Path(command[0]).name.startswith("python")
            if command[1:3] == ["-m", "pytest"]:
                assert any((ROOT / part).exists() for part in command if part.startswith("tests")), name
            elif command[1:3] == ["-m", "fastmae.train"]:
                args = build_parser().parse_args(command[3:])
                config = load_run_config(str(ROOT / args.config), args.overrides)
                model = config.model
                assert (model.objective, model.hidden_size, model.encoder_layers) == ("3ml", 768, 12), name
                # the sync step: one micro-batch a step; the 50-step run: two, accumulated (replayed both)
                assert config.for_world(1).train.grad_accum == {"sync_step_3ml_base": 1, "train_3ml_base": 2}[name]
                assert args.resume == "none" and config.data.tokens_per_micro_batch == 65536
            else:
                assert (ROOT / command[1]).is_file(), name
        # each step's log, the files it keeps, and the phase's record, all under the device's directory
        assert all(path.startswith(f"benchmarks/results/gpu/DEVICE/{phase.name}/") for path in writes)
        assert f"benchmarks/results/gpu/DEVICE/{phase.name}/phase.json" in writes
    assert {"graph_tests", "sync_tests", "sync_step_3ml_base", "throughput_headline", "kernel_tests",
            "kernel_tests_large", "attention_tests", "train_3ml_base"} <= set(seen)
    smoke, _ = dry_run("smoke")
    assert smoke["graph_tests"][-2:] == ["-k", "captured"] and smoke["sync_tests"][-2:] == ["-k", "steady_state"]
    assert smoke["sync_step_3ml_base"][0] == "FASTMAE_SYNC_DEBUG=1"  # one replayed base step under sync debug
    headline, _ = dry_run("headline")
    throughput = headline["throughput_headline"]
    assert throughput[throughput.index("--systems") + 1] == "hf-roberta,mlm,3ml" and "--eager" in throughput
    assert "--compile" not in throughput  # compiled rows take minutes each: not in a headline phase
    assert int(throughput[throughput.index("--sequences") + 1]) * 512 == load_run_config(
        str(ROOT / "configs/3ml-base.yaml"), ["model.vocab_size=32000"]).data.tokens_per_micro_batch
    assert not (ROOT / "benchmarks" / "results" / "gpu" / "DEVICE").exists()  # a dry run writes nothing


def test_unknown_arguments_are_refused():
    assert script("--bogus").returncode == 2
    done = script("smok")
    assert done.returncode == 1 and "unknown phase 'smok'" in done.stderr


def test_a_phase_records_every_step_mirrors_it_and_is_skipped_once_done(tmp_path, monkeypatch, capsys):
    results, out = tmp_path / "gpu" / "TEST", tmp_path / "out"
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "gpu")
    monkeypatch.setattr(gpu_check, "set_up", lambda: {"device": "stand-in"})
    monkeypatch.setattr(gpu_check, "PHASE_BUDGET_S", 8)
    monkeypatch.setattr(gpu_check, "RECORD_MARGIN_S", 1)
    monkeypatch.setenv("OUT", str(out))
    quick = gpu_check.Step("quick", (gpu_check.PY, "-c", "print('measured')"))
    slow = gpu_check.Step("slow", (gpu_check.PY, "-c", "import time; time.sleep(30)"))
    cut = gpu_check.Phase("cut", 1, "stand-in", (quick, slow, quick))
    assert not gpu_check.run_phase(cut, results, "abc", force=False)
    record = json.loads((results / "cut" / "phase.json").read_text())
    assert record["commit"] == "abc" and record["machine"] == {"device": "stand-in"} and not record["complete"]
    statuses = [step["status"] for step in record["steps"]]
    assert statuses[0] == "exit 0" and statuses[1].startswith("cut after") and statuses[2].startswith("not run")
    assert (results / "cut" / "quick.log").read_text() == "measured\n"
    mirrored = out / "benchmarks" / "results" / "gpu" / "TEST" / "cut"
    assert json.loads((mirrored / "phase.json").read_text()) == record and (mirrored / "quick.log").is_file()

    whole = gpu_check.Phase("whole", 1, "stand-in", (quick,))
    assert gpu_check.run_phase(whole, results, "abc", force=False)
    assert json.loads((results / "whole" / "phase.json").read_text())["complete"]
    capsys.readouterr()
    assert gpu_check.run_phase(whole, results, "abc", force=False)  # done for this commit: skipped
    assert "whole is done for commit abc" in capsys.readouterr().out
    assert not gpu_check.done_for(results / "cut", "abc") and not gpu_check.done_for(results / "whole", "def")


@pytest.mark.parametrize("phase", ["smoke"])
def test_a_phase_done_for_the_commit_is_skipped_from_the_command_line(tmp_path, phase):
    directory = tmp_path / "TEST" / phase
    directory.mkdir(parents=True)
    (directory / "phase.json").write_text(json.dumps({"commit": "abc", "complete": True}))
    done = script(phase, env_extra={"FASTMAE_GPU_RESULTS": str(tmp_path), "FASTMAE_GPU_DEVICE": "TEST",
                                    "FASTMAE_COMMIT": "abc"})
    assert done.returncode == 0 and f"{phase} is done for commit abc" in done.stdout, done.stderr


def test_a_graph_row_whose_profile_missed_the_replayed_kernels_reports_no_gpu_busy(monkeypatch):
    """benchmarks/throughput.py on CUDA: where a replayed row's profile saw under half the kernels of the same
    system's eager row (the graph launches, not their kernels), its gpu_busy is left out, not reported low."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import throughput

    def row(system, kernels, graphs="4 replayed"):
        return {"size": "base", "system": system, "gpu_kernels_per_step": kernels, "gpu_busy": 0.5,
                "cuda_graphs": graphs}

    rows = [row("hf-roberta", 900, "no"), row("3ml", 40), row("3ml [eager]", 2000, "no"), row("mlm", 1900),
            row("mlm [eager]", 2100, "no"), row("mae-lm", 30)]
    assert throughput.graph_rows_without_kernels(rows) == ["3ml"]
    assert [r["gpu_busy"] for r in rows] == [0.5, None, 0.5, 0.5, 0.5, 0.5]  # mae-lm: no eager row to tell by
