"""Ahead-of-time compile of every kernel configuration for NVIDIA GPUs, no GPU needed: the static GPU check.

    python -m fastmae.kernels.aot [--arch 80 90] [--json OUT.json] [--markdown OUT.md] [--match REGEX]

Compiles each (kernel, block size, warps, flags, dtype) the launchers can choose for sm_80 and sm_90 with
`triton.compile(ASTSource(...))`, told what Triton's JIT specializes at a launch (`specializations`), then reads
registers, spills (LOCAL) and shared memory per function from `cuobjdump --dump-resource-usage`, the tool shipped
inside the triton wheel, and the widest load from the PTX, and counts the warps its registers let stay resident on a
multiprocessor (occupancy: what hides memory latency). Run without TRITON_INTERPRET.

The table is a pure function of this directory's sources and Triton's version (`inputs_sha256`), and compiling all
~1,000 takes ~3 CPU-minutes with Triton's cache empty, so it is committed (benchmarks/results/kernels_static.json,
REGENERATE) and the suite checks it is of the kernels it has, compiling a few configurations itself; --match compiles
those whose "kernel config" matches.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

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
DIVISIBLE_INTS = re.compile(r"(H|V|half|hidden|n_cols|n_rows|num_src_rows|rows_[qk]|programs|window|stride_\w+)")


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


def _row_configs():
    from . import launch, rows

    ptr = {"fp32": "*fp32", "bf16": "*bf16"}
    combos = {  # the flag sets the model launches: (SRC_INDEXED, GATHERED, HAS_FILL, HAS_POS, HAS_NORM, DST_INDEXED)
        "embed+pos+norm": (1, 0, 0, 1, 1, 0),
        "embed+norm (rotary)": (1, 0, 0, 0, 1, 0),
        "embed visible+pos+norm": (1, 1, 0, 1, 1, 0),  # the encoder's visible rows (k > 0): forward only differs
        "embed visible+norm (rotary)": (1, 1, 0, 0, 1, 0),
        "insert+pos+norm": (0, 0, 1, 1, 1, 1),
        "insert+norm (rotary)": (0, 0, 1, 0, 1, 1),
        "insert (no decoder)": (0, 0, 1, 0, 0, 1),
    }
    for hidden_block in [2**k for k in range(6, launch.MAX_HIDDEN.bit_length())]:  # BLOCK_H 64 .. MAX_HIDDEN
        block, warps = rows.row_launch_config(hidden_block)
        for combo, (src_idx, gathered, fill, pos, norm, dst) in combos.items():
            for dtype in ("fp32", "bf16"):
                flags = dict(SRC_INDEXED=src_idx, HAS_FILL=fill, HAS_POS=pos, HAS_NORM=norm, DST_INDEXED=dst,
                             BLOCK_H=block)
                d = ptr[dtype]
                fwd = dict(SRC=d, src_ids="*i32", gather_index="*i32", FILL=d, POS="*fp32", pos_ids="*i32",
                           W="*fp32", B="*fp32", OUT=d, dst_index="*i32", fill_index="*i32", MEAN="*fp32",
                           RSTD="*fp32", SRC_ROWS="*i32", POS_ROWS="*i32", num_src_rows="i32", H="i32",
                           stride_src="i32", stride_pos="i32", stride_out="i32", pos_offset="i32", eps="fp32")
                yield ("rows._rows_fwd_kernel", f"{combo} {dtype} BLOCK_H={block}", fwd,
                       {**flags, "GATHERED": gathered}, warps)
                if gathered:
                    continue
                bwd = dict(DOUT=d, dst_index="*i32", fill_index="*i32", SRC=d, SRC_ROWS="*i32", FILL=d, POS="*fp32",
                           POS_ROWS="*i32", W="*fp32", MEAN="*fp32", RSTD="*fp32", DPRE="*fp32", DW_PART="*fp32",
                           DB_PART="*fp32", n_rows="i32", num_src_rows="i32", H="i32", stride_dout="i32",
                           stride_src="i32", stride_pos="i32")
                yield ("rows._rows_bwd_kernel", f"{combo} {dtype} BLOCK_H={block}", bwd,
                       {**flags, "ROWS_PER_PROGRAM": rows.ROWS_PER_PROGRAM}, warps)


def _mask_configs():
    from . import mask_select

    rank = dict(cu_seqlens="*i32", maskable_ptr="*u8", RANK="*i32", score_key="*i64")
    yield ("mask_select._rank_kernel", f"BLOCK={mask_select.RANK_BLOCK}", rank,
           dict(BLOCK_I=mask_select.RANK_BLOCK, BLOCK_J=mask_select.RANK_BLOCK), mask_select.RANK_NUM_WARPS)
    compact = dict(tokens="*i32", cu_seqlens="*i32", RANK="*i32", num_removed="*i64", num_random="*i64",
                   num_predicted="*i64", masked_start="*i64", removed_start="*i64", INPUT="*i32", MASKED_INDEX="*i32",
                   LABELS="*i32", VISIBLE_INDEX="*i32", REMOVED_INDEX="*i32", replace_key="*i64", ORDINARY="*i32",
                   num_ordinary="i32", mask_token_id="i32")
    yield ("mask_select._compact_kernel", f"BLOCK={mask_select.COMPACT_BLOCK}", compact,
           dict(BLOCK=mask_select.COMPACT_BLOCK), 4)


def _ce_configs():
    from . import cross_entropy

    for block in [2**k for k in range(4, 13)]:
        if block > cross_entropy.CE_BLOCK_V:
            break
        for dtype in ("fp32", "bf16"):
            for grad in (0, 1):
                sig = dict(LOGITS=f"*{dtype}", stride_logits="i32", LABELS="*i32", LOSS="*fp32",
                           V="i32", ignore_index="i32", smoothing="fp32", z_loss="fp32")
                yield ("cross_entropy._ce_rows_kernel", f"{dtype} BLOCK_V={block} grad={grad}", sig,
                       dict(COMPUTE_GRAD=grad, BLOCK_V=block), cross_entropy.CE_NUM_WARPS)


def _rotary_configs():
    from . import launch

    for dtype in ("fp32", "bf16", "fp16"):
        for block in (256, 512, 1024):  # heads x head_dim / 2 up to base (384) and large (512) widths, and beyond
            sig = dict(Q=f"*{dtype}", K=f"*{dtype}", Q_OUT=f"*{dtype}", K_OUT=f"*{dtype}", COS_Q="*fp32",
                       SIN_Q="*fp32", COS_K="*fp32", SIN_K="*fp32", rows_q="i32", rows_k="i32", stride_q_row="i32",
                       stride_q_head="i32", stride_k_row="i32", stride_k_head="i32", heads="i32", half="i32",
                       sign="fp32")
            block_r, warps = launch.tile_launch(block)
            yield ("rotary._rotary_kernel", f"{dtype} BLOCK={block}", sig, dict(BLOCK_R=block_r, BLOCK=block), warps)


def _norm_configs():
    """Each norm kernel at its shipped tiles, every flag, at three widths; and at RoBERTa's (rows of 1,024 lanes) in
    bf16, post-LN with dropout and the projection's bias, at every tiling the GPU benchmark times (norm.CANDIDATES)."""
    from . import launch, norm

    for hidden in (64, 1024, launch.MAX_HIDDEN):  # the smallest row, base and large models' (768, 1024), the largest
        block = hidden  # a power of two: the kernels' BLOCK_H
        shipped = norm.tiles(hidden)
        for dtype in ("fp32", "bf16"):
            fwd = dict(X=f"*{dtype}", XB=f"*{dtype}", R=f"*{dtype}", W=f"*{dtype}", B=f"*{dtype}", Y=f"*{dtype}",
                       H_OUT=f"*{dtype}", MEAN="*fp32", RSTD="*fp32", KEY="*i64", n_rows="i32", H="i32",
                       stride_x="i32", stride_r="i32", eps="fp32", threshold="i32", scale="fp32")
            bwd = dict(DY=f"*{dtype}", DH=f"*{dtype}", X=f"*{dtype}", XB=f"*{dtype}", R=f"*{dtype}", W=f"*{dtype}",
                       MEAN="*fp32", RSTD="*fp32", KEY="*i64", DX=f"*{dtype}", DR=f"*{dtype}", PARTS="*fp32",
                       n_rows="i32", tiles="i32", programs="i32", H="i32", stride_x="i32", stride_r="i32",
                       threshold="i32", scale="fp32")
            tried = norm.CANDIDATES if (hidden, dtype) == (1024, "bf16") else {kernel: () for kernel in norm.KERNELS}
            for x_bias, has_bias, store_sum, dropout in itertools.product((0, 1), repeat=4):
                post_ln = (x_bias, has_bias, store_sum, dropout) == (1, 1, 0, 1)
                for tiling in dict.fromkeys((shipped["forward"], *(tried["forward"] if post_ln else ()))):
                    yield ("norm._add_norm_fwd_kernel",
                           f"{dtype} BLOCK_H={block} xbias={x_bias} bias={has_bias} sum={store_sum} dropout={dropout}"
                           + _tiles_said(tiling, shipped["forward"]), fwd,
                           dict(HAS_XBIAS=x_bias, HAS_BIAS=has_bias, STORE_SUM=store_sum, HAS_DROPOUT=dropout,
                                BLOCK_R=tiling.rows, BLOCK_H=block), tiling.warps)
            for has_dh, x_bias, dropout, from_sum in itertools.product((0, 1), repeat=4):
                post_ln = (has_dh, x_bias, dropout, from_sum) == (0, 1, 1, 0)
                for tiling in dict.fromkeys((shipped["backward"], *(tried["backward"] if post_ln else ()))):
                    yield ("norm._add_norm_bwd_kernel",
                           f"{dtype} BLOCK_H={block} dh={has_dh} xbias={x_bias} dropout={dropout} sum={from_sum}"
                           + _tiles_said(tiling, shipped["backward"]), bwd,
                           dict(HAS_DH=has_dh, HAS_XBIAS=x_bias, HAS_DROPOUT=dropout, FROM_SUM=from_sum,
                                BLOCK_R=tiling.rows, BLOCK_H=block), tiling.warps)
    for dtype in ("fp32", "bf16"):
        yield ("launch._sum_parts_kernel", dtype, dict(PARTS="*fp32", SUMS=f"*{dtype}", programs="i32", H="i32"),
               dict(BLOCK_P=launch.SUM_BLOCK_P, BLOCK_H=launch.SUM_BLOCK_H), launch.SUM_WARPS)


