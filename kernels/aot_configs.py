"""What the static GPU check (kernels/aot.py) compiles: every launch configuration of every kernel, as (kernel,
description, signature, constexprs, num_warps[, num_stages]), from the launchers' own choices (tiles, blocks, flags)
and the candidates the GPU benchmarks time.
"""

from __future__ import annotations

import itertools


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
        block, warps = launch.row_launch_config(hidden_block)
        for combo, (src_idx, gathered, fill, pos, norm, dst) in combos.items():
            for dtype, dropout in itertools.product(("fp32", "bf16"), (0, 1)):  # the dropout after the op, or none
                flags = dict(SRC_INDEXED=src_idx, HAS_FILL=fill, HAS_POS=pos, HAS_NORM=norm, DST_INDEXED=dst,
                             HAS_DROPOUT=dropout, BLOCK_H=block)
                said = f"{combo}{' +dropout' * dropout} {dtype} BLOCK_H={block}"
                d = ptr[dtype]
                fwd = dict(SRC=d, src_ids="*i32", gather_index="*i32", FILL=d, POS="*fp32", pos_ids="*i32",
                           W="*fp32", B="*fp32", OUT=d, dst_index="*i32", fill_index="*i32", MEAN="*fp32",
                           RSTD="*fp32", SRC_ROWS="*i32", POS_ROWS="*i32", KEY="*i64", num_src_rows="i32", H="i32",
                           stride_src="i32", stride_pos="i32", stride_out="i32", pos_offset="i32", eps="fp32",
                           threshold="i32", scale="fp32")
                yield "rows._rows_fwd_kernel", said, fwd, {**flags, "GATHERED": gathered}, warps
                if gathered:
                    continue
                bwd = dict(DOUT=d, dst_index="*i32", fill_index="*i32", SRC=d, SRC_ROWS="*i32", FILL=d, POS="*fp32",
                           POS_ROWS="*i32", W="*fp32", MEAN="*fp32", RSTD="*fp32", DPRE=d, DW_PART="*fp32",
                           DB_PART="*fp32", DFILL_PART="*fp32", KEY="*i64", n_rows="i32", num_src_rows="i32",
                           H="i32", stride_dout="i32", stride_src="i32", stride_pos="i32", threshold="i32",
                           scale="fp32")
                yield ("rows._rows_bwd_kernel", said, bwd, {**flags, "ROWS_PER_PROGRAM": rows.ROWS_PER_PROGRAM},
                       warps)


