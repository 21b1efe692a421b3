"""The training dtype that fits the hardware, the matmul peak, and the DeepSpeed config they lead to."""

import pytest
import torch

from fastmae import hardware
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
    from fastmae.trainer import deepspeed_config

    config = load_run_config(None, ["train.zero_stage=2"])
    for precision in ("fp32", "bf16", "fp16"):
        ds = deepspeed_config(config, precision)
        assert ds["data_types"]["grad_accum_dtype"] == "fp32"
        assert ds["bf16"]["enabled"] == (precision == "bf16") and ds["fp16"]["enabled"] == (precision == "fp16")
    with pytest.raises(FastmaeError, match="train.zero_stage=0"):  # DeepSpeed would accumulate in bf16 there
        deepspeed_config(load_run_config(None, ["train.zero_stage=0"]), "bf16")
