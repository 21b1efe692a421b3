"""FlexAttention for packed varlen streams: the `flex` backend of fastmae.attention (ARCHITECTURE.md section 4).

One long row of packed sequences, padded to whole blocks, with a BlockMask that keeps attention within each sequence
and, for a local layer, within its window of original positions; a relative position bias as a score_mod. Compiled on
CUDA; on CPU torch runs it eagerly and forward only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .streams import VarlenMeta


class FlexAttention(NamedTuple):
    """torch's FlexAttention: create_block_mask, the eager flex_attention and a compiled one."""

    create_block_mask: object
    eager: object
    compiled: object


_flex_attention: FlexAttention | None = None


def flex_attention_api() -> FlexAttention:
    """torch's FlexAttention, imported at first use: the import pulls in dynamo and inductor, 3.5 of the 7.5 s that
    importing the trainer took on a 2-core CPU, in every process of every run that never uses it."""
    global _flex_attention
    if _flex_attention is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        # the compiled one compiles at its first call (CUDA)
        _flex_attention = FlexAttention(create_block_mask, flex_attention, torch.compile(flex_attention, dynamic=True))
    return _flex_attention


FLEX_BLOCK = 128
"""FlexAttention's block of rows (its block mask's default). `flex_varlen` pads every stream to whole blocks and tells
the compiled kernel so (`IS_DIVISIBLE`): compiled for dynamic shapes it cannot know a length is a multiple of the block,
and then bounds-checks every load. Compiled for its static shape, which it then knows, a local layer's forward ran 2.4x
faster on an H200 (benchmarks/results/gpu/NVIDIA_H200/phases.md); how much of that the option gives back is
`benchmarks/local_attention.py`'s to measure on the next GPU."""


def _whole_blocks(x: torch.Tensor, value: float = 0) -> torch.Tensor:
    """`x`'s rows (its first dimension) padded with `value` to whole FLEX_BLOCKs. Traced (train.compile), always
    padded: a branch on the length would recompile for each."""
    fill = -x.shape[0] % FLEX_BLOCK
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, fill), value=value) if fill or torch.compiler.is_compiling() else x


def _flex_rows(meta: VarlenMeta, filler: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stream's sequence ids and positions as FlexAttention sees its rows: padded to whole FLEX_BLOCKs, the filler
    rows in sequence `filler` (negative: none of the stream's) at position 0."""
    return _whole_blocks((meta.padded_index // meta.max_seqlen).to(torch.int32), filler), _whole_blocks(meta.positions)


def document_block_mask(mq: VarlenMeta, mk: VarlenMeta, window: int | None = None, kv_block: int = FLEX_BLOCK):
    """FlexAttention's BlockMask over packed rows padded to whole blocks (`_flex_rows`): query row i sees key row j
    when both are in the same sequence and, with `window`, their original positions are at most `window` apart
    (blocks of 128 x `kv_block` rows that hold no such pair are skipped: a local layer then computes about its
    window's share of the pairs); a filler row sees nothing and is seen by none. `kv_block` must divide FLEX_BLOCK
    (a kernel then needs its BLOCK_N to divide `kv_block`)."""
    (seq_q, pos_q), (seq_k, pos_k) = _flex_rows(mq, -1), _flex_rows(mk, -2)

    def same_sequence(batch, head, q_row, k_row):
        return seq_q[q_row] == seq_k[k_row]

    def within_window(batch, head, q_row, k_row):
        return (seq_q[q_row] == seq_k[k_row]) & ((pos_q[q_row] - pos_k[k_row]).abs() <= window)
    # on CUDA built compiled, block by block: eagerly it evaluates every (row, row) pair of the packed stream at once
    # (16 GiB at 65,536 rows: out of memory on an H100)
    return flex_attention_api().create_block_mask(same_sequence if window is None else within_window, None, None,
                                                  seq_q.numel(), seq_k.numel(), device=seq_q.device,
                                                  BLOCK_SIZE=(FLEX_BLOCK, kv_block), _compile=seq_q.is_cuda)


def flex_varlen(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    """The `flex` backend of `attention.varlen_attention`: q [Tq, heads, D] attends k, v [Tk, heads, D] within each
    packed sequence, `bias` (a StreamBias built for flex) as its block mask and score_mod."""
    if dropout_p:
        raise ValueError("attention backend 'flex' has no attention dropout; use model.attention_dropout 0 or the "
                         "'padded' backend")
    on_cuda = q.device.type == "cuda"
    if not on_cuda and torch.is_grad_enabled() and q.requires_grad:
        raise ValueError(f"attention backend 'flex' runs forward only on {q.device.type} (torch has no FlexAttention "
                         "backward there); use 'padded' to train")
    block_mask = document_block_mask(mq, mk) if bias is None else bias.block_mask
    score_mod = None
    if bias is not None and bias.window is None:  # a window is all in the block mask: no per-score lookup
        pos_q, pos_k = _whole_blocks(mq.positions), _whole_blocks(mk.positions)

        def score_mod(score, batch, head, q_row, k_row):
            return score + bias.lookup(pos_k[k_row] - pos_q[q_row])[head].to(score.dtype)
    rows = q.shape[0]
    # [1, heads, T, D]: one long row of packed sequences, its filler rows zeros (the block mask masks them out)
    rows_first = [_whole_blocks(t).transpose(0, 1)[None] for t in (q, k, v)]
    flex = flex_attention_api()
    if on_cuda:
        out = flex.compiled(*rows_first, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            kernel_options={"IS_DIVISIBLE": True})
    else:  # the unfused reference implementation
        out = flex.eager(*rows_first, score_mod=score_mod, block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1)[:rows]
