"""Static shapes for `doc` packing: masked micro-batches padded to a few fixed shapes (ARCHITECTURE.md section 2).

Under `doc` packing a micro-batch's rows, sequences and mask counts follow its documents' lengths, so no two
micro-batches need share a shape and a recorded CUDA graph (fastmae/graphs.py) would serve none but its own. Padding
gives every micro-batch one of a short ladder of shapes, indexed by a sequence capacity B_cap: T_pad rows, B_cap
sequences, P_cap predicted rows and R_cap removed rows. The batch is masked first, exactly as it would be unpadded
(the same rows, the same losses), then filled up after its own rows:

    rows     its T rows, then T_pad - T filler rows (`<pad>`) in filler sequences of at most max_seq_len rows each,
             then zero-length sequences up to B_cap (empty entries of `cu_seqlens`, which varlen attention skips)
    masks    the first P_cap - P filler rows are predicted with the ignored label (the loss neither counts nor learns
             from them), the first R_cap - R filler rows removed; every other filler row is visible

Filler rows attend only to their own sequence, so the batch's own rows compute what they compute unpadded. The caps
bound every micro-batch of at most `tokens_per_batch` rows and B_cap sequences whose maskable tokens do not cap its
counts; the T_pad - tokens_per_batch spare rows (3 x B_cap, rounded up to a multiple of 64) leave room for the
dummy rows. A batch that fits no shape (one whose documents hold many special tokens) stays unpadded and runs
eagerly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .batch import PackedBatch
from .config import ModelConfig, RunConfig
from .kernels import MaskSelection
from .masking import Filler, MaskCounts, MaskedBatch

IGNORED_LABEL = -100
"""The label of a filler's predicted rows: `linear_cross_entropy`'s ignore_index."""
ROW_MULTIPLE = 64  # T_pad is rounded up to a multiple: the GEMMs' row counts stay aligned


class PaddedShape(NamedTuple):
    """One shape of the ladder: rows, sequences (zero-length ones included), predicted rows and removed rows."""

    tokens: int
    sequences: int
    predicted: int
    removed: int


MAX_RUNGS = 3
"""Rungs of a ladder: sequence capacities b0, 2 b0, 4 b0."""


class ShapeLadder:
    """The shapes micro-batches of at most `tokens_per_batch` rows are padded to under `config`'s masking: sequence
    capacities B_cap = b0, 2 b0, 4 b0 from b0 = ceil(tokens_per_batch / max_seq_len) + 2 (full-length pieces and
    two fillers), and no more than the most sequences such a micro-batch can hold (3 rows each). The ladder stops at
    4 b0 (`MAX_RUNGS`): a batch of more, shorter documents stays unpadded and runs eagerly, because the
    top rungs would hand the attention kernels tens of thousands of zero-length sequences (43,692 at 131,072 tokens),
    which neither flash-attn's nor torch's varlen backward has run over."""

    def __init__(self, config: ModelConfig, tokens_per_batch: int):
        self.config, self.tokens_per_batch = config, tokens_per_batch
        rate, share = config.mask_rate, config.mask_token_prob
        capacity = math.ceil(tokens_per_batch / config.max_seq_len) + 2
        shapes = []
        while True:
            # P <= sum(rate (n_i - 2) + 1/2) = rate T + (1/2 - 2 rate) B; R <= sum(share P_i + 1/2) <= share P + B / 2
            predicted = math.floor(rate * tokens_per_batch + max(0.0, 0.5 - 2 * rate) * capacity)
            removed = min(predicted, math.floor(share * predicted + capacity / 2))
            tokens = -(-(tokens_per_batch + 3 * capacity) // ROW_MULTIPLE) * ROW_MULTIPLE
            shapes.append(PaddedShape(tokens, capacity, predicted, removed))
            if capacity >= tokens_per_batch // 3 + 2 or len(shapes) == MAX_RUNGS:
                break
            capacity *= 2
        self.shapes: tuple[PaddedShape, ...] = tuple(shapes)
        self._by_rate: dict[float, ShapeLadder] = {}

    @classmethod
    def for_run(cls, config: RunConfig) -> ShapeLadder:
        return cls(config.model, config.data.tokens_per_micro_batch)

    def at_rate(self, rate: float) -> ShapeLadder:
        """The ladder of micro-batches masked at `rate` (a masking-rate schedule's step): the caps follow the rate,
        so each rate of a run has its own few shapes."""
        if rate == self.config.mask_rate:
            return self
        if rate not in self._by_rate:
            self._by_rate[rate] = ShapeLadder(self.config.replace(mask_rate=rate, mask_rate_end=-1.0),
                                              self.tokens_per_batch)
        return self._by_rate[rate]

    def shape_for(self, masked: MaskedBatch) -> PaddedShape | None:
        """The smallest shape `masked` (unpadded) fits, or None."""
        rows, sequences = masked.batch.num_tokens, masked.batch.num_sequences
        predicted, removed = masked.num_predicted, int(masked.selection.removed_index.shape[0])
        for shape in self.shapes:
            spare = shape.tokens - rows
            fits = (spare >= 0 and sequences + _fillers(spare, self.config.max_seq_len) <= shape.sequences
                    and 0 <= shape.predicted - predicted <= spare and 0 <= shape.removed - removed <= spare)
            if fits:
                return shape
        return None

    def pad(self, masked: MaskedBatch) -> MaskedBatch:
        """`masked` padded to the smallest shape it fits (`pad`), or as it is when it fits none."""
        shape = self.shape_for(masked)
        return masked if shape is None else pad(masked, shape)


def _fillers(rows: int, max_seq_len: int) -> int:
    return -(-rows // max_seq_len)


def pad(masked: MaskedBatch, shape: PaddedShape) -> MaskedBatch:
    """`masked` (unpadded, on the host) filled up to `shape` as the module docstring lays out. Raises ValueError when
    it does not fit (`ShapeLadder.shape_for` says which shape it fits)."""
    batch, selection, counts, config = masked.batch, masked.selection, masked.counts, masked.config
    if masked.filler is not None or batch.device.type != "cpu":
        raise ValueError("pad: takes an unpadded masked batch on the host")
    rows, own = batch.num_tokens, batch.num_sequences
    spare = shape.tokens - rows
    dummy_predicted = shape.predicted - masked.num_predicted
    dummy_removed = shape.removed - int(selection.removed_index.shape[0])
    lengths = torch.full((_fillers(spare, config.max_seq_len),), config.max_seq_len, dtype=torch.int64)
    if spare % config.max_seq_len:
        lengths[-1] = spare % config.max_seq_len
    zero_length = shape.sequences - own - lengths.numel()
    if min(spare, dummy_predicted, dummy_removed, zero_length) < 0 or max(dummy_predicted, dummy_removed) > spare:
        raise ValueError(f"pad: a batch of {rows} rows, {own} sequences, {masked.num_predicted} predicted and "
                         f"{selection.removed_index.shape[0]} removed rows does not fit {shape}")

    starts = torch.cumsum(lengths, 0) - lengths  # of each filler sequence, in filler rows
    filler_rows = torch.arange(spare)
    filler_sequence = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)

    def first_rows_per_filler(count: int) -> torch.Tensor:
        """How many of the first `count` filler rows each filler sequence holds."""
        return (count - starts).clamp(min=0).minimum(lengths)

    none = torch.zeros(zero_length, dtype=torch.int64)
    seqlens = torch.cat([batch.seqlens, lengths, none])
    cu_seqlens = torch.zeros(shape.sequences + 1, dtype=torch.int32)
    torch.cumsum(seqlens, 0, out=cu_seqlens[1:])
    padded_batch = PackedBatch(
        tokens=_extended(batch.tokens, torch.full((spare,), config.pad_token_id)),
        cu_seqlens=cu_seqlens,
        positions=_extended(batch.positions, filler_rows - starts[filler_sequence]),
        seq_ids=_extended(batch.seq_ids, own + filler_sequence),
        max_seqlen=config.max_seq_len,
        seqlens=seqlens,
        num_maskable=torch.cat([batch.num_maskable, torch.zeros(shape.sequences - own, dtype=torch.int64)]),
        dataset_ids=batch.dataset_ids, index=batch.index)
    padded_counts = MaskCounts(
        predicted=torch.cat([counts.predicted, first_rows_per_filler(dummy_predicted), none]),
        removed=torch.cat([counts.removed, first_rows_per_filler(dummy_removed), none]),
        random=torch.cat([counts.random, torch.zeros(shape.sequences - own, dtype=torch.int64)]))
    padded_selection = MaskSelection(
        input_tokens=_extended(selection.input_tokens, torch.full((spare,), config.pad_token_id)),
        masked_index=_extended(selection.masked_index, rows + filler_rows[:dummy_predicted]),
        labels=_extended(selection.labels, torch.full((dummy_predicted,), IGNORED_LABEL)),
        visible_index=_extended(selection.visible_index, rows + filler_rows[dummy_removed:]),
        removed_index=_extended(selection.removed_index, rows + filler_rows[:dummy_removed]))
    return MaskedBatch(batch=padded_batch, counts=padded_counts, selection=padded_selection, config=config,
                       filler=Filler(shape.sequences - own, spare, dummy_predicted, dummy_removed))


def _extended(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    return torch.cat([head, tail.to(head.dtype)])
