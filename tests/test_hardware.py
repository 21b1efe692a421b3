"""The training dtype that fits the hardware, the matmul peak, and the DeepSpeed config they lead to."""

import os
import subprocess
import sys

import pytest
import torch

from fastmae import hardware, malloc
from fastmae.config import load_run_config
from fastmae.errors import FastmaeError

CPU = torch.device("cpu")


def test_auto_precision_follows_the_hardware(monkeypatch):
    monkeypatch.delenv(hardware.CPU_BF16_ENV, raising=False)
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device: False)  # an AVX2-only CPU
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: 0.01)
    assert hardware.choose_precision("auto", CPU)[0] == "fp32"
    precision, note = hardware.choose_precision("bf16", CPU)  # kept as asked, with the measured slowdown
    assert precision == "bf16" and note.startswith("WARNING") and "0.01x the fp32 speed" in note
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device: True)
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: 3.0)
    assert hardware.choose_precision("auto", CPU)[0] == "bf16"
    assert hardware.choose_precision("bf16", CPU) == ("bf16", None)
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: 0.5)
    assert hardware.choose_precision("auto", CPU)[0] == "fp32"  # native on paper, slow in practice
    assert hardware.choose_precision("fp32", CPU) == ("fp32", None)


def test_the_cpu_bf16_answer_is_measured_once_or_pinned(monkeypatch):
    """One process decides alike every time it asks (a fine-tune and the test that checks it); FASTMAE_CPU_BF16 pins
    the answer so that the suite can run both ways on one machine, and a wrong value is named."""
    monkeypatch.delenv(hardware.CPU_BF16_ENV, raising=False)
    hardware.cpu_bf16_speedup.cache_clear()
    calls = []
    monkeypatch.setattr(hardware, "matmul_flops", lambda device, dtype, **kw: calls.append(dtype) or 2.0)
    assert hardware.cpu_bf16_speedup() == hardware.cpu_bf16_speedup() == 1.0 and len(calls) == 2
    for value, native, choice in (("native", True, "bf16"), ("emulated", False, "fp32")):
        monkeypatch.setenv(hardware.CPU_BF16_ENV, value)
        hardware.cpu_bf16_speedup.cache_clear()
        assert hardware.has_native_bf16(CPU) is native
        precision, note = hardware.choose_precision("auto", CPU)
        assert precision == choice and f"as {hardware.CPU_BF16_ENV}={value} says" in note
    assert len(calls) == 2  # pinned: nothing measured
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "yes")
    with pytest.raises(FastmaeError, match="FASTMAE_CPU_BF16='yes': must be 'native', 'emulated' or unset"):
        hardware.has_native_bf16(CPU)
    hardware.cpu_bf16_speedup.cache_clear()


def test_matmul_peak_is_measured_and_plausible():
    flops = hardware.matmul_flops(CPU, torch.float32, max_size=512, repeats=3)
    assert 1e8 < flops < 1e13
    assert hardware.spec_peak_flops(CPU, torch.bfloat16) is None


def test_mfu_never_reads_above_one_nor_one_by_construction():
    """A peak measured while the machine was busy is measured again when a rate beats it (kind `remeasured`); where
    the new measurement still falls short, no peak is known: the records carry no MFU (kind `achieved`, said once)
    until a re-measured GEMM beats the rate achieved."""
    remeasured, said = iter([3e9, 4e9, 5.5e9, 8e9]), []
    peak = hardware.PeakFlops(2e9, remeasure=lambda: next(remeasured), log=said.append)
    assert peak.mfu(1e9, "step 1") == 0.5 and (peak.flops, peak.kind) == (2e9, "measured") and not said
    assert peak.mfu(2.5e9, "step 2") == pytest.approx(2.5 / 3) and (peak.flops, peak.kind) == (3e9, "remeasured")
    assert said == ["step 2: 2.5 GFLOP/s achieved beat the matmul peak 2 GFLOP/s measured earlier; MFU now divides "
                    "by matmul peak 3 GFLOP/s (re-measured at step 2)"]
    assert peak.mfu(5e9, "step 3") is None and (peak.flops, peak.kind) == (5e9, "achieved")  # re-measured 4: short
    assert "a GEMM re-measured there gave only 4 GFLOP/s: no peak is known" in said[-1] and len(said) == 2
    assert peak.mfu(4e9, "step 4") is None  # below the rate achieved, but still no measured peak
    assert peak.mfu(6e9, "step 5") is None and peak.flops == 6e9 and len(said) == 2  # short again (5.5): said once
    assert peak.mfu(7e9, "step 6") == pytest.approx(7 / 8) and (peak.flops, peak.kind) == (8e9, "remeasured")
    assert len(said) == 3 and "re-measured at step 6" in said[-1]


