"""Host overhead of one optimizer step: device ops, Triton launches, host-device syncs and host milliseconds, for
Hugging Face RoBERTa, mlm, mae-lm and 3ml (or the modern-* systems: ModernBERT's layers) at base depth, through the
engine fastmae trains with.

    python benchmarks/host_overhead.py [--systems hf-roberta,mlm,mae-lm,3ml] [--sequences 2]
                                       [--zero-stage 1] [--deepspeed dotted.key=value ...]

On a GPU the host issues every op of a step one after another (tens of microseconds each through PyTorch and
DeepSpeed); a step of N ops needs N times that of host time however fast the GPU is, so N is what a step must cut
before the GPU can be kept busy. The counts are taken with the CUDA code path emulated, the same on any machine:
- fastmae's Triton kernels run (FASTMAE_KERNELS=triton; on CPU through TRITON_INTERPRET=1), each launch counted once
  and nothing it does inside counted as an op;
- attention counts as flash-attn's varlen kernels (one op each way; the reference computes it), a local layer's
  window as the backend CUDA picks, Hugging Face's SDPA as CUDA's fused kernel and dropout as CUDA's native_dropout
  (one op each way; on CPU torch's draws a Bernoulli tensor and fastmae's its own bits);
- bf16, through fastmae.engine.build_engine (DeepSpeed ZeRO, fp32 master weights and gradient accumulation, fused
  AdamW, clipping at 2.0) in a world of one, as on one GPU;
- base depth (12 encoder layers, each preset's decoder) and benchmarks/throughput.py's vocabulary (32,000) at a
  narrow width (NARROW): what the host issues does not depend on the width, and a CPU runs the step in seconds.
On a GPU nothing is emulated: the ops are the device's own, at base width.

Counted in the third optimizer step (steady state) by a TorchDispatchMode: device ops are the aten ops that compute or
allocate (views and metadata excluded); syncs are the host reads of a device value (`.item()`, `bool(tensor)`),
tensors made from host data (`torch.tensor(...)` on the device: a blocking host-to-device copy) and explicit
synchronize calls of the accelerator, asked for by anything but fastmae (its reads of the masks' host counts look the
same on CPU and are reported apart as `fastmae_host_reads`; on CUDA, FASTMAE_SYNC_DEBUG=1 proves them host-side). On
CPU the op count also takes in the few ops on those host counts. `python_calls_per_step` (CUDA path emulated,
eager steps; the fourth step, outside the TorchDispatchMode): the Python function calls the step makes on the host
(sys.setprofile), an emulated kernel's insides not counted: a width- and machine-free proxy of
the host's Python work, which on a GPU runs between the ops a step issues (eager; a replayed graph runs none of it).
`host_ms_per_step` is the median time until the step's call returns: on a GPU at full size, on CPU at 2 x 32 tokens
(compute nearly nothing): the host's cost of issuing the step on this machine. Writes
benchmarks/results/NAME.{json,md} (--name, default host_overhead).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

import torch
from common import median_time, write_results
from cuda_emulation import count_triton_launches, emulate_cuda_path
from torch.utils._python_dispatch import TorchDispatchMode

if __name__ == "__main__" and not torch.cuda.is_available():  # before Triton is imported here or in the systems'
    os.environ["TRITON_INTERPRET"] = "1"                        # processes (they inherit the environment)

SYSTEMS = ("hf-roberta", "mlm", "mae-lm", "3ml")
MODERN_SYSTEMS = ("modern-mlm", "modern-3ml", "modern-mae-lm")  # on ModernBERT's layers (pre-LN): --systems names them
NARROW = dict(hidden_size=96, num_heads=6, intermediate_size=384)  # heads of 16: the smallest triton_window takes
REPO = Path(__file__).resolve().parent.parent
SYNC_OPS = {"_local_scalar_dense": "host read", "lift_fresh": "host-to-device copy"}
ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty")  # memory handed out, none written


class StepCounter(TorchDispatchMode):
    """Counts what the host asks of the device while active: ops (views excluded), syncs and fastmae's own host reads
    apart (`host_reads`, the module doc says why: a sync asked for from fastmae's code lands there), Triton launches
    (`kernel`). A host read or a tensor from host data made while a TorchFunctionMode is active goes unseen (its ops
    are counted). With `model_sized` (the numel of the
    model's largest parameter, of all its parameters), also the ops over a tensor that size (DeepSpeed's gradient
    hooks and optimizer step over the flat gradients and weights: `model_passes`) and the bytes of the distinct
    tensors each of them reads or writes (`model_bytes`): what the GPU's memory moves a step outside the model."""

    def __init__(self, model_sized: tuple[int, int] | None = None):
        super().__init__()
        self.model_sized = model_sized
        self.model_passes: collections.Counter = collections.Counter()
        self.model_bytes = 0
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()
        self.launches: collections.Counter = collections.Counter()
        self.by_phase: collections.Counter = collections.Counter()  # ops in forward, backward, step, other
        self.phase = "other"  # set by count_phases' wrappers of the DeepSpeed engine
        self.muted = 0  # > 0 inside an emulated kernel: its own torch calls are not the host's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.muted:
            name = func.overloadpacket.__name__
            if name in SYNC_OPS:
                caller, ours = _caller()
                (self.host_reads if ours else self.syncs)[f"{SYNC_OPS[name]} at {caller}"] += 1
            elif not _is_metadata(func):
                self.ops[name] += 1
                self.by_phase[self.phase] += 1
                if self.model_sized and name not in ALLOCATIONS:
                    self._count_model_pass(name, (args, kwargs, out))
        return out

    def _count_model_pass(self, name: str, tensors) -> None:
        tensors = {t.data_ptr(): t for t in torch.utils._pytree.tree_leaves(tensors) if isinstance(t, torch.Tensor)}
        smallest, largest = self.model_sized
        if any(smallest <= t.numel() <= largest for t in tensors.values()):
            self.model_passes[name] += 1
            self.model_bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def __enter__(self):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        self._synchronize = accelerator.synchronize

        def synchronize(*args, **kwargs):
            self.syncs[f"synchronize at {_caller()[0]}"] += 1
            return self._synchronize(*args, **kwargs)

        accelerator.synchronize = synchronize
        return super().__enter__()

    def __exit__(self, *exc):
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize = self._synchronize
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def kernel(self, name: str, aten: bool = False):
        """One emulated kernel named `name`: counted once (a Triton launch, or with `aten` an aten op of the CUDA
        path), its insides muted."""
        if self.muted:  # a launch inside a launch (an autotuner's trial) is the same launch
            yield
            return
        if aten:
            self.ops[name] += 1
            self.by_phase[self.phase] += 1
        else:
            self.launches[name] += 1
        self.muted += 1
        try:
            yield
        finally:
            self.muted -= 1


class PythonCalls:
    """Counts the Python calls the host makes while active (`calls`, sys.setprofile), an emulated kernel's insides
    muted (`kernel`, as StepCounter's; the emulation's wrapper of a launch is counted, standing in for a real launch's
    own Python): a step apart from StepCounter's, whose dispatch of every op runs Python of torch's own."""

    def __init__(self):
        self.calls = 0
        self.muted = 0

    def _profile(self, frame, event: str, arg) -> None:
        if event == "call" and not self.muted:  # a generator's resume counts as a call
            self.calls += 1

    def __enter__(self):
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self._previous)

    @contextlib.contextmanager
    def kernel(self, name: str, aten: bool = False):
        """An emulated kernel: its insides muted."""
        self.muted += 1
        try:
            yield
        finally:
            self.muted -= 1