def _activation_configs():
    """Each activation kernel at its shipped tiles for narrow rows and a full column block; and bias + GELU's in bf16
    at a full column block (RoBERTa's widths) at every tiling the GPU benchmark times
    (activation.BIAS_GELU_CANDIDATES)."""
    from . import activation, launch

    for columns in (64, 256, launch.COLUMNS_PER_PROGRAM):  # narrow rows, and a full column block (wide rows)
        block_r, block_c, warps = activation.launch_shape(columns)
        shipped = activation.bias_gelu_tiles(columns)
        for dtype in ("fp32", "bf16"):
            sizes = dict(n_rows="i32", n_cols="i32")
            blocks = dict(BLOCK_R=block_r, BLOCK_C=block_c)
            yield ("activation._geglu_fwd_kernel", f"{dtype} BLOCK_C={block_c}",
                   dict(A=f"*{dtype}", Y=f"*{dtype}", **sizes), blocks, warps)
            yield ("activation._geglu_bwd_kernel", f"{dtype} BLOCK_C={block_c}",
                   dict(DY=f"*{dtype}", A=f"*{dtype}", DA=f"*{dtype}", **sizes), blocks, warps)
            tried = (activation.BIAS_GELU_CANDIDATES if (columns, dtype) == (launch.COLUMNS_PER_PROGRAM, "bf16")
                     else {kernel: () for kernel in activation.KERNELS})
            for tiling in dict.fromkeys((shipped["forward"], *tried["forward"])):
                yield ("activation._bias_gelu_fwd_kernel", f"{dtype} BLOCK_C={block_c}"
                       + _tiles_said(tiling, shipped["forward"]), dict(A=f"*{dtype}", B=f"*{dtype}", Y=f"*{dtype}",
                                                                      **sizes),
                       dict(BLOCK_R=tiling.rows, BLOCK_C=block_c), tiling.warps)
            for tiling in dict.fromkeys((shipped["backward"], *tried["backward"])):
                yield ("activation._bias_gelu_bwd_kernel", f"{dtype} BLOCK_C={block_c}"
                       + _tiles_said(tiling, shipped["backward"]),
                       dict(DY=f"*{dtype}", A=f"*{dtype}", B=f"*{dtype}", DA=f"*{dtype}", DB_PART="*fp32", **sizes,
                            tiles="i32"), dict(BLOCK_R=tiling.rows, BLOCK_C=block_c), tiling.warps)