def _table_grad_configs():
    """Both table-gradient kernels at every row width, for a gradient in each table dtype from rows in that dtype
    (the row ops' backward writes them in the source's) and in fp32, with and without the extra row, written or
    added into a given gradient (ACCUMULATE: the token table's under flat parameters, the tied head's handed to it)
    (the sorted ids int32, as the row ops keep them; torch's sort's order int64)."""
    from . import launch, table_grad

    for hidden_block in [2**k for k in range(6, launch.MAX_HIDDEN.bit_length())]:
        block, warps = launch.row_launch_config(hidden_block)
        block_k, carry_warps = table_grad.carry_config(hidden_block)
        constexprs = dict(R=table_grad.ROWS_PER_PROGRAM, BLOCK_H=block)
        for dtype in ("fp32", "bf16", "fp16"):
            for accumulate in (0, 1):
                added = " added" * accumulate
                for rows, extra in itertools.product(dict.fromkeys((dtype, "fp32")), (0, 1)):
                    sums = dict(ROWS=f"*{rows}", EXTRA=f"*{dtype}", SID="*i32", ORDER="*i64", GRAD=f"*{dtype}",
                                HEAD="*fp32", TAIL="*fp32", n_rows="i32", n_ids="i32", H="i32", stride_rows="i32",
                                stride_grad="i32")
                    said = f"{dtype} from {rows} rows BLOCK_H={block}" + " extra row" * extra + added
                    yield ("table_grad._segment_sums_kernel", said, sums,
                           {**constexprs, "HAS_EXTRA": extra, "ACCUMULATE": accumulate}, warps)
                carry = dict(SID="*i32", GRAD=f"*{dtype}", HEAD="*fp32", TAIL="*fp32", n_ids="i32",
                             n_programs="i32", H="i32", stride_grad="i32")
                yield ("table_grad._segment_carry_kernel", f"{dtype} BLOCK_H={block}" + added, carry,
                       {**constexprs, "BLOCK_K": block_k, "ACCUMULATE": accumulate}, carry_warps)


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
                sig = dict(LOGITS=f"*{dtype}", stride_logits="i32", LABELS="*i32", LOSS="*fp32", ROW_MAX="*fp32",
                           ROW_SCALE="*fp32", V="i32", ignore_index="i32", smoothing="fp32", z_loss="fp32")
                yield ("cross_entropy._ce_rows_kernel", f"{dtype} BLOCK_V={block} grad={grad}", sig,
                       dict(COMPUTE_GRAD=grad, BLOCK_V=block), cross_entropy.CE_NUM_WARPS)
            if block > cross_entropy.CE_GRAD_BLOCK_V:
                continue
            for has_bias in (0, 1):
                sig = dict(LOGITS=f"*{dtype}", stride_logits="i32", LABELS="*i32", ROW_MAX="*fp32",
                           ROW_SCALE="*fp32", BIAS_PARTS="*fp32", n_rows="i32", V="i32", group_rows="i32",
                           ignore_index="i32", smoothing="fp32")
                yield ("cross_entropy._ce_grad_kernel", f"{dtype} BLOCK_V={block} bias={has_bias}", sig,
                       dict(HAS_BIAS=has_bias, BLOCK_R=cross_entropy.CE_GRAD_BLOCK_R, BLOCK_V=block),
                       cross_entropy.CE_GRAD_WARPS)
    for src, dst in (("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "bf16"), ("bf16", "fp32")):  # grad_w, grad_x
        sig = dict(SRC=f"*{src}", DST=f"*{dst}", FACTOR="*fp32", n_elements="i32")
        yield ("cross_entropy._scale_kernel", f"{src} -> {dst}", sig, dict(BLOCK=cross_entropy.SCALE_BLOCK),
               cross_entropy.SCALE_WARPS)


def _rotary_configs():
    from . import launch

    for dtype in ("fp32", "bf16", "fp16"):
        for block in (256, 512, 1024):  # heads x head_dim / 2 up to base (384) and large (512) widths, and beyond
            sig = dict(Q=f"*{dtype}", K=f"*{dtype}", Q_OUT=f"*{dtype}", K_OUT=f"*{dtype}", COS_Q="*fp32",
                       SIN_Q="*fp32", COS_K="*fp32", SIN_K="*fp32", rows_q="i32", rows_k="i32", stride_q_row="i32",
                       stride_q_head="i32", stride_k_row="i32", stride_k_head="i32", heads="i32", half="i32",
                       sign="fp32")
            block_r, warps, _ = launch.tile_launch(block)
            yield ("rotary._rotary_kernel", f"{dtype} BLOCK={block}", sig, dict(BLOCK_R=block_r, BLOCK=block), warps)


# The norm kernels' flags (what a configuration's description says, the constexpr): every combination is compiled,
# and the candidate tilings at RoBERTa's post-LN with dropout and the projection's bias (the values after each).
NORM_FORWARD_FLAGS = (("xbias", "HAS_XBIAS"), ("bias", "HAS_BIAS"), ("sum", "STORE_SUM"), ("dropout", "HAS_DROPOUT"))
NORM_BACKWARD_FLAGS = (("dh", "HAS_DH"), ("xbias", "HAS_XBIAS"), ("dropout", "HAS_DROPOUT"), ("sum", "FROM_SUM"))
# The flag values `norm.layer_norm` (no residual) launches each kernel with: with or without a bias forward; the
# backward reading x as the sum.
NORM_WITHOUT_RESIDUAL = {"forward": ((0, 0, 0, 0), (0, 1, 0, 0)), "backward": ((0, 0, 0, 1),)}


def _norm_configs():
    """Each norm kernel at its shipped tiles, every flag, at four widths; and at RoBERTa-base's (768: three chunks of
    256 lanes) in bf16, post-LN with dropout and the projection's bias, at every tiling the GPU benchmark times
    (norm.CANDIDATES)."""
    from . import launch, norm

    for hidden in (64, 768, 1024, launch.MAX_HIDDEN):  # the smallest row, base and large models', the largest
        chunks, block = norm.row_chunks(hidden)  # the kernels' CHUNKS and BLOCK_H
        shipped = norm.tiles(hidden)
        for dtype in ("fp32", "bf16"):
            fwd = dict(X=f"*{dtype}", XB=f"*{dtype}", R=f"*{dtype}", W=f"*{dtype}", B=f"*{dtype}", Y=f"*{dtype}",
                       H_OUT=f"*{dtype}", MEAN="*fp32", RSTD="*fp32", KEY="*i64", n_rows="i32", H="i32",
                       stride_x="i32", stride_r="i32", eps="fp32", threshold="i32", scale="fp32")
            bwd = dict(DY=f"*{dtype}", DH=f"*{dtype}", X=f"*{dtype}", XB=f"*{dtype}", R=f"*{dtype}", W=f"*{dtype}",
                       MEAN="*fp32", RSTD="*fp32", KEY="*i64", DX=f"*{dtype}", DR=f"*{dtype}", PARTS="*fp32",
                       n_rows="i32", tiles="i32", programs="i32", H="i32", stride_x="i32", stride_r="i32",
                       threshold="i32", scale="fp32")
            tried = norm.CANDIDATES if (hidden, dtype) == (768, "bf16") else {kernel: () for kernel in norm.KERNELS}
            for kernel, name, sig, flags, post_ln in (
                    ("forward", "norm._add_norm_fwd_kernel", fwd, NORM_FORWARD_FLAGS, (1, 1, 0, 1)),
                    ("backward", "norm._add_norm_bwd_kernel", bwd, NORM_BACKWARD_FLAGS, (0, 1, 1, 0))):
                for values in itertools.product((0, 1), repeat=len(flags)):
                    # with a residual, every flag set; without one (`norm.layer_norm`), the flags it launches with
                    for residual in (1, 0) if values in NORM_WITHOUT_RESIDUAL[kernel] else (1,):
                        for tiling in dict.fromkeys((shipped[kernel], *(tried[kernel] if values == post_ln and
                                                                          residual else ()))):
                            said = " ".join(f"{short}={value}" for (short, _), value in zip(flags, values))
                            yield (name, f"{dtype} BLOCK_H={block}" + (f" CHUNKS={chunks}" if chunks > 1 else "")
                                   + f" {said}" + " residual=0" * (not residual)
                                   + _tiles_said(tiling, shipped[kernel]), sig,
                                   {**{flag: value for (_, flag), value in zip(flags, values)},
                                    "HAS_RESIDUAL": residual, "BLOCK_R": tiling.rows, "BLOCK_H": block,
                                    "CHUNKS": chunks}, tiling.warps)
    for dtype in ("fp32", "bf16"):
        for block_p in [2**k for k in range(launch.SUM_MAX_BLOCK_P.bit_length())]:  # rows up to MAX_HIDDEN wide
            block_h = launch.sum_tile(block_p, launch.MAX_HIDDEN)[1]
            entries = {f"{arg}{entry}": kind for entry in range(launch.SUM_ENTRIES) for arg, kind in (
                ("PARTS", "*fp32"), ("SUMS", f"*{dtype}"), ("count", "i32"), ("programs", "i32"), ("H", "i32"))}
            yield ("launch._sum_parts_kernel", f"{dtype} BLOCK_P={block_p} BLOCK_H={block_h}", entries,
                   dict(BLOCK_P=block_p, BLOCK_H=block_h), launch.SUM_WARPS)


def _activation_configs():
    """Each activation kernel at its shipped tiles for narrow rows and a full column block; and bias + GELU's in bf16
    at a full column block (RoBERTa's widths) at every tiling the GPU benchmark times
    (activation.BIAS_GELU_CANDIDATES)."""
    from . import activation, launch

    # narrow rows, ModernBERT-base's GeGLU (1,152: blocks of 128), and a full column block (wide rows)
    for columns in (64, 256, 1152, launch.COLUMNS_PER_PROGRAM):
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
                            tiles="i32"), dict(PREFETCH=int(tiling.prefetch), BLOCK_R=tiling.rows, BLOCK_C=block_c),
                       tiling.warps)


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
    if tiling == shipped:
        return ""
    return f" candidate {tiling.rows} rows x {tiling.warps} warps" + (" prefetch" if tiling.prefetch else "")