def _caller() -> tuple[str, bool]:
    """(file:line, whether it is fastmae's) of the innermost frame outside torch, DeepSpeed's accelerator and this
    file: who asked for the sync."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if "torch" in path.parts or "accelerator" in path.parts or path.name == "host_overhead.py":
            continue
        ours = any(path.is_relative_to(REPO / package) for package in ("fastmae", "kernels"))
        return f"{'/'.join(path.parts[-2:])}:{frame.lineno}", ours
    return "?", False


def _is_metadata(func) -> bool:
    """Ops that touch no device memory: views, aliases, shape and stride queries, profiler annotations (torch's
    optimizers mark their steps with record_function)."""
    return func.is_view or func.overloadpacket.__name__ in (
        "detach", "alias", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_version",
        "_record_function_enter_new", "_record_function_exit")


ACTIVE: StepCounter | None = None  # the counter of the step being counted (None: not counting)


def count_phases(counter_of) -> None:
    """Attribute the ops of DeepSpeed engines' forward, backward and step (the optimizer's, after the last
    micro-batch) to those phases of `counter_of()`'s count."""
    from deepspeed import DeepSpeedEngine

    for phase in ("forward", "backward", "step"):
        original = getattr(DeepSpeedEngine, phase)

        def wrapped(self, *args, _original=original, _phase=phase, **kwargs):
            counter = counter_of()
            if counter is None:
                return _original(self, *args, **kwargs)
            counter.phase = _phase
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.phase = "other"

        setattr(DeepSpeedEngine, phase, wrapped)


