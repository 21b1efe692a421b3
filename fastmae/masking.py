"""Masking of a packed batch: host-side counts, device-side selection, and the layouts of the three streams.

Per sequence of n tokens, m of them maskable: predicted = min(round(rate * (n - 2)), m), removed =
round(mask_token_prob * predicted), random = round(random_token_prob * predicted) (capped so removed + random <=
predicted), the rest kept. The rate applies to the length less the sequence's two ends (`<s>`, `</s>`), not to m, so
every sequence of one length gets the same counts whatever document separators it holds, and a micro-batch of
full-length sequences has the same shapes at every step (ARCHITECTURE.md section 2). These counts are computed on the
host from the batch's host counts, so every shape below is known without a device sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from . import kernels, ops
from .attention import VarlenMeta
from .batch import PackedBatch, byte_offsets, pack_bytes, unpack_bytes
from .config import ModelConfig, SpecialTokens
from .kernels import MaskSelection, mask_key
from .positions import rotary_tables


def _round_half_up(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x + 0.5).long()


@dataclass(frozen=True)
class MaskCounts:
    """Host-side [B] int64 counts of one batch's masking."""

    predicted: torch.Tensor
    removed: torch.Tensor
    random: torch.Tensor

    @classmethod
    def compute(cls, counted: torch.Tensor, rate: float, mask_token_prob: float, random_token_prob: float,
                limit: torch.Tensor | None = None) -> MaskCounts:
        """Counts of sequences with `counted` [B] tokens that the rate applies to (predicted capped by `limit`)."""
        predicted = _round_half_up(rate * counted.double())
        if limit is not None:
            predicted = torch.minimum(predicted, limit)
        removed = _round_half_up(mask_token_prob * predicted.double())
        random = torch.minimum(_round_half_up(random_token_prob * predicted.double()), predicted - removed)
        return cls(predicted, removed, random)

    @classmethod
    def for_batch(cls, batch: PackedBatch, rate: float, mask_token_prob: float,
                  random_token_prob: float) -> MaskCounts:
        """The training counts of `batch`: the rate applies to each sequence's length less its two ends, capped by
        its maskable tokens (see the module docstring)."""
        return cls.compute((batch.seqlens - 2).clamp(min=0), rate, mask_token_prob, random_token_prob,
                           limit=batch.num_maskable)


class Filler(NamedTuple):
    """What padding to a fixed shape added to a masked batch (`fastmae.padding`): its last `sequences` sequences
    (filler rows and zero-length sequences), `tokens` rows of them, `predicted` predicted rows among them (their labels
    ignored by the loss) and `removed` removed rows."""

    sequences: int
    tokens: int
    predicted: int
    removed: int