def test_gradients_accumulate_in_fp32():
    from fastmae.engine import deepspeed_config

    config = load_run_config(None, ["train.zero_stage=2"])
    for precision in ("fp32", "bf16", "fp16"):
        ds = deepspeed_config(config, precision)
        assert ds["data_types"]["grad_accum_dtype"] == "fp32"
        assert ds["bf16"]["enabled"] == (precision == "bf16") and ds["fp16"]["enabled"] == (precision == "fp16")
    with pytest.raises(FastmaeError, match="train.zero_stage=0"):  # DeepSpeed would accumulate in bf16 there
        deepspeed_config(load_run_config(None, ["train.zero_stage=0"]), "bf16")


def test_no_cublas_workspace_is_set_in_the_environment_before_the_first_gemm(monkeypatch):
    """train.cublas_workspace=none puts cuBLAS's and cuBLASLt's no-workspace settings in the process's environment
    (read at its first GEMM on CUDA), `default` leaves a user's own; the log line only where there is CUDA; a value
    neither is refused naming the field."""
    for name in hardware.CUBLAS_NO_WORKSPACE:  # recorded first, so that the settings made here are undone after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert hardware.use_cublas_workspace("default", torch.device("cuda")).startswith("cuBLAS workspace: torch's")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "CUBLASLT_WORKSPACE_SIZE" not in os.environ
    assert hardware.use_cublas_workspace("none", CPU) is None
    assert {name: os.environ[name] for name in hardware.CUBLAS_NO_WORKSPACE} == {
        "CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
    assert "CUBLAS_WORKSPACE_CONFIG=:0:0" in hardware.use_cublas_workspace("none", torch.device("cuda"))
    with pytest.raises(FastmaeError, match="train.cublas_workspace='some'"):
        load_run_config(None, ["train.cublas_workspace=some"])


def test_malloc_tunables_are_added_once_and_keep_the_users():
    from fastmae.malloc import MALLOC_TUNABLES, malloc_env

    assert malloc_env({})["GLIBC_TUNABLES"] == MALLOC_TUNABLES
    assert malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"] == \
        f"glibc.malloc.arena_max=2:{MALLOC_TUNABLES}"
    own = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}
    assert malloc_env(own) == own


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables")
def test_entry_points_restart_with_the_malloc_tunables():
    """The process re-executes itself once with the tunables, keeping its PID and command line."""
    code = ("import os, sys; from fastmae.malloc import restart_with_malloc_tunables; "
            "print('start', os.getpid(), flush=True); restart_with_malloc_tunables(); "
            "print('env', os.getpid(), os.environ['GLIBC_TUNABLES'], sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code, "arg"], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.split("\n")
    starts = [line.split()[1] for line in lines if line.startswith("start")]
    pid, tunables, args = lines[-2].split(" ", 3)[1:]
    assert len(starts) == 2 and starts[0] == starts[1] == pid, out.stdout  # re-executed once, same process
    assert tunables == malloc.MALLOC_TUNABLES and args == "['arg']"