def _step(system: str, sequences: int, seq_len: int, narrow: bool, precision: str, run, graphs: bool = False):
    """A training-step closure of `system` on one engine (benchmarks/systems.py's steps); `graphs`: fastmae's model
    replays its forward and backward (captured on CUDA as the run config allows, else CUDA graphs' CPU twin)."""
    from systems import GRAPHS_TWIN, fastmae_step, hf_step, make_tokens, model_config

    from fastmae.config import SpecialTokens

    config = model_config(system, "base").replace(max_seq_len=max(seq_len, 64), **(NARROW if narrow else {}))
    tokens = make_tokens(sequences)[:, :seq_len].clone()
    tokens[:, -1] = SpecialTokens().eos
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if system == "hf-roberta":
        return hf_step(config, tokens, device, precision, run)[0]
    return fastmae_step(config, tokens, device, precision, GRAPHS_TWIN if graphs else None, run)[0]


def measure_system(system: str, sequences: int, seq_len: int, overrides: list[str], graphs: bool) -> dict:
    """Counts of one steady-state optimizer step of `system` (CUDA path emulated), and its host milliseconds;
    `graphs`: fastmae's systems replay CUDA graphs (on CPU the twin, each replay counted as one launch)."""
    global ACTIVE
    from systems import init_world_of_one

    from fastmae.config import load_run_config

    init_world_of_one()
    count_phases(lambda: ACTIVE)
    built = _record_models()
    torch.manual_seed(0)
    run = load_run_config(None, ["train.zero_stage=1", f"train.cuda_graphs={'auto' if graphs else 'never'}",
                                 *overrides])
    precision = "bf16"
    if torch.cuda.is_available():  # the real thing: launches and host time on the device itself
        count_triton_launches(lambda: ACTIVE)
        step = _step(system, sequences, seq_len, False, precision, run, graphs)
    else:  # host time: the CPU path at a tiny shape, before the emulation replaces it
        timing = None  # the CPU twin's time says nothing about a replay's
        if not graphs:
            timing = 1e3 * median_time(_step(system, 2, 32, True, precision, run), 3, 5, host_only=True)
        emulate_cuda_path(lambda: ACTIVE)
        step = _step(system, sequences, seq_len, True, precision, run, graphs)
    for _ in range(2):
        step()
    sizes = [p.numel() for p in built[-1].parameters()]
    counter = StepCounter(model_sized=(max(sizes), int(1.01 * sum(sizes))))  # 1%: DeepSpeed's alignment padding
    ACTIVE = counter
    with counter:
        step()
    python_calls = None  # on CUDA the backward's Python runs on autograd's device thread; replays run none of it
    if not (torch.cuda.is_available() or graphs):
        ACTIVE = PythonCalls()
        with ACTIVE:
            step()
        python_calls = ACTIVE.calls
    ACTIVE = None
    if torch.cuda.is_available():
        timing = 1e3 * median_time(step, 3, 5, host_only=True)
    return {"device_ops_per_step": sum(counter.ops.values()),
            "triton_launches_per_step": sum(counter.launches.values()),
            "python_calls_per_step": python_calls,
            "syncs_per_step": sum(counter.syncs.values()), "host_ms_per_step": timing,
            "model_passes_per_step": sum(counter.model_passes.values()),
            "model_bytes_per_parameter": round(counter.model_bytes / sum(sizes), 1),
            "model_passes": dict(counter.model_passes),
            "syncs": dict(counter.syncs), "fastmae_host_reads": sum(counter.host_reads.values()),
            "launches": dict(counter.launches), "by_phase": dict(counter.by_phase),
            "top_ops": dict(counter.ops.most_common(12))}


