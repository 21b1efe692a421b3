"""Process and distributed concerns of a training run: the world's start, the launcher watch, stop signals, rank 0's
log lines, and the agreements between ranks (the checkpoint to resume, the precision, the MFU peak, stop requests,
the non-finite flag). One place: the model and the step know nothing of processes.

Stop requests (SIGTERM/SIGINT, or a launcher that died) and the non-finite flag are agreed every step without the
host waiting for the GPU: stop requests over the CPU (gloo), the flag on the device.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import deepspeed
import psutil
import torch
import torch.distributed as dist
from tqdm import tqdm

from . import checkpoint
from .config import PRECISIONS
from .data.order import StepSizes
from .errors import FastmaeError
from .hardware import DTYPES, PeakFlops, all_cpu_cores, choose_precision, format_flops, matmul_flops, spec_peak_flops


def set_world_of_one_env() -> None:
    """Unless a launcher set RANK, make this process a distributed world of one on a free loopback port (for plain
    `python -m fastmae.train` and the benchmarks)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def init_distributed(timeout_s: float = 1800.0) -> None:
    """deepspeed.init_distributed, without DeepSpeed's shared-memory op on CPU ranks. That op serves only its
    inference all-reduce, yet DeepSpeed compiles it with the C++ compiler in every new environment (~40 s on 2 cores,
    before the first step of the first run) and maps a 69 MB /dev/shm file per rank that it never removes. Marked
    incompatible, it is neither built nor loaded; training's collectives are gloo's either way."""
    if deepspeed.get_accelerator().device_name() == "cpu":
        from deepspeed import ops
        from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

        ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s), verbose=False)


def rank_device() -> torch.device:
    """This rank's device: its local GPU, or the CPU."""
    return torch.device(deepspeed.get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))


def local_rank() -> int:
    """This rank's index on its node (LOCAL_RANK, set by the launcher)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def ranks_on_node() -> int:
    """How many ranks share this node (LOCAL_SIZE, set by DeepSpeed's launcher; 1 otherwise)."""
    return int(os.environ.get("LOCAL_SIZE", 1))


def launch_processes() -> list[psutil.Process]:
    """This process's ancestors that belong to its DeepSpeed launch (the `deepspeed` command and
    `deepspeed.launcher.launch`), nearest first; none for a plain `python -m fastmae.train`."""
    chain, process = [], psutil.Process().parent()
    while process is not None and process.pid > 1:
        try:
            if "deepspeed" not in " ".join(process.cmdline()):
                break
        except psutil.Error:
            break
        chain.append(process)
        process = process.parent()
    return chain


def agree_on_flag(flag: torch.Tensor) -> None:
    """Set the device scalar `flag` to its maximum over ranks, on the device (the host does not wait)."""
    if dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)


class StopAgreement:
    """Whether the run should stop after this step: a SIGTERM/SIGINT on any rank, or a rank's launcher gone (SIGTERM
    to the `deepspeed` command kills it alone, and its ranks would otherwise train on unattended). Agreed once per
    step by one all-reduce on the CPU, so every rank stops after the same step."""

    LAUNCHER_GONE = 2.0  # a rank that saw its launcher gone contributes this + its rank to the agreement (a signal 1)

    def __init__(self, device: torch.device, log: Callable[[str], None]):
        self.requested = False
        self.log = log
        self.launchers = launch_processes()
        self.world = dist.get_world_size()
        # on CUDA the agreement goes over gloo so that the host never waits for the GPU stream
        self.host_group = dist.new_group(backend="gloo") if device.type == "cuda" and self.world > 1 else None

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT request a stop (a checkpoint, then a clean exit) instead of killing the rank."""
        def request_stop(signum, frame):
            self.requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def _launcher_gone(self) -> bool:
        for process in self.launchers:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            self.log(f"the launcher (pid {process.pid}) is gone: saving a checkpoint and exiting")
            self.launchers = []
            return True
        return False

    def agreed(self) -> bool:
        """Collective: whether any rank has been asked to stop (a signal, or its launcher gone). The rank that sees a
        launcher gone says so; when another rank saw it, this one says that."""
        launcher_gone = not self.requested and self._launcher_gone()
        self.requested = self.requested or launcher_gone
        if self.world == 1:
            return self.requested
        rank = dist.get_rank()
        tensor = torch.tensor([self.LAUNCHER_GONE + rank if launcher_gone else float(self.requested)])
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group)
        agreed = float(tensor.item())
        if agreed >= self.LAUNCHER_GONE and not launcher_gone:
            self.log(f"the launcher of rank {int(agreed - self.LAUNCHER_GONE)} is gone: saving a checkpoint and "
                     "exiting")
        return agreed > 0


def log_line(text: str) -> None:
    """A line on rank 0's stderr that leaves the progress bar intact."""
    if dist.get_rank() == 0:
        tqdm.write(f"fastmae: {text}", file=sys.stderr)


