"""What cuBLAS launches for each GEMM of a RoBERTa-base post-LN layer as fastmae runs it, at the headline's 65,536
rows a micro-batch (issue 55's kernels a step: the H200 profile of an mlm step at e63392c counted 144 memsets and 50
split-K reductions, about one memset a GEMM, none of them fastmae's own launches): each GEMM's kernels a call by name
and its GPU microseconds, under each of VARIANTS, each in a process of its own (cuBLAS reads its workspace's size
when torch makes its handle): torch's default BLAS; cuBLASLt preferred (`torch.backends.cuda.preferred_blas_library`;
at e63392c: no split-K reductions, the memsets kept, 1% slower); and no workspace for cuBLAS and cuBLASLt, whose
kernels then can neither split K nor schedule tiles through it (what the memsets zero, if they are that). Prints a
table a variant (the GPU check's `overhead` phase keeps it in its log; at 7dd4d54, in `headline`'s: no workspace
made every GEMM one kernel, 0.8% slower in sum).

    python scripts/gemm_probe.py [--rows 65536]      # on CUDA; on CPU the GEMMs run and nothing is profiled
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import gpu_kernel_table  # noqa: E402

from fastmae.hardware import CUBLAS_NO_WORKSPACE  # noqa: E402

HIDDEN, FFN = 768, 3072
# variant -> (the environment its process adds, the BLAS library torch prefers in it); no workspace as the trainer's
# train.cublas_workspace=none
VARIANTS = {"default": ({}, None), "cublaslt": ({}, "cublaslt"), "no workspace": (CUBLAS_NO_WORKSPACE, None)}


def layer_gemms(rows: int, device: str, dtype: torch.dtype) -> dict:
    """The twelve GEMMs of a post-LN layer's forward and backward, as fastmae calls them (kernels/projection.py,
    fastmae/ops.py): name -> a call. The input gradients of the QKV and feed-forward input projections add the
    residual's handed gradient in place (`addmm_`)."""
    gen = torch.Generator(device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen) / 8

    x, o, a = rand(rows, HIDDEN), rand(rows, HIDDEN), rand(rows, FFN)
    g3, g, g4 = rand(rows, 3 * HIDDEN), rand(rows, HIDDEN), rand(rows, FFN)
    w_qkv, b_qkv, w_o = rand(3 * HIDDEN, HIDDEN), rand(3 * HIDDEN), rand(HIDDEN, HIDDEN)
    w_1, w_2 = rand(FFN, HIDDEN), rand(HIDDEN, FFN)
    handed = rand(rows, HIDDEN)
    return {
        "qkv forward (addmm, bias)": lambda: torch.addmm(b_qkv, x, w_qkv.t()),
        "attention out forward": lambda: o @ w_o.t(),
        "ffn in forward": lambda: x @ w_1.t(),
        "ffn out forward": lambda: a @ w_2.t(),
        "qkv input grad (addmm_ into the handed grad)": lambda: handed.addmm_(g3, w_qkv),
        "qkv weight grad": lambda: g3.t() @ x,
        "attention out input grad": lambda: g @ w_o,
        "attention out weight grad": lambda: g.t() @ o,
        "ffn in input grad (addmm_ into the handed grad)": lambda: handed.addmm_(g4, w_1),
        "ffn in weight grad": lambda: g4.t() @ x,
        "ffn out input grad": lambda: g @ w_2,
        "ffn out weight grad": lambda: g.t() @ a,
    }


def profile(variant: str, rows: int) -> None:
    """Print the table of one variant (VARIANTS): each GEMM's kernels a call, memsets and GPU microseconds."""
    library = VARIANTS[variant][1]
    if library:
        torch.backends.cuda.preferred_blas_library(library)
    launched, micros = Counter(), 0.0
    print(f"\n| {variant} | kernels a call | memsets | GPU us |\n|---|---|---|---|")
    for name, call in layer_gemms(rows, "cuda", torch.bfloat16).items():
        table = gpu_kernel_table(call)
        kernels = Counter({key: launches for key, (_, launches) in table.items()})
        us = 1e3 * sum(ms for ms, _ in table.values())
        launched.update(kernels)
        micros += us
        memsets = sum(n for key, n in kernels.items() if "memset" in key.lower())
        names = "; ".join(f"{n:g} x {key[:70]}" for key, n in kernels.most_common())
        print(f"| {name} | {names} | {memsets:g} | {us:.1f} |", flush=True)
    print(f"{variant}: {sum(launched.values()):g} kernels, {micros:.1f} us for the layer's twelve GEMMs", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--variant", choices=VARIANTS, help="profile this variant only, in this process")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        for name, call in layer_gemms(args.rows, "cpu", torch.bfloat16).items():
            print(f"{name}: {tuple(call().shape)} (no CUDA: nothing profiled)")
        return 0
    if args.variant:
        profile(args.variant, args.rows)
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), {args.rows} rows, "
          "bf16")
    exits = {}
    for variant, (env, _) in VARIANTS.items():
        done = subprocess.run([sys.executable, __file__, "--rows", str(args.rows), "--variant", variant],
                              env={**os.environ, **env}, capture_output=True, text=True)
        print(done.stdout + (f"{variant}: exit {done.returncode}\n{done.stderr[-2000:]}" if done.returncode else ""),
              flush=True)
        exits[variant] = done.returncode
    # a variant the device refuses (cuBLAS without a workspace may) is said in its table's place; only the default
    # failing fails the probe
    return int(exits["default"] != 0)


if __name__ == "__main__":
    raise SystemExit(main())