def _record_models() -> list:
    """The models fastmae.engine.build_engine is given from now on, in this process (measure_system's own)."""
    import fastmae.engine

    built, build_engine = [], fastmae.engine.build_engine

    def recording(model, *args, **kwargs):
        built.append(model)
        return build_engine(model, *args, **kwargs)

    fastmae.engine.build_engine = recording
    return built


def _run_isolated(*args) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure_system, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {SYSTEMS + MODERN_SYSTEMS}")
    parser.add_argument("--sequences", type=int, default=2, help="sequences of 512 tokens in the micro-batch")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (fewer: a quicker count of "
                                                                 "the same ops, to compare DeepSpeed's options)")
    parser.add_argument("--zero-stage", type=int, default=1, help="DeepSpeed ZeRO stage (train.zero_stage)")
    parser.add_argument("--deepspeed", nargs="*", default=[], metavar="KEY=VALUE",
                        help="DeepSpeed config entries (dotted) merged over fastmae's, to compare its options")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="fastmae's systems replay their forward and backward (fastmae/graphs.py): CUDA graphs on "
                             "a GPU, their CPU twin here, each replay counted as one launch")
    parser.add_argument("--name", default="host_overhead", help="results file name under benchmarks/results/")
    args = parser.parse_args(argv)
    systems = args.systems.split(",")
    if unknown := sorted(set(systems) - set(SYSTEMS + MODERN_SYSTEMS)):
        parser.error(f"--systems: unknown {unknown}; choose from {SYSTEMS + MODERN_SYSTEMS}")
    overrides = [f"train.zero_stage={args.zero_stage}", *(f"deepspeed.{kv}" for kv in args.deepspeed)]
    rows = []
    for system in systems:
        result = _run_isolated(system, args.sequences, args.seq_len, overrides, args.cuda_graphs)
        rows.append({"system": system, **result})
        print(f"{system:>10}: {result['device_ops_per_step']:5d} device ops, {result['triton_launches_per_step']:3d} "
              f"Triton launches, {result['python_calls_per_step']} Python calls, {result['syncs_per_step']} syncs "
              f"{result['syncs']}, "
              f"{result['model_passes_per_step']} model-sized passes {result['model_passes']} "
              f"({result['model_bytes_per_parameter']} bytes a parameter), host "
              f"{result['host_ms_per_step'] or float('nan'):.1f} ms", flush=True)
    emulated = not torch.cuda.is_available()
    notes = (f"One optimizer step (the third) of {args.sequences} x {args.seq_len} tokens in one micro-batch, bf16, "
             f"ZeRO-{args.zero_stage}{', ' + ' '.join(args.deepspeed) if args.deepspeed else ''}"
             f"{', fastmae replaying CUDA graphs of forward and backward' if args.cuda_graphs else ''}, base depth"
             + (f" and vocabulary at width {NARROW['hidden_size']}, the CUDA code path emulated (the docstring);"
                + (" host ms: not measured (the CPU twin's time says nothing about a replay's)" if args.cuda_graphs
                   else " host ms: the CPU step at 2 x 32 tokens on this machine") if emulated else
                " and width on this GPU; host ms: until the step's call returns") + ".")
    for row in rows:
        phases = row["by_phase"]
        row["forward"], row["backward"], row["optimizer"] = (phases.get(k, 0) for k in ("forward", "backward", "step"))
    columns = ["system", "device_ops_per_step", "forward", "backward", "optimizer", "triton_launches_per_step",
               "python_calls_per_step", "syncs_per_step", "model_passes_per_step", "model_bytes_per_parameter",
               "host_ms_per_step"]
    header = {"emulated_cuda_path": emulated, "cuda_graphs": args.cuda_graphs, "sequences": args.sequences,
              "seq_len": args.seq_len, "zero_stage": args.zero_stage, "deepspeed_overrides": args.deepspeed}
    path = write_results(args.name, rows, columns, "Host overhead per optimizer step", notes, header)
    print(f"wrote {path} and {args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