def _local_window_configs():
    """Each local-window kernel at its shipped tiles (heads of 32, 64, 128) and, at heads of 64, at every tiling the
    GPU benchmark times (local_window.CANDIDATES) and with every block masked (its form of what the unmasked blocks
    save)."""
    from . import local_window

    for dtype in ("bf16", "fp16"):
        for head_dim in (32, 64, 128):  # ModernBERT's 64; narrower and wider heads
            shipped = local_window.tiles(head_dim)
            for kernel in local_window.KERNELS:
                tried = local_window.CANDIDATES[kernel] if head_dim == 64 else ()
                for tiling in dict.fromkeys((shipped[kernel], *tried)):
                    yield _local_window_config(kernel, dtype, head_dim, tiling)
                if head_dim == 64:
                    yield _local_window_config(kernel, dtype, head_dim, shipped[kernel], mask_all=True)


# The window the local-window kernels are compiled for: ModernBERT's (128 positions, 64 either side); it sets the rows
# each program's reached-range scan reads (local_window.scan_rows).
LOCAL_WINDOW = 64


def _local_window_config(kernel: str, dtype: str, head_dim: int, tiling, mask_all: bool = False):
    """One local-window kernel's configuration: its name, description, signature, constexprs and warps."""
    from . import local_window

    backward = kernel == "backward"  # its outer block holds keys, and its programs take spans of them
    blocks = dict(HEAD_DIM=head_dim, BLOCK_M=tiling.inner if backward else tiling.outer,
                  BLOCK_N=tiling.outer if backward else tiling.inner, **({"SPAN": tiling.span} if backward else {}),
                  WIDEN=0, SCAN=local_window.scan_rows(tiling.outer, LOCAL_WINDOW, tiling.inner),
                  MASK_ALL=int(mask_all))
    desc = (f"{dtype} HEAD_DIM={head_dim} {tiling.outer}x{tiling.inner} warps={tiling.warps} stages={tiling.stages}"
            + f" span={tiling.span}" * backward + " every block masked" * mask_all)
    common = dict(Q=f"*{dtype}", K=f"*{dtype}", V=f"*{dtype}")
    if kernel == "forward":
        strides = {f"stride_{x}{y}": "i32" for x in ("q", "k", "v", "o") for y in ("t", "h")}
        return ("local_window._local_fwd_kernel", desc,
                dict(**common, OUT=f"*{dtype}", LSE="*fp32", CU="*i32", POS="*i32", qk_scale="fp32", window="i32",
                     n_heads="i32", **strides), blocks, tiling.warps, tiling.stages)
    strides = {f"stride_{x}{y}": "i32" for x in ("q", "k", "v", "do") for y in ("t", "h")}
    return ("local_window._local_bwd_kernel", desc,
            dict(**common, DO=f"*{dtype}", OUT=f"*{dtype}", LSE="*fp32", DQ_SUM="*fp32", DQ=f"*{dtype}",
                 DK=f"*{dtype}", DV=f"*{dtype}", CU="*i32", POS="*i32", qk_scale="fp32", scale="fp32", window="i32",
                 n_heads="i32", **strides), blocks, tiling.warps, tiling.stages)


def all_configs():
    """Every (kernel, description, signature, constexprs, num_warps[, num_stages]) the launchers can use."""
    yield from _row_configs()
    yield from _table_grad_configs()
    yield from _mask_configs()
    yield from _ce_configs()
    yield from _rotary_configs()
    yield from _norm_configs()
    yield from _activation_configs()
    yield from _projection_configs()
    yield from _local_window_configs()
