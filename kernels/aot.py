"""Ahead-of-time compile of every kernel configuration for NVIDIA GPUs, no GPU needed: the static GPU check.

    python -m fastmae.kernels.aot [--arch 80 90] [--json OUT.json] [--markdown OUT.md] [--match REGEX]

Compiles each (kernel, block size, warps, flags, dtype) the launchers can choose for sm_80 and sm_90 with
`triton.compile(ASTSource(...))`, told what Triton's JIT specializes at a launch (`specializations`), then reads
registers, spills (LOCAL) and shared memory per function from `cuobjdump --dump-resource-usage`, the tool shipped
inside the triton wheel, the widest load from the PTX and the instructions a thread issues per element from the SASS
(`cuobjdump -sass`), and counts the warps its registers let stay resident on a multiprocessor (occupancy: what hides
memory latency). Run without TRITON_INTERPRET.

The table is a pure function of this directory's sources and Triton's version (`inputs_sha256`), and compiling all
~1,000 takes ~3 CPU-minutes with Triton's cache empty, so it is committed (benchmarks/results/kernels_static.json,
REGENERATE) and the suite checks it is of the kernels it has, compiling a few configurations itself; --match compiles
those whose "kernel config" matches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from .aot_configs import all_configs

# Shared memory a block may use (opt-in maximum): A100 (sm_80) 163 KiB, H100 (sm_90) 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# Both architectures: 65,536 registers, at most 64 warps and 32 blocks a multiprocessor; registers are allocated to a
# warp in units of 256.
SM_REGISTERS, SM_WARPS, SM_BLOCKS, REGISTER_UNIT = 65536, 64, 32, 256
# The fewest warps a configuration may leave resident on a multiprocessor (a quarter of them): the first GPU timing
# of the fused LayerNorm backward found it at 8 (143-146 registers a thread, one 8-warp program), the two largest
# kernels of a RoBERTa-base step its backward and bias + GELU's, at several times their memory traffic's time.
MIN_RESIDENT_WARPS = 16
# Tensor-core attention kernels keep their tiles in registers by design (FlashAttention runs one or two programs a
# multiprocessor and hides latency within each): checked for no spill to the stack instead of for resident warps.
TILE_RESIDENT = ("local_window.",)


# What Triton's JIT specializes at every launch, which a compile here must be told: a pointer argument 16-byte aligned
# (torch's allocations and `launch.carve`'s buffers are) and an integer argument divisible by 16, as these are at the
# shapes the benchmarks run (widths of 768 to 4,096, vocabulary 32,000, 65,536 rows, strides of whole heads). Untold,
# a compile proves no alignment: bias + GELU's tiles compiled to 2-byte loads where the GPU runs 16-byte ones, and
# their registers (this table's figures) were another kernel's.
DIVISIBLE_INTS = re.compile(r"(H|V|half|hidden|n_cols|n_rows|n_elements|num_src_rows|rows_[qk]|programs|window"
                            r"|stride_\w+)\d?")  # a digit: one of a kernel's several entries (launch._sum_parts_kernel)


def specializations(fn, signature: dict[str, str]) -> dict[tuple[int], list]:
    """The attributes Triton's JIT gives a launch of kernel `fn` at the benchmarks' shapes (DIVISIBLE_INTS), for
    `triton.compile`: (the argument's index in fn's arguments,) -> [["tt.divisibility", 16]]."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
            if kind.startswith("*") or (kind in ("i32", "i64") and DIVISIBLE_INTS.fullmatch(name))}


def failures(r: dict) -> list[str]:
    """What is wrong with one compiled configuration's resource usage (empty: nothing)."""
    wrong = []
    if r["local_bytes"] != 0:
        wrong.append("spills to local memory")
    if r["shared_bytes"] > r["shared_limit"]:
        wrong.append("exceeds shared memory")
    if r["kernel"].startswith(TILE_RESIDENT):
        if r["stack_bytes"] != 0:
            wrong.append("spills to the stack")
    elif r["resident_warps"] < MIN_RESIDENT_WARPS:
        wrong.append(f"leaves fewer than {MIN_RESIDENT_WARPS} warps resident")
    return wrong


