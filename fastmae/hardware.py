"""What the device can do: the training dtype that fits it, and the matmul peak that MFU is measured against.

ARCHITECTURE.md section 5: bf16 only where the hardware multiplies it natively (CUDA sm_80+, CPUs with AMX or
AVX512-BF16; on an AVX2-only CPU a bf16 matmul ran at 0.29 GFLOP/s against 160 in fp32), and MFU = model FLOPs /
(time x peak), the peak measured with a compute-bound GEMM in the training dtype (the best of several), measured again
where a rate the run achieved beats it, and no MFU at all while no GEMM has reached what the run did (`PeakFlops`):
MFU cannot read above 1, nor read 1 by construction.

`FASTMAE_CPU_BF16=native|emulated` pins what a CPU's bf16 check answers (the suite runs both ways on one machine).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import FastmaeError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Dense bf16/fp16 tensor-core peaks from the vendors' data sheets (FLOP/s), matched against the device name.
SPEC_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def all_cpu_cores():
    """Let torch use every core of this process for the duration (a measurement while the node's other ranks wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_cores())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


GEMMS = (torch.matmul, torch.nn.functional.linear)
"""The two ways a model multiplies matrices (attention's products, nn.Linear); F.linear(a, b) = a @ b.T."""


def matmul_flops(device: torch.device, dtype: torch.dtype, max_size: int | None = None, repeats: int = 5) -> float:
    """Best FLOP/s of `repeats` square matmuls on `device` in `dtype` (another process busy for a moment only ever
    slows one down), through the faster of the two GEMM entry points a model uses (`a @ b` and `F.linear`, picked at
    the first size).

    Both, because they reach different kernels: on an AVX2-only CPU (bf16 emulated) `F.linear` in bf16 ran 8-12x
    faster than `a @ b` (10-16 against 1.3 GFLOP/s at 256-512), so a peak from `a @ b` alone let a bf16 model's
    MFU reach 4.8. The size doubles from 256 until one product takes 20 ms (or reaches max_size: 2048 on CPU, 8192
    on CUDA), so the GEMM is compute-bound without taking minutes where `dtype` is emulated. CUDA times with events.
    """
    max_size = max_size or (8192 if device.type == "cuda" else 2048)
    generator = torch.Generator(device=device).manual_seed(0)  # leaves the global RNG (dropout) untouched
    size, product = 256, None
    while True:
        a = torch.randn(size, size, device=device, generator=generator).to(dtype)
        b = torch.randn(size, size, device=device, generator=generator).to(dtype)
        if product is None:  # warm both up (kernel selection, page faults), keep the faster
            for candidate in GEMMS:
                candidate(a, b)
            product = min(GEMMS, key=lambda candidate: _time_product(candidate, a, b))
        product(a, b)  # warm-up at this size
        times = [_time_product(product, a, b) for _ in range(repeats if size >= max_size else 1)]
        if size >= max_size or times[0] >= 0.02:
            if len(times) < repeats:
                times += [_time_product(product, a, b) for _ in range(repeats - 1)]
            return 2 * size**3 / min(times)
        size *= 2


def format_flops(flops_per_s: float) -> str:
    """A FLOP/s figure in words: GFLOP/s below a TFLOP/s, TFLOP/s above."""
    if flops_per_s < 1e12:
        return f"{flops_per_s / 1e9:.3g} GFLOP/s"
    return f"{flops_per_s / 1e12:.4g} TFLOP/s"


class PeakFlops:
    """The FLOP/s that MFU divides by, and where it came from (`kind`): MFU never reads above 1, nor 1 by construction.

    `measured` is the peak measured at start-up (the best of several GEMMs, `matmul_flops`): kind `measured`;
    `remeasure()` measures it again. A measurement taken while another process is busy reads low (on 2 cores with the
    other one busy, 1.9 GFLOP/s in fp32 against ~100 idle), and MFU against it read 1.16-1.39. So when a rate achieved
    in training beats the peak, the peak is measured again (kind `remeasured`). Where that still falls short, no GEMM
    has shown what the hardware can do: the achieved rate becomes `flops` (kind `achieved`, logged once) and `mfu`
    answers None until a later re-measurement beats it, since MFU against a rate the run itself reached would read
    exactly 1.0 for that window and measure later ones against the run, not the hardware.
    `remeasure` may be collective: call `mfu` with the same achieved rate on every rank. `log` gets a line each time
    a re-measured peak is taken, and once when the achieved rate first stands in.
    """

    def __init__(self, measured: float, remeasure: Callable[[], float], log: Callable[[str], None],
                 origin: str | None = None):
        self.remeasure, self.log = remeasure, log
        self.flops, self.kind = measured, "measured"
        origin = origin or "measured at start-up, the best of several GEMMs"
        self.source = f"matmul peak {format_flops(self.flops)} ({origin})"

    def mfu(self, achieved: float, where: str) -> float | None:
        """achieved / peak for `achieved` FLOP/s, the peak measured again first where `achieved` beat it (`where`,
        e.g. "step 40", goes into the log line); None while the peak is a rate achieved (kind `achieved`)."""
        if achieved > self.flops:
            self._raise(achieved, where)
        return None if self.kind == "achieved" else achieved / self.flops

    def _raise(self, achieved: float, where: str) -> None:
        old, remeasured = self.flops, self.remeasure()
        if remeasured >= achieved:
            self.flops, self.kind = remeasured, "remeasured"
            self.source = f"matmul peak {format_flops(self.flops)} (re-measured at {where})"
            self.log(f"{where}: {format_flops(achieved)} achieved beat the matmul peak {format_flops(old)} measured "
                     f"earlier; MFU now divides by {self.source}")
            return
        if self.kind != "achieved":
            self.log(f"{where}: {format_flops(achieved)} achieved beat the matmul peak {format_flops(old)} measured "
                     f"earlier, and a GEMM re-measured there gave only {format_flops(remeasured)}: no peak is known "
                     "to divide by, so records carry no MFU (peak_source: achieved) until a re-measured GEMM beats "
                     "the rate achieved")
        self.flops, self.kind = max(old, remeasured, achieved), "achieved"
        self.source = f"{format_flops(self.flops)}, the rate achieved at {where} (no GEMM reached it: no MFU)"


def _time_product(product, a: torch.Tensor, b: torch.Tensor) -> float:
    """Seconds of one product(a, b)."""
    if a.is_cuda:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        product(a, b)
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1000
    begin = time.perf_counter()
    product(a, b)
    return time.perf_counter() - begin


CUBLAS_NO_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
"""The environment of `train.cublas_workspace=none`: cuBLAS and cuBLASLt without a workspace, read once, at the
process's first GEMM on CUDA."""


def use_cublas_workspace(setting: str, device: torch.device) -> str | None:
    """Apply train.cublas_workspace before the process's first GEMM: `none` sets CUBLAS_NO_WORKSPACE in this process's
    environment (every GEMM one kernel: no memset before it, no split-K reduction after; what it costs, docs/
    benchmarks.md), `default` leaves torch's. Returns the log line on CUDA, else None."""
    if setting == "none":
        os.environ.update(CUBLAS_NO_WORKSPACE)
    if device.type != "cuda":
        return None
    if setting == "none":
        return "cuBLAS workspace: none (" + ", ".join(f"{k}={v}" for k, v in CUBLAS_NO_WORKSPACE.items()) + ")"
    return "cuBLAS workspace: torch's default (train.cublas_workspace=none: one kernel a GEMM)"


def device_name(device: torch.device) -> str:
    """What the device is, in words: the GPU's name, or the CPU's model and vector capability."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return f"CPU {model} ({torch.backends.cpu.get_cpu_capability()})"


def spec_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The data-sheet dense peak of a known GPU in bf16/fp16, else None."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in SPEC_PEAK_FLOPS if key in name), None)


CPU_BF16_ENV = "FASTMAE_CPU_BF16"
"""`native` or `emulated`: what the CPU's bf16 check answers, measured or not (unset: the CPU's own answer)."""


def cpu_bf16_override() -> str | None:
    """FASTMAE_CPU_BF16's value (`native` / `emulated`), None when unset; anything else is a FastmaeError."""
    value = os.environ.get(CPU_BF16_ENV, "")
    if value not in ("", "native", "emulated"):
        raise FastmaeError(f"{CPU_BF16_ENV}={value!r}: must be 'native', 'emulated' or unset")
    return value or None


