"""Test-only hooks, read from the environment once: the trainer builds `FaultHooks.from_environment` and is the only
production code that names this module.

- FASTMAE_FAULT_AT_STEP=N: the process dies hard (exit 17, no cleanup) right after optimizer step N and its
  checkpoint when one is due, as a killed node would.
- FASTMAE_SYNC_DEBUG=1 (CUDA): `torch.cuda.set_sync_debug_mode("error")` around every steady-state step, so any
  host-device synchronisation raises.
- FASTMAE_FAULT_ENOSPC=RANK:STEP: that rank's disk fills up while it writes its own part of step STEP's checkpoint
  (half of its first file, DeepSpeed's optimizer shard, lands, then ENOSPC; every later write fails alike), as a
  node's local disk would; the other ranks' writes succeed.
- FASTMAE_FAULT_NAN=RANK:FIRST-LAST: that rank's losses are NaN in optimizer steps FIRST to LAST (its gradients
  too), as a bad batch or an overflow on one rank would make them; the ranks must skip those steps alike.
- FASTMAE_FAULT_HOLD=STEP:FILE: every rank waits after optimizer step STEP (and its checkpoint) until FILE exists,
  while the data loader's thread has read ahead as far as it may: a test changes the world (a shard vanishes)
  at a known point of the run, not at a moment it has to guess.
- FASTMAE_FAULT_STARTUP_PEAK=F: the matmul peak measured at start-up reads F times what it measured (F < 1: as on
  a machine far busier than a test can make it reliably), so the first logged window beats it.
- FASTMAE_FAULT_STARTUP_PEAK_FLOPS=PRECISION:FLOPS[,PRECISION:FLOPS]: the start-up matmul peak of a run in that
  training precision (fp32, bf16, fp16) is FLOPS, unmeasured (FASTMAE_FAULT_STARTUP_PEAK still scales it): the
  suite measures once a session what each of its runs would measure, ~1 s of all cores a run on a 2-core CPU. A
  window that beats it re-measures as ever; empty: measured.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from . import atomic


@dataclass(frozen=True)
class FaultHooks:
    exit_after_step: int = 0  # 0: never
    sync_debug: bool = False
    startup_peak_factor: float = 1.0
    full_disk_at: tuple[int, int, int] | None = None  # (rank, step, step)
    nan_at: tuple[int, int, int] | None = None  # (rank, first step, last step)
    hold_at: tuple[int, Path] | None = None  # (step, the file that releases it)
    startup_peak_flops: tuple[tuple[str, float], ...] = ()  # (precision, FLOP/s) pairs

    @classmethod
    def from_environment(cls, device: torch.device) -> FaultHooks:
        return cls(exit_after_step=int(os.environ.get("FASTMAE_FAULT_AT_STEP", "0")),
                   sync_debug=device.type == "cuda" and os.environ.get("FASTMAE_SYNC_DEBUG") == "1",
                   startup_peak_factor=float(os.environ.get("FASTMAE_FAULT_STARTUP_PEAK", "1")),
                   full_disk_at=_rank_and_steps(os.environ.get("FASTMAE_FAULT_ENOSPC")),
                   nan_at=_rank_and_steps(os.environ.get("FASTMAE_FAULT_NAN")),
                   hold_at=_step_and_file(os.environ.get("FASTMAE_FAULT_HOLD")),
                   startup_peak_flops=_precision_and_flops(os.environ.get("FASTMAE_FAULT_STARTUP_PEAK_FLOPS")))

    def poison_losses(self, model: torch.nn.Module, rank: int, step) -> None:
        """Where FASTMAE_FAULT_NAN names this rank: its model's training loss is NaN while `step()` (the optimizer
        step being run, from 1) is in the named range."""
        if self.nan_at is None or self.nan_at[0] != rank:
            return
        first, last = self.nan_at[1:]

        def poison(module, args, out):
            return out._replace(loss=out.loss * float("nan")) if first <= step() <= last and module.training else out

        model.register_forward_hook(poison)

    def startup_peak(self, measured: float) -> float:
        """The matmul peak measured at start-up, as FASTMAE_FAULT_STARTUP_PEAK has it read."""
        return measured * self.startup_peak_factor

    def pinned_peak(self, precision: str) -> float | None:
        """The start-up peak FASTMAE_FAULT_STARTUP_PEAK_FLOPS gives for `precision`; None: measure it."""
        return dict(self.startup_peak_flops).get(precision)

    def forbid_syncs(self, on: bool) -> None:
        """While `on`, a host-device synchronisation raises (FASTMAE_SYNC_DEBUG=1 on CUDA only)."""
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    @contextlib.contextmanager
    def disk(self, rank: int, step: int):
        """Around the save of step `step`: where FASTMAE_FAULT_ENOSPC names this rank and step, every file the rank
        writes (its DeepSpeed shards first, through `engine.AtomicCheckpointEngine`, then fastmae's own) fills the
        disk half-way through its first write (`atomic.open_for_write` replaced)."""
        if self.full_disk_at != (rank, step, step):
            yield
            return
        with mock.patch.object(atomic, "open_for_write", lambda path: _FillsUp(path.open("wb"), path)):
            yield

    def after_step(self, step: int) -> None:
        """Die hard after step FASTMAE_FAULT_AT_STEP; wait after step FASTMAE_FAULT_HOLD for its file (5 minutes
        at most)."""
        if self.exit_after_step and step == self.exit_after_step:
            os._exit(17)
        if self.hold_at is not None and step == self.hold_at[0]:
            deadline = time.monotonic() + 300
            while not self.hold_at[1].exists() and time.monotonic() < deadline:
                time.sleep(0.05)


class _FillsUp:
    """A file on a disk that fills up: the first write lands half its bytes, then it and every later one raises
    ENOSPC (what DeepSpeed's torch.save and fastmae's writes meet alike)."""

    def __init__(self, handle, path: Path):
        self.handle, self.path = handle, path

    def write(self, data) -> int:
        if not self.handle.closed and self.handle.tell() == 0:
            self.handle.write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def _rank_and_steps(value: str | None) -> tuple[int, int, int] | None:
    """`RANK:STEP` or `RANK:FIRST-LAST` as (rank, first, last)."""
    if not value:
        return None
    rank, steps = value.split(":")
    first, _, last = steps.partition("-")
    return int(rank), int(first), int(last or first)


def _precision_and_flops(value: str | None) -> tuple[tuple[str, float], ...]:
    """`PRECISION:FLOPS[,PRECISION:FLOPS]` as ((precision, flops), ...)."""
    if not value:
        return ()
    pairs = [pair.split(":") for pair in value.split(",")]
    return tuple((precision, float(flops)) for precision, flops in pairs)


def _step_and_file(value: str | None) -> tuple[int, Path] | None:
    """`STEP:FILE` as (step, path)."""
    if not value:
        return None
    step, path = value.split(":", 1)
    return int(step), Path(path)
