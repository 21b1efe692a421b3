"""The sequences of a split, held compactly: 2 bytes per sequence (4 past 65,535 tokens) plus 1/64 of that.

Packing (`packing`):
- `full`: RoBERTa FULL-SENTENCES. Each shard is one stream of documents separated by `</s>`, cut into pieces of
  max_seq_len - 2 tokens; a sequence is `<s> piece </s>` and may span documents.
- `doc`: each document is cut into pieces of at most max_seq_len - 2 tokens, none dropped; each piece is its own
  varlen sequence `<s> piece </s>`, so no token attends across documents.
Either way the pieces tile each shard's stream (its tokens, with a `</s>` after every document under `full`), in
file order. So the index keeps only every sequence's length and every 64th sequence's stream offset; where a
sequence starts is that offset plus the lengths of at most 63 sequences before it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import numpy as np

from ..errors import FastmaeError
from .shards import Shard, ShardSet

PACKINGS = ("full", "doc")
STRIDE = 64
"""Every STRIDE-th sequence's stream offset is stored; the others are summed from the lengths before them."""


def piece_lengths(document_lengths: np.ndarray, body: int, packing: str) -> np.ndarray:
    """Body lengths (without `<s>`/`</s>`) of the pieces one shard's documents are cut into, in file order."""
    if packing == "full":
        stream = int(document_lengths.sum()) + len(document_lengths)  # a </s> after every document
        pieces = np.full(-(-stream // body), body, dtype=np.int64)
        if stream % body:
            pieces[-1] = stream % body
        return pieces
    lengths = document_lengths[document_lengths > 0]
    count = -(-lengths // body)  # pieces per document
    last = lengths - (count - 1) * body
    pieces = np.full(int(count.sum()), body, dtype=np.int64)
    pieces[np.cumsum(count) - 1] = last
    return pieces


class SequenceIndex:
    """Lengths and stream positions of every sequence of a split (ids in file order), and their tokens."""

    def __init__(self, shard_document_lengths: Iterable[np.ndarray], max_seq_len: int, packing: str):
        if packing not in PACKINGS:
            raise FastmaeError(f"packing {packing!r}: choose one of {PACKINGS}")
        if max_seq_len < 3:
            raise FastmaeError(f"max_seq_len {max_seq_len}: must leave room for <s>, a token and </s>")
        self.max_seq_len, self.packing = max_seq_len, packing
        body = max_seq_len - 2
        dtype = np.uint16 if max_seq_len < 2**16 else np.uint32
        lengths, stream_starts = [], [0]
        for document_lengths in shard_document_lengths:
            pieces = piece_lengths(np.asarray(document_lengths, dtype=np.int64), body, packing)
            lengths.append((pieces + 2).astype(dtype))
            stream_starts.append(stream_starts[-1] + int(pieces.sum()))
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=dtype)
        """[n] tokens of each sequence, `<s>` and `</s>` included."""
        self.shard_starts = np.array(stream_starts, dtype=np.int64)
        """[shards + 1] where each shard's stream begins in the concatenation of all shards' streams."""
        blocks = self.lengths[:(len(self.lengths) // STRIDE) * STRIDE].reshape(-1, STRIDE)
        self.coarse = np.concatenate(([0], np.cumsum(blocks.sum(axis=1, dtype=np.int64) - 2 * STRIDE)))
        """[n // STRIDE + 1] stream offset of sequence STRIDE * k."""

    @classmethod
    def of(cls, data: ShardSet, max_seq_len: int, packing: str) -> SequenceIndex:
        return cls((np.diff(shard.offsets) for shard in data.shards), max_seq_len, packing)

    def __len__(self) -> int:
        return len(self.lengths)

    def stream_spans(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, start, stop) of each sequence's body in its shard's stream."""
        ids = np.asarray(ids, dtype=np.int64)
        block, within = np.divmod(ids, STRIDE)
        before = block[:, None] * STRIDE + np.arange(STRIDE)  # the sequences of each id's block
        inside = np.arange(STRIDE) < within[:, None]
        bodies = self.lengths[np.minimum(before, len(self.lengths) - 1)].astype(np.int64) - 2
        start = self.coarse[block] + np.where(inside, bodies, 0).sum(axis=1)
        shard = np.searchsorted(self.shard_starts, start, side="right") - 1
        local = start - self.shard_starts[shard]
        return shard, local, local + self.lengths[ids].astype(np.int64) - 2

    def tokens_of(self, data: ShardSet, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated token ids (with `<s>` ... `</s>`) and lengths of sequences `ids` of `data` (the shard set
        this index was built from), whatever their order."""
        bodies, special = [], data.special_tokens
        for s, start, stop in zip(*(a.tolist() for a in self.stream_spans(ids))):
            shard = data.shards[s]
            if self.packing == "doc":
                body = np.asarray(shard.tokens[start:stop], dtype=np.int64)
            else:
                body = _full_body(shard, start, stop, special.eos)
            bodies.append(np.concatenate(([special.bos], body, [special.eos])))
        return np.concatenate(bodies), np.array([len(b) for b in bodies], dtype=np.int64)


def _full_body(shard: Shard, start: int, stop: int, eos: int) -> np.ndarray:
    """Tokens of stream positions [start, stop) of a `full`-packed shard: document d's tokens occupy stream positions
    offsets[d] + d onwards, followed by its `</s>` (id `eos`)."""
    offsets = shard.offsets
    first = bisect.bisect_right(range(len(offsets)), start, key=lambda d: offsets[d] + d) - 1
    window = offsets[first:first + stop - start + 2]  # each document takes at least one stream position
    stream_offsets = window + np.arange(first, first + len(window))
    positions = np.arange(start, stop)
    doc = np.searchsorted(stream_offsets, positions, side="right") - 1
    local = positions - stream_offsets[doc]
    is_separator = local == window[doc + 1] - window[doc]
    token_index = np.minimum(window[doc] + local, max(shard.num_tokens - 1, 0))
    return np.where(is_separator, eos, np.asarray(shard.tokens[token_index], dtype=np.int64))
