"""The packed varlen loader: sequences from the shards, micro-batches by token budget, exact resume.

Packing (`packing`):
- `full`: RoBERTa FULL-SENTENCES. Each shard is one stream of documents separated by `</s>`, cut into pieces of
  max_seq_len - 2 tokens; a sequence is `<s> piece </s>` and may span documents.
- `doc`: each document is cut into pieces of at most max_seq_len - 2 tokens, none dropped; each piece is its own
  varlen sequence `<s> piece </s>`, so no token attends across documents.
Each epoch shuffles the sequences with (seed, epoch), cuts them greedily into micro-batches of at most
`tokens_per_batch` tokens, and deals the micro-batches round-robin to the data-parallel ranks (every rank gets the
same number; the remainder is dropped). The cursor (epoch, micro-batch) is the whole state: `load_state_dict`
continues the exact stream without replaying it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..batch import PackedBatch
from ..config import BOS_ID, EOS_ID
from ..errors import FastmaeError
from .shards import ShardSet

if TYPE_CHECKING:
    from ..config import RunConfig

PACKINGS = ("full", "doc")


def cut_by_budget(lengths: np.ndarray, budget: int) -> list[slice]:
    """Greedy cut of consecutive sequences of `lengths` into runs of at most `budget` tokens (a longer sequence
    gets a run of its own). Host-side, over sequences, not tokens."""
    parts, begin, used = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        if used + length > budget and i > begin:
            parts.append(slice(begin, i))
            begin, used = i, 0
        used += length
    parts.append(slice(begin, len(lengths)))
    return parts


class PackedLoader:
    """Endless iterator of host-side `PackedBatch`es for one data-parallel rank."""

    def __init__(self, data_dir: str | Path, split: str = "train", max_seq_len: int = 512, packing: str = "full",
                 tokens_per_batch: int = 8192, rank: int = 0, world_size: int = 1, seed: int = 0,
                 verify_checksum: bool = False):
        if packing not in PACKINGS:
            raise FastmaeError(f"packing {packing!r}: choose one of {PACKINGS}")
        if max_seq_len < 3:
            raise FastmaeError(f"max_seq_len {max_seq_len}: must leave room for <s>, a token and </s>")
        if tokens_per_batch < max_seq_len:
            raise FastmaeError(f"tokens_per_batch {tokens_per_batch} is smaller than max_seq_len {max_seq_len}")
        if not 0 <= rank < world_size:
            raise FastmaeError(f"rank {rank} is not in [0, world_size={world_size})")
        self.data = ShardSet(data_dir, split, verify_checksum)
        self.split, self.max_seq_len, self.packing = split, max_seq_len, packing
        self.tokens_per_batch, self.rank, self.world_size, self.seed = tokens_per_batch, rank, world_size, seed
        self._shard_of, self._start, self._stop = self._index_sequences()
        if len(self._start) == 0:
            raise FastmaeError(f"{self.data.directory}: split {split!r} holds no tokens")
        self._epoch, self._position = 0, 0
        self._epoch_batches: list[np.ndarray] | None = None

    @classmethod
    def for_run(cls, config: RunConfig, rank: int = 0, world_size: int = 1,
                verify_checksum: bool = False) -> PackedLoader:
        """The training stream of `config` (data path, packing, micro-batch budget, the model's length, train.seed)
        as data-parallel rank `rank` of `world_size` draws it."""
        data = config.data
        return cls(data.path, "train", max_seq_len=config.max_seq_len, packing=data.packing,
                   tokens_per_batch=data.tokens_per_micro_batch, rank=rank, world_size=world_size,
                   seed=config.train.seed, verify_checksum=verify_checksum)

    # ----------------------------------------------------------------------------------------- sequence index
    def _index_sequences(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, start, stop) of every sequence's body: token offsets (`doc`) or stream offsets (`full`)."""
        body = self.max_seq_len - 2
        shard_ids, starts, stops = [], [], []
        for s, shard in enumerate(self.data.shards):
            if self.packing == "doc":
                lengths = np.diff(shard.offsets)
                lengths_nonempty = lengths[lengths > 0]
                doc_starts = shard.offsets[:-1][lengths > 0]
                pieces = -(-lengths_nonempty // body)  # ceil
                first = np.repeat(doc_starts, pieces)
                within = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)
                start = first + within * body
                stop = np.minimum(start + body, np.repeat(doc_starts + lengths_nonempty, pieces))
            else:
                stream_length = shard.num_tokens + shard.num_documents  # a </s> after every document
                start = np.arange(0, stream_length, body)
                stop = np.minimum(start + body, stream_length)
            shard_ids.append(np.full(len(start), s, dtype=np.int64))
            starts.append(start.astype(np.int64))
            stops.append(stop.astype(np.int64))
        return np.concatenate(shard_ids), np.concatenate(starts), np.concatenate(stops)

    @property
    def num_sequences(self) -> int:
        return len(self._start)

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size

    def fingerprint(self) -> dict:
        """What must be equal for a saved cursor to mean the same stream."""
        return {"tokenizer_sha256": self.data.tokenizer_sha256, "split": self.split, "tokens": self.data.num_tokens,
                "max_seq_len": self.max_seq_len, "packing": self.packing, "tokens_per_batch": self.tokens_per_batch,
                "world_size": self.world_size, "seed": self.seed}

    # ----------------------------------------------------------------------------------------------- epochs
    def _batches_of_epoch(self, epoch: int) -> list[np.ndarray]:
        """This rank's micro-batches (arrays of sequence ids) in epoch `epoch`."""
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
        batches = [order[part] for part in cut_by_budget(self.sequence_lengths(order), self.tokens_per_batch)]
        per_rank = len(batches) // self.world_size
        if per_rank == 0:
            raise FastmaeError(f"{self.data.directory} split {self.split!r}: {len(batches)} micro-batch(es) per epoch "
                               f"cannot feed {self.world_size} ranks; lower tokens_per_batch or add data")
        return batches[self.rank::self.world_size][:per_rank]

    @property
    def batches_per_epoch(self) -> int:
        return len(self._batches_of_epoch(0))

    def sequence_lengths(self, sequences: np.ndarray) -> np.ndarray:
        """Length in tokens (with <s> and </s>) of each of `sequences` (ids in [0, num_sequences), file order)."""
        return self._stop[sequences] - self._start[sequences] + 2

    def tokens_of(self, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated token ids (with <s> ... </s>) and lengths of `sequences` (ids in [0, num_sequences), file
        order, whatever the rank, world size or epoch)."""
        bodies = []
        for seq in sequences.tolist():
            shard = self.data.shards[self._shard_of[seq]]
            start, stop = int(self._start[seq]), int(self._stop[seq])
            if self.packing == "doc":
                body = np.asarray(shard.tokens[start:stop], dtype=np.int64)
            else:  # stream position p -> document d, its token or the </s> after it
                positions = np.arange(start, stop)
                stream_offsets = shard.offsets + np.arange(len(shard.offsets))
                doc = np.searchsorted(stream_offsets, positions, side="right") - 1
                local = positions - stream_offsets[doc]
                doc_length = shard.offsets[doc + 1] - shard.offsets[doc]
                is_separator = local == doc_length
                token_index = np.minimum(shard.offsets[doc] + local, max(shard.num_tokens - 1, 0))
                body = np.where(is_separator, EOS_ID, np.asarray(shard.tokens[token_index], dtype=np.int64))
            bodies.append(np.concatenate(([BOS_ID], body, [EOS_ID])))
        return np.concatenate(bodies), np.array([len(b) for b in bodies], dtype=np.int64)

    def __iter__(self) -> Iterator[PackedBatch]:
        while True:
            if self._epoch_batches is None:
                self._epoch_batches = self._batches_of_epoch(self._epoch)
            if self._position >= len(self._epoch_batches):
                self._epoch, self._position, self._epoch_batches = self._epoch + 1, 0, None
                continue
            tokens, lengths = self.tokens_of(self._epoch_batches[self._position])
            self._position += 1
            yield PackedBatch.from_packed(tokens, lengths)

    # ------------------------------------------------------------------------------------------------ state
    @property
    def epoch(self) -> int:
        return self._epoch

    def state_dict(self) -> dict:
        """The cursor: after restoring it, the next batch is the one that would have come next."""
        return {"epoch": self._epoch, "position": self._position, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint():
            raise FastmaeError(f"data loader state does not match this data/config: saved {state.get('fingerprint')},"
                               f" now {self.fingerprint()}")
        self._epoch, self._position, self._epoch_batches = int(state["epoch"]), int(state["position"]), None
