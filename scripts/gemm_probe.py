"""What cuBLAS launches for each GEMM of a RoBERTa-base post-LN layer as fastmae runs it, at the headline's 65,536
rows a micro-batch (issue 55's kernels a step: the H200 profile of an mlm step at f6d59b9 counted 134 memsets and 50
split-K reductions, about one memset a GEMM, none of them fastmae's own launches): each GEMM's kernels a call by name
and its GPU microseconds, with torch's default BLAS and again with cuBLASLt preferred
(`torch.backends.cuda.preferred_blas_library`). Prints a table (the GPU check keeps it in the phase's log).

    python scripts/gemm_probe.py [--rows 65536]      # on CUDA; on CPU the GEMMs run and nothing is profiled
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import gpu_kernel_table  # noqa: E402

HIDDEN, FFN = 768, 3072


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    gemms = layer_gemms(args.rows, "cuda" if cuda else "cpu", torch.bfloat16)
    if not cuda:
        for name, call in gemms.items():
            print(f"{name}: {tuple(call().shape)} (no CUDA: nothing profiled)")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__} (CUDA {torch.version.cuda}), {args.rows} rows, "
          "bf16")
    totals = {}
    for library in ("default", "cublaslt"):
        if library == "cublaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        launched, micros = Counter(), 0.0
        print(f"\n| {library} | kernels a call | memsets | GPU us |\n|---|---|---|---|")
        for name, call in gemms.items():
            table = gpu_kernel_table(call)
            kernels = Counter({key: launches for key, (_, launches) in table.items()})
            us = 1e3 * sum(ms for ms, _ in table.values())
            launched.update(kernels)
            micros += us
            memsets = sum(n for key, n in kernels.items() if "memset" in key.lower())
            names = "; ".join(f"{n:g} x {key[:70]}" for key, n in kernels.most_common())
            print(f"| {name} | {names} | {memsets:g} | {us:.1f} |", flush=True)
        totals[library] = (sum(launched.values()), micros)
        print(f"{library}: {sum(launched.values()):g} kernels, {micros:.1f} us for the layer's twelve GEMMs")
    print("\n" + "; ".join(f"{library}: {n:g} kernels, {us:.0f} us" for library, (n, us) in totals.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