@dataclass
class MaskedBatch:
    """A batch after masking: the selection and the varlen layouts of its streams.

    full: all T rows; visible: the T_v rows the encoder keeps; masked: the T_m predicted rows. On the device a layout
    is built on first use (`mlm` never needs the visible one, only the `cross` decoder the masked one); `to` builds the
    ones the model reads on the host first and moves everything in one copy, so the device computes none of them.
    A batch padded to a fixed shape (`filler` set) lays out every stream with the model's max_seq_len as its longest
    sequence, so its host values are the shape's alone.
    """

    batch: PackedBatch
    counts: MaskCounts
    selection: MaskSelection
    config: ModelConfig
    buffer: torch.Tensor | None = None  # the one uint8 buffer every device tensor views (`viewing`), if there is one
    filler: Filler | None = None  # what padding added (`fastmae.padding.pad`), None when unpadded

    @property
    def num_predicted(self) -> int:
        """Predicted rows whose loss counts (a padded batch's filler rows excluded)."""
        filler = 0 if self.filler is None else self.filler.predicted
        return int(self.selection.masked_index.shape[0]) - filler

    @property
    def num_tokens(self) -> int:
        """Tokens of the batch's own sequences (a padded batch's filler rows excluded)."""
        return self.batch.num_tokens - (0 if self.filler is None else self.filler.tokens)

    def own_sequences(self) -> tuple[torch.Tensor, MaskCounts]:
        """(host lengths [B], counts) of the batch's own sequences, without a padded batch's fillers."""
        own = self.batch.num_sequences - (0 if self.filler is None else self.filler.sequences)
        counts = MaskCounts(*(c[:own] for c in (self.counts.predicted, self.counts.removed, self.counts.random)))
        return self.batch.seqlens[:own], counts

    @property
    def device(self) -> torch.device:
        return self.batch.device

    @functools.cached_property
    def full(self) -> VarlenMeta:
        return self._stream(self.batch.seqlens, None)

    @functools.cached_property
    def visible(self) -> VarlenMeta:
        return self._stream(self.batch.seqlens - self.counts.removed, self.selection.visible_index)

    @functools.cached_property
    def masked(self) -> VarlenMeta:
        return self._stream(self.counts.predicted, self.selection.masked_index)

    def _stream(self, lengths: torch.Tensor, rows: torch.Tensor | None) -> VarlenMeta:
        longest = self.config.max_seq_len if self.filler is not None else max(int(lengths.max()), 1)
        return stream_meta(self.batch, lengths, rows, self.config, longest)

    def layouts_read(self) -> tuple[str, ...]:
        """The stream layouts the model reads for this batch's config: the full stream always (the decoder's, or the
        encoder's when k < L), the visible one when k > 0, the masked one for the `cross` decoder."""
        cfg = self.config
        return ("full",) + (("visible",) if cfg.insert_layer > 0 else ()) + (
            ("masked",) if cfg.decoder_kind == "cross" and cfg.decoder_layers else ())

    def is_packed(self) -> bool:
        """Whether every layout the model reads is built and every device tensor views one buffer (`packed`): then a
        forward builds nothing (a CUDA graph capture cannot hold the host copies a layout is built with)."""
        return self.buffer is not None and all(name in self.__dict__ for name in self.layouts_read())

    def device_tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the batch, its selection and the layouts built so far (rotary tables excepted)."""
        layouts = [self.__dict__[name] for name in ("full", "visible", "masked") if name in self.__dict__]
        return [*self.batch.device_tensors(), *self.selection,
                *(t for meta in layouts for t in (meta.cu_seqlens, meta.padded_index, meta.key_valid, meta.positions))]

    def resident_tensors(self) -> list[torch.Tensor]:
        """`device_tensors()` and the rotary tables made from them: every device tensor the batch holds."""
        layouts = [self.__dict__[name] for name in ("full", "visible", "masked") if name in self.__dict__]
        return self.device_tensors() + [t for meta in layouts if meta.rotary is not None for t in meta.rotary]

    def packed(self, pin_memory: bool = False) -> MaskedBatch:
        """This masking with the layouts the model reads built here and every device tensor a view of one buffer
        (`batch.pack_bytes`; page-locked with `pin_memory`, so that copying it to CUDA is asynchronous)."""
        for name in self.layouts_read():
            getattr(self, name)
        return self.viewing(pack_bytes(self.device_tensors(), pin_memory=pin_memory)[0])

    def to(self, device, non_blocking: bool = False) -> MaskedBatch:
        """This masking on `device` in one copy of its buffer (`packed` first where it has none: the trainer's
        batches are packed ahead by `masked_ahead`); rotary tables are made on `device` from the moved positions."""
        device = torch.device(device)
        if self.device == device:
            return self
        source = self if self.buffer is not None else self.packed(pin_memory=device.type == "cuda")
        return source.viewing(source.buffer.to(device, non_blocking=non_blocking))

    def viewing(self, buffer: torch.Tensor) -> MaskedBatch:
        """This masking with its device tensors read from `buffer` (uint8, laid out as `pack_bytes` lays out
        `device_tensors()`), wherever the buffer is: views of it, and the rotary tables made from its positions. The
        result keeps `buffer`, so its bytes can be copied on in one copy (`to`, `fastmae.graphs`)."""
        layouts = {name: self.__dict__[name] for name in ("full", "visible", "masked") if name in self.__dict__}
        tensors = self.device_tensors()
        moved = iter(unpack_bytes(buffer, tensors, byte_offsets(tensors)[0]))
        batch = replace(self.batch, **{name: next(moved) for name in PackedBatch.DEVICE_FIELDS})
        selection = MaskSelection(*(next(moved) for _ in self.selection))
        out = MaskedBatch(batch=batch, counts=self.counts, selection=selection, config=self.config, buffer=buffer,
                          filler=self.filler)
        for name, meta in layouts.items():
            cu_seqlens, padded_index, key_valid, positions = (next(moved) for _ in range(4))
            rotary = None if meta.rotary is None else rotary_tables(positions, _rotary_dim(self.config),
                                                                    self.config.rotary_base)
            setattr(out, name, VarlenMeta(cu_seqlens, meta.max_seqlen, padded_index, key_valid, positions, rotary,
                                          meta.consecutive))
        return out


def _rotary_dim(config: ModelConfig) -> int:
    return config.head_dim if config.position_embedding == "rotary" else 0


def stream_meta(batch: PackedBatch, lengths: torch.Tensor, rows: torch.Tensor | None, config: ModelConfig,
                max_seqlen: int) -> VarlenMeta:
    """Layout of the sub-stream of `batch` holding `rows` (all rows when None: its rows are consecutive
    positions), `lengths` [B] host counts, none longer than `max_seqlen`."""
    device = batch.device
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu[1:])
    seq_ids = batch.seq_ids if rows is None else batch.seq_ids.index_select(0, rows)
    positions = batch.positions if rows is None else batch.positions.index_select(0, rows)
    return VarlenMeta.build(cu.to(device, non_blocking=True), max_seqlen, seq_ids, positions,
                            _rotary_dim(config), config.rotary_base, consecutive=rows is None)


def mask_rows(batch: PackedBatch, config: ModelConfig, predicted: torch.Tensor) -> MaskedBatch:
    """Mask exactly the rows flagged in `predicted` ([T] bool, on the host), hiding every one of them the same way:
    removed from the encoder's stream (k > 0) or replaced by `<mask>` (k = 0); none kept, none randomised.

    This is evaluation's fixed protocol (fastmae.evaluation chooses the rows); counts and indices are built on the
    host and copied to the batch's device, so nothing is read back.
    """
    if predicted.shape != (batch.num_tokens,) or predicted.dtype != torch.bool or predicted.device.type != "cpu":
        raise ValueError(f"mask_rows: predicted must be a host bool tensor of shape ({batch.num_tokens},)")
    cu = torch.zeros(batch.num_sequences + 1, dtype=torch.int64)
    torch.cumsum(batch.seqlens, 0, out=cu[1:])
    flags = torch.zeros(batch.num_tokens + 1, dtype=torch.int64)
    torch.cumsum(predicted.long(), 0, out=flags[1:])
    per_sequence = flags[cu[1:]] - flags[cu[:-1]]
    counts = MaskCounts(predicted=per_sequence, removed=per_sequence, random=torch.zeros_like(per_sequence))
    device = batch.device
    as_index = lambda rows: rows.nonzero()[:, 0].to(torch.int32).to(device, non_blocking=True)  # noqa: E731
    masked_index, visible_index = as_index(predicted), as_index(~predicted)
    selection = MaskSelection(
        input_tokens=batch.tokens.index_fill(0, masked_index.long(), config.mask_token_id),
        masked_index=masked_index,
        labels=batch.tokens.index_select(0, masked_index),
        visible_index=visible_index,
        removed_index=masked_index,
    )
    return MaskedBatch(batch=batch, counts=counts, selection=selection, config=config)


def unmasked(batch: PackedBatch, config: ModelConfig) -> MaskedBatch:
    """`batch` with nothing masked (the encoder's view when fine-tuning): every row visible, no selection run."""
    device = batch.device
    none = torch.zeros(0, dtype=torch.int32, device=device)
    zeros = torch.zeros_like(batch.seqlens)
    selection = MaskSelection(input_tokens=batch.tokens, masked_index=none, labels=none,
                              visible_index=torch.arange(batch.num_tokens, dtype=torch.int32, device=device),
                              removed_index=none)
    return MaskedBatch(batch=batch, counts=MaskCounts(zeros, zeros, zeros), selection=selection, config=config)


@functools.lru_cache(maxsize=8)
def ordinary_ids(special: SpecialTokens, vocab_size: int, device: torch.device) -> torch.Tensor:
    """`special.ordinary_ids(vocab_size)` on `device`, made once per device (no copy in the training step)."""
    return special.ordinary_ids(vocab_size).to(device)


def mask_batch(batch: PackedBatch, config: ModelConfig, seed: int, step: int, rank: int = 0,
               mask_rate: float | None = None, host: bool = False) -> MaskedBatch:
    """Select the predicted tokens of `batch` for (seed, step, rank) and lay out the streams.

    The selection is a pure function of the batch's tokens and (seed, step, rank): reruns give the same masks;
    another step or data-parallel rank gives others, and the Triton kernel and the plain-torch reference select the
    same rows. `mask_rate` overrides config.mask_rate (evaluation uses 15%). `host`: a host batch masked as host work
    (`masked_ahead`'s thread), by the reference whatever FASTMAE_KERNELS says.
    """
    rate = config.mask_rate if mask_rate is None else mask_rate
    counts = MaskCounts.for_batch(batch, rate, config.mask_token_prob, config.random_token_prob)
    device = batch.device
    special = config.special_tokens
    maskable = torch.ones_like(batch.tokens, dtype=torch.bool)
    for token_id in special.unmaskable:
        maskable &= batch.tokens != token_id
    select = kernels.select_masked_reference if host else ops.select_masked
    selection = select(
        batch.tokens, batch.cu_seqlens, batch.seq_ids, maskable,
        num_removed=counts.removed.to(device, non_blocking=True),
        num_random=counts.random.to(device, non_blocking=True),
        num_predicted=counts.predicted.to(device, non_blocking=True),
        total_predicted=int(counts.predicted.sum()), total_removed=int(counts.removed.sum()),
        score_key=mask_key(seed, step, rank, stream=0), replace_key=mask_key(seed, step, rank, stream=1),
        mask_token_id=special.mask, ordinary_ids=ordinary_ids(special, config.vocab_size, device),
        max_seqlen=batch.max_seqlen,
    )
    return MaskedBatch(batch=batch, counts=counts, selection=selection, config=config)


class _SelectRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_copy_(0, index.long(), grad), None


def select_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for `index` naming distinct rows (a selection, such as the predicted rows): the gradient of each
    selected row is written into zeros (`index_copy_`) where `index_select`'s backward adds it (`index_add_`, on CUDA
    an atomic add per element: 0.22 ms of the H200's base 3ml step at e63392c, 32,768 rows of 65,536)."""
    return _SelectRows.apply(x, index)
