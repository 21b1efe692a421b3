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
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device: False)  # an AVX2-only CPU
    assert hardware.choose_precision("auto", CPU)[0] == "fp32"
    precision, note = hardware.choose_precision("bf16", CPU)  # kept as asked, with the measured slowdown
    assert precision == "bf16" and note.startswith("WARNING") and "x the fp32 speed" in note
    monkeypatch.setattr(hardware, "has_native_bf16", lambda device: True)
    fast_bf16 = lambda device, dtype, **kw: 3.0 if dtype == torch.bfloat16 else 1.0  # noqa: E731
    monkeypatch.setattr(hardware, "matmul_flops", fast_bf16)
    assert hardware.choose_precision("auto", CPU)[0] == "bf16"
    slow_bf16 = lambda device, dtype, **kw: 0.01 if dtype == torch.bfloat16 else 1.0  # noqa: E731
    monkeypatch.setattr(hardware, "matmul_flops", slow_bf16)
    assert hardware.choose_precision("auto", CPU)[0] == "fp32"  # native on paper, slow in practice
    assert hardware.choose_precision("fp32", CPU) == ("fp32", None)


def test_matmul_peak_is_measured_and_plausible():
    flops = hardware.matmul_flops(CPU, torch.float32, max_size=512, repeats=3)
    assert 1e8 < flops < 1e13
    assert hardware.spec_peak_flops(CPU, torch.bfloat16) is None


def test_gradients_accumulate_in_fp32():
    from fastmae.engine import deepspeed_config

    config = load_run_config(None, ["train.zero_stage=2"])
    for precision in ("fp32", "bf16", "fp16"):
        ds = deepspeed_config(config, precision)
        assert ds["data_types"]["grad_accum_dtype"] == "fp32"
        assert ds["bf16"]["enabled"] == (precision == "bf16") and ds["fp16"]["enabled"] == (precision == "fp16")
    with pytest.raises(FastmaeError, match="train.zero_stage=0"):  # DeepSpeed would accumulate in bf16 there
        deepspeed_config(load_run_config(None, ["train.zero_stage=0"]), "bf16")


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