def _projection_configs():
    """The QKV gradient gathering kernel for heads of 32, 64 and 128 at a full column block (base and large widths and
    beyond), and narrow rows: with a bias (RoBERTa's), a rotary (ModernBERT's) or both."""
    from . import projection

    for dtype in ("fp32", "bf16", "fp16"):
        for hidden, head_dim in ((64, 32), (768, 32), (768, 64), (1024, 128)):
            for bias, rotary in ((1, 0), (0, 1), (1, 1)):
                block_r, block_c, warps = projection.launch(hidden)
                d = f"*{dtype}"
                strides = {f"stride_{x}{y}": "i32" for x in ("q", "k", "v") for y in ("r", "h")}
                said = f"{dtype} BLOCK_C={block_c} HEAD_DIM={head_dim}" + " bias" * bias + " rotary" * rotary
                yield ("projection._qkv_grad_kernel", said,
                       dict(DQ=d, DK=d, DV=d, G=d, PARTS="*fp32", COS="*fp32", SIN="*fp32", n_rows="i32",
                            hidden="i32", tiles="i32", **strides),
                       dict(HEAD_DIM=head_dim, BLOCK_R=block_r, BLOCK_C=block_c, HAS_BIAS=bias, ROTARY=rotary), warps)


def _tiles_said(tiling, shipped) -> str:
    """A candidate tiling's part of its configuration's description (nothing for the shipped one)."""
    return "" if tiling == shipped else f" candidate {tiling.rows} rows x {tiling.warps} warps"


