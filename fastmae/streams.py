"""The layout of a packed varlen stream (ARCHITECTURE.md section 4): what every attention backend reads, at the bottom
of them so that none imports another to know it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .positions import rotary_tables


class VarlenMeta(NamedTuple):
    """Layout of one packed stream, built once per step and shared by every layer that runs on it.

    cu_seqlens [B+1] int32 and max_seqlen (host int) as flash-attn takes them; padded_index [T] int64, the row of
    each token in a [B * max_seqlen] padded view; key_valid [B, max_seqlen] bool; positions [T], the original
    position id of each token (for rotary); rotary: (cos, sin) [T, head_dim / 2] fp32 or None; consecutive (host
    bool, known where the stream is made): each sequence's rows are consecutive positions (no row was dropped), so a
    window of positions is a window of rows.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    padded_index: torch.Tensor
    key_valid: torch.Tensor
    positions: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    consecutive: bool = False

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def is_rectangular(self) -> bool:
        """Every sequence has max_seqlen rows (known from shapes, no device read): the padded view is a plain view."""
        return self.padded_index.shape[0] == self.num_sequences * self.max_seqlen

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, max_seqlen: int, seq_ids: torch.Tensor, positions: torch.Tensor,
              rotary_dim: int = 0, rotary_base: float = 10000.0, consecutive: bool = False) -> VarlenMeta:
        """Metadata of a stream given its boundaries, the sequence of each row and the rows' original positions
        (`consecutive`: each sequence's rows are consecutive positions)."""
        seq = seq_ids.long()
        row_in_seq = torch.arange(seq.numel(), device=seq.device) - cu_seqlens.long()[seq]
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        key_valid = torch.arange(max_seqlen, device=seq.device)[None, :] < lengths[:, None]
        rotary = rotary_tables(positions, rotary_dim, rotary_base) if rotary_dim else None
        return cls(cu_seqlens, max_seqlen, seq * max_seqlen + row_in_seq, key_valid, positions, rotary, consecutive)
