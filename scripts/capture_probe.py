"""Which backward step of a captured training step runs on CUDA's legacy stream (the GPU check's smoke phase found
3ml's fp32 capture failing with cudaErrorStreamCaptureImplicit). Records, for the tests' captured 3ml model, every
autograd node, aten op and Triton launch of the warm-up and the capture with the CUDA stream it ran on, and prints
the capture's entries on the legacy stream (id 0) and the last entries before any error.

    python scripts/capture_probe.py [--preset 3ml] [--dtype fp32]    # on a CUDA machine
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests")]

EVENTS: collections.deque = collections.deque(maxlen=60)
LEGACY: list = []
PHASE = ["warm-up"]


def record(kind: str, name: str) -> None:
    stream = torch.cuda.current_stream().cuda_stream
    entry = (PHASE[0], kind, name, hex(stream), threading.current_thread().name,
             torch.cuda.is_current_stream_capturing())
    EVENTS.append(entry)
    if stream == 0 and PHASE[0] == "capture":
        LEGACY.append(entry)


class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        record("aten", func.__name__)
        return func(*args, **(kwargs or {}))


def hook_graph(loss: torch.Tensor) -> None:
    """A pre-hook on every autograd node behind `loss`, recording where it runs."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_prehook(lambda grads, name=node.name(): record("node", name))
        stack.extend(next_node for next_node, _ in node.next_functions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="3ml")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    import triton.runtime.jit as jit
    from conftest import CUDA_HEADS
    from test_graphs import CUDA, accumulate, flat_model, same_shaped

    from fastmae import graphs
    from fastmae.graphs import StepGraphs

    run = jit.JITFunction.run

    def logged_run(self, *a, **k):
        record("triton", self.fn.__name__)
        return run(self, *a, **k)

    jit.JITFunction.run = logged_run
    backward = graphs.Recording._run_backward

    def traced_backward(self):
        hook_graph(self.output.loss)
        if torch.cuda.is_current_stream_capturing():
            PHASE[0] = "capture"
        backward(self)

    graphs.Recording._run_backward = traced_backward
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = flat_model(args.preset, 0, CUDA, dtype, dropout=0.0, **CUDA_HEADS)
    print(f"{args.preset} {args.dtype}: torch {torch.__version__}", flush=True)
    StepGraphs(model, capture=True)
    batches = same_shaped(model.config, 3, device=CUDA)
    try:
        with Ops():
            accumulate(model, batches)
        print("captured and replayed without error")
    except Exception:  # the probe's point: say where it failed
        traceback.print_exc()
    print(f"\nentries on the legacy stream during the capture ({len(LEGACY)}):")
    for entry in LEGACY[:40]:
        print("  ", *entry)
    print("\nlast entries (phase, kind, name, stream, thread, capturing):")
    for entry in EVENTS:
        print("  ", *entry)


if __name__ == "__main__":
    main()