class PlainProgress:
    """The training progress where stderr is not a terminal (a log file, a batch job): a plain line each time the run
    has gone another tenth of the way, from the train records, instead of a bar redrawn with carriage returns (which a
    log file keeps as one long line). The same calls as tqdm's bar; the time left is `time_left`'s."""

    def __init__(self, total: int, initial: int, work: Callable[[int], int]):
        self.total, self.n, self.start, self.initial = total, initial, time.perf_counter(), initial
        self.next_line = initial + max(1, total // 10)
        self.work = work

    def update(self, steps: int) -> None:
        self.n += steps

    def set_postfix(self, loss: str, tok_s: str) -> None:
        """At a train record: the line, when the run has crossed its next tenth."""
        if self.n < self.next_line and self.n < self.total:
            return
        elapsed = time.perf_counter() - self.start
        left = time_left(self.work, self.initial, self.n, self.total, elapsed)
        log_line(f"step {self.n:,}/{self.total:,} ({100 * self.n // self.total}%): train loss {loss}, {tok_s} "
                 f"tokens/s, {tqdm.format_interval(elapsed)} elapsed, ~{tqdm.format_interval(left)} left")
        self.next_line = self.n + max(1, self.total // 10)

    def close(self) -> None:
        pass


def time_left(work: Callable[[int], int], initial: int, n: int, total: int, elapsed: float) -> float:
    """Seconds left of a run at step `n` of `total`, having run from step `initial` for `elapsed`: the time per
    micro-batch so far times the micro-batches left (`work(step)`: those before a step)."""
    return elapsed / max(work(n) - work(initial), 1) * (work(total) - work(n))


class WorkBar(tqdm):
    """tqdm's bar over optimizer steps whose rate (and so its time left) is the one `time_left` reckons in
    micro-batches, so a batch warm-up's small first steps do not shorten it."""

    def __init__(self, *args, work: Callable[[int], int], **kwargs):
        self.work = work  # before tqdm's own __init__, which draws the bar
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        values = super().format_dict
        n, total, elapsed = values["n"], values["total"], values["elapsed"]
        if total and self.initial < n < total and elapsed:
            values["rate"] = (total - n) / time_left(self.work, self.initial, n, total, elapsed)
        return values


def progress_bar(total: int, initial: int, sizes: StepSizes | None = None) -> contextlib.closing:
    """Rank 0's progress through `total` optimizer steps of `sizes`, closed on leaving a `with`: tqdm's bar on a
    terminal, `PlainProgress` elsewhere; other ranks show none."""
    work = (sizes or StepSizes(1)).before  # micro-batches before a step
    if dist.get_rank() != 0:
        return contextlib.closing(tqdm(total=total, disable=True))
    if sys.stderr.isatty():
        return contextlib.closing(WorkBar(total=total, initial=initial, desc="train", dynamic_ncols=True,
                                          mininterval=1.0, work=work))
    return contextlib.closing(PlainProgress(total, initial, work))


def checkpoint_to_resume(root: Path, resume: str | None) -> Path | None:
    """Collective: the verified checkpoint `--resume` names, chosen by rank 0 (which reads every file of the newest
    once, after clearing what a killed run left in the run directory) and broadcast, so that a bad choice is the same
    one-line error on every rank."""
    choice: list = [None, None]  # path, error
    if dist.get_rank() == 0:
        for path in checkpoint.clear_leftovers(root.parent):
            log_line(f"removed {path}, left half-written by an earlier run")
        try:
            found = checkpoint.resolve_resume(root, resume, log_line)
            choice[0] = str(found) if found is not None else None
        except FastmaeError as err:
            choice[1] = str(err)
    dist.broadcast_object_list(choice, src=0)
    if choice[1] is not None:
        raise FastmaeError(choice[1])
    return Path(choice[0]) if choice[0] is not None else None


def agreed_precision(requested: str, device: torch.device) -> str:
    """Collective: train.precision resolved on rank 0 (with all of its node's CPU cores) and broadcast: every rank
    must train in the same dtype."""
    choice = torch.zeros(1, dtype=torch.int64, device=device)
    if dist.get_rank() == 0:
        with all_cpu_cores():
            precision, note = choose_precision(requested, device)
        if note:
            log_line(note)
        choice[0] = PRECISIONS.index(precision)
    dist.broadcast(choice, src=0)
    return PRECISIONS[int(choice.item())]


def job_peak_flops(device: torch.device, precision: str, pinned: float | None = None) -> tuple[float, float | None]:
    """Collective: (measured, data-sheet or None) peak FLOP/s of the whole job in the training dtype: the
    denominators of MFU. A GPU belongs to one rank, so each rank measures its own. CPU ranks of a node share its
    cores, so the node's first rank measures once with all of them while the others wait, and only it counts.
    `pinned` (the test hook FASTMAE_FAULT_STARTUP_PEAK_FLOPS): what each measurement reads, unmeasured."""
    dtype = DTYPES[precision]
    measured, spec = 0.0, spec_peak_flops(device, dtype) or 0.0

    def measure() -> float:
        return matmul_flops(device, dtype) if pinned is None else pinned

    if device.type == "cpu":
        dist.barrier()
        if local_rank() == 0:
            with all_cpu_cores():
                measured = measure()
        dist.barrier()
    else:
        measured = measure()
    totals = torch.tensor([measured, spec, float(spec == 0.0)], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    measured, spec, unknown = totals.tolist()
    return measured, (spec if spec and not unknown else None)


def job_mfu_peak(device: torch.device, precision: str, read_as: Callable[[float], float] = float,
                 pinned: float | None = None) -> tuple[PeakFlops, float | None]:
    """Collective: the peak MFU divides by (`job_peak_flops`, measured again over the job when a logged window beats
    it: `hardware.PeakFlops`) and the data sheet's peak or None; the log says which. `read_as` and `pinned` are
    test hooks: the start-up measurement read as on a busy machine (`FaultHooks.startup_peak`), and what a start-up
    GEMM reads, given instead of measured (`FaultHooks.pinned_peak`; the same on every rank)."""
    measured, spec = job_peak_flops(device, precision, pinned)
    peak = PeakFlops(read_as(measured), remeasure=lambda: job_peak_flops(device, precision)[0], log=log_line,
                     origin=None if pinned is None else "given by FASTMAE_FAULT_STARTUP_PEAK_FLOPS, unmeasured")
    log_line(f"MFU divides by the {peak.source} over the job in {precision}"
             + (f" (and mfu_spec by the data sheet's {format_flops(spec)})" if spec else ""))
    return peak, spec