def _local_window_configs():
    """Each local-window kernel at its shipped tiles (heads of 32, 64, 128) and, at heads of 64, at every tiling the
    GPU benchmark times (local_window.CANDIDATES)."""
    from . import local_window

    for dtype in ("bf16", "fp16"):
        for head_dim in (32, 64, 128):  # ModernBERT's 64; narrower and wider heads
            shipped = local_window.tiles(head_dim)
            for kernel in local_window.KERNELS:
                tried = local_window.CANDIDATES[kernel] if head_dim == 64 else ()
                for tiling in dict.fromkeys((shipped[kernel], *tried)):
                    yield _local_window_config(kernel, dtype, head_dim, tiling)


# The window the local-window kernels are compiled for: ModernBERT's (128 positions, 64 either side); it sets the rows
# each program's reached-range scan reads (local_window.scan_rows).
LOCAL_WINDOW = 64


def _local_window_config(kernel: str, dtype: str, head_dim: int, tiling):
    """One local-window kernel's configuration: its name, description, signature, constexprs and warps."""
    from . import local_window

    outer_is_keys = kernel == "dkdv"
    blocks = dict(HEAD_DIM=head_dim, BLOCK_M=tiling.inner if outer_is_keys else tiling.outer,
                  BLOCK_N=tiling.outer if outer_is_keys else tiling.inner, WIDEN=0,
                  SCAN=local_window.scan_rows(tiling.outer, LOCAL_WINDOW, tiling.inner), MASK_ALL=0)
    desc = f"{dtype} HEAD_DIM={head_dim} {tiling.outer}x{tiling.inner} warps={tiling.warps} stages={tiling.stages}"
    common = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}")
    if kernel == "forward":
        strides = {f"stride_{x}{y}": "i32" for x in ("q", "k", "v", "o") for y in ("t", "h")}
        return ("local_window._local_fwd_kernel", desc,
                dict(**common, OUT=f"*{dtype}", LSE="*fp32", CU="*i32", POS="*i32", qk_scale="fp32", window="i32",
                     n_heads="i32", **strides), blocks, tiling.warps, tiling.stages)
    strides = {f"stride_{x}{y}": "i32" for x in ("q", "k", "v", "do") for y in ("t", "h")}
    tail = dict(CU="*i32", POS="*i32", qk_scale="fp32", scale="fp32", window="i32", n_heads="i32", **strides)
    if kernel == "dkdv":
        return ("local_window._local_bwd_dkdv_kernel", desc,
                dict(**common, DO=f"*{dtype}", LSE="*fp32", DELTA="*fp32", DK=f"*{dtype}", DV=f"*{dtype}", **tail),
                blocks, tiling.warps, tiling.stages)
    return ("local_window._local_bwd_dq_kernel", desc,
            dict(**common, DO=f"*{dtype}", OUT=f"*{dtype}", LSE="*fp32", DELTA="*fp32", DQ=f"*{dtype}", **tail), blocks,
            tiling.warps, tiling.stages)