def has_native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 in hardware: CUDA compute capability 8.0+, or a CPU with AMX or AVX512-BF16
    (or as FASTMAE_CPU_BF16 says)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    if device.type == "cpu":
        override = cpu_bf16_override()
        if override is not None:
            return override == "native"
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return False


@functools.cache
def cpu_bf16_speedup() -> float:
    """A bf16 matmul's speed over fp32's on this CPU, measured once per process (so every caller in a process decides
    alike); FASTMAE_CPU_BF16 pins it: 1.0 for `native`, 0.0 for `emulated`."""
    override = cpu_bf16_override()
    if override is not None:
        return 1.0 if override == "native" else 0.0
    cpu = torch.device("cpu")
    return matmul_flops(cpu, torch.bfloat16, max_size=1024) / matmul_flops(cpu, torch.float32, max_size=1024)


def choose_precision(requested: str, device: torch.device) -> tuple[str, str | None]:
    """(precision to train in, a line to log once or None) for `requested` in auto / fp32 / bf16 / fp16.

    `auto` is bf16 where the capability check passes and, on CPU, a short measured GEMM confirms bf16 is at least as
    fast as fp32; fp32 elsewhere. An explicit bf16 on a CPU without native bf16 is kept, with a warning that gives the
    measured slowdown.
    """
    if requested in ("fp32", "fp16") or (requested == "bf16" and device.type != "cpu"):
        return requested, None
    native = has_native_bf16(device)
    if device.type == "cuda":  # auto on CUDA: the capability is the whole story
        return ("bf16" if native else "fp32"), f"precision auto: {'bf16' if native else 'fp32'} " \
            f"(compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
    if device.type != "cpu":
        return "fp32", f"precision auto: fp32 (no bf16 check for device {device.type})"
    ratio, capability, override = cpu_bf16_speedup(), torch.backends.cpu.get_cpu_capability(), cpu_bf16_override()
    measured = (f"as {CPU_BF16_ENV}={override} says" if override
                else f"a bf16 matmul measured {ratio:.3g}x the fp32 speed")
    if requested == "bf16":
        if native and ratio >= 1.0:
            return "bf16", None
        return "bf16", (f"WARNING: train.precision=bf16 on a CPU without native bf16 ({capability}; {measured} here): "
                        "train.precision=auto (fp32 here) is faster")
    choice = "bf16" if native and ratio >= 1.0 else "fp32"
    return choice, f"precision auto: {choice} (CPU {capability}, native bf16 {'yes' if native else 'no'}; {measured})"
