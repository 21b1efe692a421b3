"""Run logs: JSONL metrics (always), TensorBoard events (when tensorboard is installed), rank 0 only."""

from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from pathlib import Path

import torch

from .data.order import DIGEST_MODULUS


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or the resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss_kib / 1024 if sys.platform != "darwin" else rss_kib / 2**20


class MetricsWriter:
    """Appends one JSON object per record to RUN/metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_torn_record(self.path)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None

    def write(self, record: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def drop_torn_record(path: Path) -> None:
    """Cut a JSONL file back to its last complete line: a process killed while appending leaves a torn record."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of RUN/metrics.jsonl (a run resumed after a crash may repeat steps: the last record wins; a last
    line torn by a kill is left out)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = {}
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    for line in lines:
        if line.strip():
            record = json.loads(line)
            records[(record.get("kind"), record["step"])] = record
    return sorted(records.values(), key=lambda r: (r["step"], r.get("kind", "")))


class LogWindow:
    """The optimizer steps since the last train record: a record is due every `every` steps and at the last step.

    `sums` on the device (loss sum, predicted, correct, scored; steps skipped for a non-finite loss add nothing), the
    rest on the host; time spent evaluating and checkpointing (`paused`) is not training time.
    """

    def __init__(self, every: int, last_step: int, device: torch.device):
        self.every, self.last_step, self.device = every, last_step, device
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        self.tokens = self.flops = self.steps = self.digest = 0
        self.paused_s, self.start = 0.0, time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether step `step` (counted from 1) ends with a train record."""
        return step % self.every == 0 or step == self.last_step

    def add(self, stats) -> None:
        """Count one optimizer step's `StepStats` in."""
        self.sums += torch.where(stats.non_finite > 0, 0.0, stats.sums)
        self.tokens += stats.tokens
        self.flops += stats.flops
        self.digest = (self.digest + stats.digest) % DIGEST_MODULUS
        self.steps += 1

    @contextlib.contextmanager
    def paused(self):
        """Time inside does not count as training time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - start

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start - self.paused_s


def eval_table(evals: list[dict]) -> str:
    """Held-out records as a Markdown table, one column per evaluation (the table README shows for the demo)."""
    return "\n".join(["| step | " + " | ".join(f"{e['step']:,}" for e in evals) + " |",
                      "|---|" + "---|" * len(evals),
                      "| held-out loss (nats) | " + " | ".join(f"{e['loss']:.2f}" for e in evals) + " |",
                      "| accuracy | " + " | ".join(f"{e['accuracy']:.3f}" for e in evals) + " |"])