def all_configs():
    """Every (kernel, description, signature, constexprs, num_warps[, num_stages]) the launchers can use."""
    yield from _row_configs()
    yield from _mask_configs()
    yield from _ce_configs()
    yield from _rotary_configs()
    yield from _norm_configs()
    yield from _activation_configs()
    yield from _projection_configs()
    yield from _local_window_configs()


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def widest_load_bytes(ptx: str) -> int:
    """The most bytes one global load instruction of a thread reads in `ptx` (ld.global.v4.b32: 16), 0 for none:
    whether a row-wise kernel's loads are vectorized, which is most of how close it comes to the memory's bandwidth."""
    widths = [int(vector or 1) * int(bits) // 8
              for vector, bits in re.findall(r"ld\.global(?:\.[\w:]+?)*?(?:\.v(\d))?\.[bfsu](\d+)\b", ptx)]
    return max(widths, default=0)


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
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", dump))
    registers = int(usage.get("REG", -1))
    return {"kernel": name, "config": desc, "arch": f"sm_{arch}", "num_warps": warps, "registers": registers,
            "resident_warps": resident_warps(registers, warps), "local_bytes": int(usage.get("LOCAL", -1)),
            "stack_bytes": int(usage.get("STACK", -1)), "load_bytes": widest_load_bytes(compiled.asm["ptx"]),
            "shared_bytes": max(int(usage.get("SHARED", 0)), int(compiled.metadata.shared)),
            "shared_limit": SHARED_LIMIT[arch]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_LIMIT))
    parser.add_argument("--json", type=Path, help="write the per-configuration table here")
    parser.add_argument("--markdown", type=Path, help="write a per-kernel summary table here")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--match", help="compile only the configurations whose 'kernel config' matches this regex")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("fastmae.kernels.aot: unset TRITON_INTERPRET (the interpreter cannot compile)", file=sys.stderr)
        return 2
    jobs = [(cfg, arch) for cfg in all_configs() for arch in args.arch
            if not args.match or re.search(args.match, f"{cfg[0]} {cfg[1]}")]
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(compile_one, jobs))
    bad = [r for r in results if failures(r)]
    if args.json:
        table = {"inputs_sha256": inputs_sha256(), "archs": [f"sm_{arch}" for arch in args.arch],
                 "match": args.match, "results": results}
        args.json.write_text(json.dumps(table, indent=1) + "\n")
    worst = {}
    for r in results:
        key = (r["kernel"], r["arch"])
        worst[key] = max(worst.get(key, (0, 0)), (r["registers"], r["shared_bytes"]))
    for (kernel, arch), (regs, shared) in sorted(worst.items()):
        print(f"{kernel:32s} {arch}: max {regs:3d} registers, max {shared:6d} B shared")
    if args.markdown:
        lines = ["# Static GPU resource usage of every kernel configuration", "",
                 "From `python -m fastmae.kernels.aot` (Triton AOT compile + cuobjdump, no GPU needed).", "",
                 "| kernel | arch | configs | registers (min-max) | resident warps / SM (min) | shared bytes (max) "
                 "| spill bytes (max) | widest load, bytes (min-max) |",
                 "|---|---|---|---|---|---|---|---|"]
        for (kernel, arch) in sorted(worst):
            rows = [r for r in results if (r["kernel"], r["arch"]) == (kernel, arch)]
            regs = [r["registers"] for r in rows]
            lines.append(f"| {kernel} | {arch} | {len(rows)} | {min(regs)}-{max(regs)} | "
                         f"{min(r['resident_warps'] for r in rows)} | {max(r['shared_bytes'] for r in rows)} | "
                         f"{max(r['local_bytes'] for r in rows)} | {min(r['load_bytes'] for r in rows)}-"
                         f"{max(r['load_bytes'] for r in rows)} |")
        args.markdown.write_text("\n".join(lines) + "\n")
    print(f"{len(results)} configurations compiled, {len(bad)} with a fault (`failures`)")
    for r in bad:
        print(f"  FAIL {', '.join(failures(r))}: {r}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
