"""The packed varlen batch of DESIGN.md section 2, built on the host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .config import UNMASKABLE_IDS


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated into one stream, never padded.

    Device tensors (moved by `.to`): `tokens` [T] int32, `cu_seqlens` [B+1] int32 (leading 0), `positions` [T] int32
    (index of each token within its sequence), `seq_ids` [T] int32 (sequence of each token).
    Host values (stay on the CPU, so no step reads device memory back): `max_seqlen`, `seqlens` [B] int64,
    `num_maskable` [B] int64 (tokens that may be predicted: everything but pad, bos, eos and mask).
    """

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    seq_ids: torch.Tensor
    max_seqlen: int
    seqlens: torch.Tensor
    num_maskable: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.seqlens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def to(self, device, non_blocking: bool = False) -> PackedBatch:
        """The same batch with its device tensors on `device` (host counts stay on the CPU)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, tokens=move(self.tokens), cu_seqlens=move(self.cu_seqlens),
                       positions=move(self.positions), seq_ids=move(self.seq_ids))

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], vocab_size: int | None = None,
                       device: torch.device | str | None = None) -> PackedBatch:
        """Pack token-id lists (each a non-empty sequence, specials included) into one varlen batch.

        Raises ValueError naming the sequence when it is empty or holds an id outside [0, vocab_size).
        """
        if len(sequences) == 0:
            raise ValueError("PackedBatch.from_sequences: no sequences given")
        arrays = [np.asarray(seq, dtype=np.int64).reshape(-1) for seq in sequences]
        for i, arr in enumerate(arrays):
            if arr.size == 0:
                raise ValueError(f"PackedBatch.from_sequences: sequence {i} is empty")
            low, high = int(arr.min()), int(arr.max())
            if low < 0 or (vocab_size is not None and high >= vocab_size):
                raise ValueError(f"PackedBatch.from_sequences: sequence {i} holds token id "
                                 f"{low if low < 0 else high} outside [0, {vocab_size})")
        return cls.from_packed(np.concatenate(arrays), np.array([a.size for a in arrays]), device=device)

    @classmethod
    def from_packed(cls, tokens: np.ndarray, seqlens: np.ndarray, device=None) -> PackedBatch:
        """Build from an already concatenated id array and its per-sequence lengths (the data loader's path)."""
        seqlens = np.asarray(seqlens, dtype=np.int64)
        tokens = np.asarray(tokens)
        if seqlens.ndim != 1 or seqlens.size == 0 or (seqlens <= 0).any() or seqlens.sum() != tokens.size:
            raise ValueError(f"PackedBatch.from_packed: lengths {seqlens.tolist()[:8]}... do not partition "
                             f"{tokens.size} tokens into non-empty sequences")
        cu = np.zeros(seqlens.size + 1, dtype=np.int64)
        np.cumsum(seqlens, out=cu[1:])
        seq_ids = np.repeat(np.arange(seqlens.size), seqlens)
        positions = np.arange(tokens.size) - cu[seq_ids]
        maskable = ~np.isin(tokens, UNMASKABLE_IDS)
        num_maskable = np.bincount(seq_ids, weights=maskable, minlength=seqlens.size).astype(np.int64)
        as32 = lambda a: torch.from_numpy(a.astype(np.int32)).to(device)  # noqa: E731
        return cls(tokens=as32(tokens), cu_seqlens=as32(cu), positions=as32(positions), seq_ids=as32(seq_ids),
                   max_seqlen=int(seqlens.max()), seqlens=torch.from_numpy(seqlens),
                   num_maskable=torch.from_numpy(num_maskable))
