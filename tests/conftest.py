"""Shared fixtures: tiny configs and batches that run in milliseconds on CPU.

Without a CUDA device the Triton kernels run under the interpreter: TRITON_INTERPRET must be set before any kernel
module is imported (the @triton.jit decorator reads it), so it is set here, before fastmae is imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest -n N (scripts/test.sh): the workers share the cores instead of each spinning threads on all of them; the
# setting reaches the training processes the tests start (ranks and single processes alike)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # inductor (train.compile's tests) compiles in the process that asks: its default pool of compile workers, each a
    # fresh Python importing torch, cost ~5 s of CPU a compiling process and saved no time on cores already shared
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# the tunables fastmae's entry points restart with (fastmae/malloc.py), set once here: the processes the suite
# starts skip that restart, and they match the warm server's (which must have them from its start)
from fastmae.malloc import malloc_env  # noqa: E402

os.environ.update(malloc_env(os.environ))

import triton_interpreter  # noqa: E402
import warm_python  # noqa: E402
from synthetic import markov_documents  # noqa: E402

from fastmae import MaskedLM, ModelConfig, PackedBatch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    triton_interpreter.install()

TINY = dict(vocab_size=97, hidden_size=48, num_heads=4, intermediate_size=80, encoder_layers=2, max_seq_len=128)
CUDA_HEADS = dict(num_heads=3)
"""For models of CUDA tests: head_dim 16, which the flash kernels take (multiples of 8); TINY's 4 heads of 12 would make
every bf16 case raise before it tests anything (tests/test_graphs.py checks the CUDA tests' models on CPU)."""


def tiny_config(preset: str = "mae-lm", **overrides) -> ModelConfig:
    """A small config of `preset`; dropout off so outputs are deterministic."""
    values = {**TINY, "dropout": 0.0, "attention_dropout": 0.0, **overrides}
    return ModelConfig.preset(preset, **values)


def tiny_model(preset: str = "mae-lm", seed: int = 0, **overrides) -> MaskedLM:
    torch.manual_seed(seed)
    return MaskedLM(tiny_config(preset, **overrides)).eval()


def tiny_batch(num_sequences: int = 5, seed: int = 0, min_len: int = 6, max_len: int = 40,
               vocab_size: int = TINY["vocab_size"]) -> PackedBatch:
    return PackedBatch.from_sequences(markov_documents(num_sequences, vocab_size, min_len, max_len, seed=seed))


@pytest.fixture
def batch() -> PackedBatch:
    return tiny_batch()


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def candidate_tilings(shipped: dict, candidates: dict) -> list:
    """(kernel, tiles) of every candidate tiling a GPU benchmark times (the row kernels' RowTiles); under the
    interpreter, which runs a tile the same whatever its warps, one of each number of rows and prefetch not shipped."""
    found = [(kernel, tiles) for kernel, tried in candidates.items() for tiles in tried if tiles != shipped[kernel]]
    if KERNEL_DEVICE == "cpu":
        found = list({(kernel, tiles.rows, tiles.prefetch): (kernel, tiles) for kernel, tiles in found
                      if (tiles.rows, tiles.prefetch) != (shipped[kernel].rows, shipped[kernel].prefetch)}.values())
    return found


@pytest.fixture
def triton_kernels(monkeypatch):
    """Route fastmae.ops to the Triton kernels (under the interpreter on CPU)."""
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty / empty_like fill float outputs with NaN and integer ones with -7, so unwritten rows fail loudly."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else (t.fill_(-7) if t.dtype != torch.bool else t)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


@pytest.fixture(scope="session", autouse=True)
def startup_peak():
    """The matmul peaks this machine's training runs measure at start-up, measured once here and given to every run
    of the session (FASTMAE_FAULT_STARTUP_PEAK_FLOPS, fastmae/faults.py): ~1 s of all cores a run otherwise. The
    MFU tests measure their own."""
    if torch.cuda.is_available():
        return
    from fastmae.hardware import all_cpu_cores, matmul_flops

    with all_cpu_cores():
        peaks = {name: matmul_flops(torch.device("cpu"), dtype) for name, dtype in
                 (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    os.environ["FASTMAE_FAULT_STARTUP_PEAK_FLOPS"] = ",".join(f"{name}:{flops!r}" for name, flops in peaks.items())


@pytest.fixture(scope="session", autouse=True)
def warm_server():
    """The warm Python server of this pytest process (tests/warm_python.py), named to the processes the suite starts
    through FASTMAE_WARM_PYTHON; none where a CUDA device is (a process forked from one that has asked about CUDA
    may not use it), and the suite's processes start cold. A server that does not start leaves them cold too, and
    tests/test_warm_python.py fails naming why. Its socket and log live in a short directory of their own (a Unix
    socket's path is limited to 107 bytes)."""
    if torch.cuda.is_available():
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="fastmae-warm-"))
    try:
        with (folder / "server.log").open("w") as log:
            server = warm_python.start_server(str(folder / "socket"), log)
    except RuntimeError as err:
        warm_python.start_failure = f"{err}:\n{(folder / 'server.log').read_text()[-3000:]}"
        shutil.rmtree(folder, ignore_errors=True)
        yield None
        return
    os.environ[warm_python.SOCKET_VARIABLE] = str(folder / "socket")
    yield server
    del os.environ[warm_python.SOCKET_VARIABLE]
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    shutil.rmtree(folder, ignore_errors=True)