def resident_warps(registers: int, warps: int) -> int:
    """Warps of a kernel using `registers` a thread and `warps` a program that fit a multiprocessor at once, by
    registers and the warp and block limits (shared memory aside: these kernels use little)."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    return min(SM_BLOCKS, SM_REGISTERS // (per_warp * warps), SM_WARPS // warps) * warps
REGENERATE = ("python -m fastmae.kernels.aot --json benchmarks/results/kernels_static.json "
              "--markdown benchmarks/results/kernels_static.md")


def inputs_sha256() -> str:
    """sha256 of what the table depends on: Triton's version and every source file of the kernels (this directory)."""
    import triton

    digest = hashlib.sha256(f"triton {triton.__version__}\n".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(f"{path.name}\n".encode() + path.read_bytes())
    return digest.hexdigest()


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def widest_load_bytes(ptx: str) -> int:
    """The most bytes one global load instruction of a thread reads in `ptx` (ld.global.v4.b32: 16), 0 for none:
    whether a row-wise kernel's loads are vectorized, which is most of how close it comes to the memory's bandwidth."""
    widths = [int(vector or 1) * int(bits) // 8
              for vector, bits in re.findall(r"ld\.global(?:\.[\w:]+?)*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx)]
    return max(widths, default=0)


def issue_instructions(sass: str) -> int:
    """SASS instructions (NOPs aside) of the kernel's largest loop body (from a backward branch's target to it), or of
    the whole kernel where it has no loop: what a thread issues per pass over its elements. The row-wise kernels are
    bound by it more than by memory (an H200's 132 x 4 schedulers issue one warp instruction a cycle each)."""
    lines = [(int(address, 16), op, rest) for address, op, rest
             in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)]
    spans = [(int(m.group(1), 16), address) for address, op, rest in lines
             if op.startswith("BRA") and (m := re.search(r"0x([0-9a-f]+)", rest)) and int(m.group(1), 16) < address]
    start, end = max(spans, key=lambda span: span[1] - span[0], default=(0, float("inf")))
    return sum(1 for address, op, _ in lines if start <= address <= end and not op.startswith("NOP"))


def thread_elements(constexprs: dict, warps: int) -> float | None:
    """Elements of a row-wise kernel's tile (BLOCK_R x BLOCK_C, or BLOCK_R x CHUNKS x BLOCK_H; the cross-entropy's
    block of a row's vocabulary, BLOCK_V, or of BLOCK_R rows' vocabulary) a thread holds, None for other kernels."""
    if "BLOCK_V" in constexprs:
        return constexprs.get("BLOCK_R", 1) * constexprs["BLOCK_V"] / (32 * warps)
    columns = constexprs.get("BLOCK_C", constexprs.get("BLOCK_H", 0) * constexprs.get("CHUNKS", 1))
    return constexprs["BLOCK_R"] * columns / (32 * warps) if "BLOCK_R" in constexprs and columns else None


def compile_one(job):
    """Compile one configuration for one architecture; return its resource usage."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    (name, desc, signature, constexprs, warps, *stages), arch = job  # stages: where a launcher names them
    module, fn_name = name.split(".")
    fn = getattr(importlib.import_module(f"fastmae.kernels.{module}"), fn_name)
    full_sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=full_sig, constexprs=constexprs, attrs=specializations(fn, full_sig))
    options = {"num_warps": warps, **({"num_stages": stages[0]} if stages else {})}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        dump = subprocess.run([_cuobjdump(), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    registers = int(usage.get("REG", -1))
    instructions, elements = issue_instructions(sass), thread_elements(constexprs, warps)
    return {"kernel": name, "config": desc, "arch": f"sm_{arch}", "num_warps": warps, "registers": registers,
            "resident_warps": resident_warps(registers, warps), "local_bytes": int(usage.get("LOCAL", -1)),
            "stack_bytes": int(usage.get("STACK", -1)), "load_bytes": widest_load_bytes(compiled.asm["ptx"]),
            "instructions": instructions,
            "instructions_per_element": round(instructions / elements, 2) if elements else None,
            "shared_bytes": max(int(usage.get("SHARED", 0)), int(compiled.metadata.shared)),
            "shared_limit": SHARED_LIMIT[arch]}


def _span(values) -> str:
    """'min-max' of the numbers among `values` (None: not a row-wise kernel), '-' for none."""
    numbers = [v for v in values if v is not None]
    return f"{min(numbers):g}-{max(numbers):g}" if numbers else "-"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_LIMIT))
    parser.add_argument("--json", type=Path, help="write the per-configuration table here")
    parser.add_argument("--markdown", type=Path, help="write a per-kernel summary table here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--match", help="compile only the configurations whose 'kernel config' matches this regex")
    args = parser.parse_args(argv)
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("fastmae.kernels.aot: unset TRITON_INTERPRET (the interpreter cannot compile)", file=sys.stderr)
        return 2
    jobs = [(cfg, arch) for cfg in all_configs() for arch in args.arch
            if not args.match or re.search(args.match, f"{cfg[0]} {cfg[1]}")]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(compile_one, jobs))
    bad = [r for r in results if failures(r)]
    if args.json:
        table = {"inputs_sha256": inputs_sha256(), "triton": triton.__version__,
                 "archs": [f"sm_{arch}" for arch in args.arch], "match": args.match, "results": results}
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    worst = {}
    for r in results:
        key = (r["kernel"], r["arch"])
        worst[key] = max(worst.get(key, (0, 0)), (r["registers"], r["shared_bytes"]))
    for (kernel, arch), (regs, shared) in sorted(worst.items()):
        print(f"{kernel:32s} {arch}: max {regs:3d} registers, max {shared:6d} B shared")
    if args.markdown:
        lines = ["# Static GPU resource usage of every kernel configuration", "",
                 f"From `python -m fastmae.kernels.aot` (Triton {triton.__version__} AOT compile + cuobjdump, no GPU "
                 "needed). A GPU compiles with its own Triton, whose registers may differ. Instructions a thread's "
                 "element: the SASS a thread issues per pass (its loop's body, or the whole kernel) over the elements "
                 "of the tile it holds, for the row-wise kernels; these are bound by it (an H200 issues about 28 a "
                 "thread in the time its memory moves a bf16 element in and out).", "",
                 "| kernel | arch | configs | registers (min-max) | resident warps / SM (min) | shared bytes (max) "
                 "| spill bytes (max) | widest load, bytes (min-max) | instructions a thread's element (min-max) |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for (kernel, arch) in sorted(worst):
            rows = [r for r in results if (r["kernel"], r["arch"]) == (kernel, arch)]
            regs = [r["registers"] for r in rows]
            lines.append(f"| {kernel} | {arch} | {len(rows)} | {min(regs)}-{max(regs)} | "
                         f"{min(r['resident_warps'] for r in rows)} | {max(r['shared_bytes'] for r in rows)} | "
                         f"{max(r['local_bytes'] for r in rows)} | {min(r['load_bytes'] for r in rows)}-"
                         f"{max(r['load_bytes'] for r in rows)} | "
                         f"{_span(r['instructions_per_element'] for r in rows)} |")
        args.markdown.write_text("\n".join(lines) + "\n")
    print(f"{len(results)} configurations compiled, {len(bad)} with a fault (`failures`)")
    for r in bad:
        print(f"  FAIL {', '.join(failures(r))}: {r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
