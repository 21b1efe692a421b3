"""The packed varlen loader: the epoch's sequences, cut into token-budgeted micro-batches one optimizer step at a time.

Every epoch is one shuffled order of all sequences (`EpochOrder`, from (seed, epoch); never stored) read from the
start. Each optimizer step takes the next `world_size * grad_accum` micro-batches of it, cut greedily by
`tokens_per_batch`; rank r runs micro-batches r, r + world_size, ... of the step. A step never straddles two epochs:
what is left at an epoch's end that cannot fill a step is dropped. The order and the cut do not depend on the rank
count, so the same micro-batches in the same order make up a run's steps on 1 or 64 ranks, and the cursor (epoch,
position in the epoch's order) resumes a run on any number of ranks: no sequence of the epoch repeated or skipped.

Planning a step reads the lengths of that step's sequences only: a rank holds the compact `SequenceIndex` (2 bytes per
sequence) and its cursor, and starting, resuming or crossing an epoch costs no pass over the data.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from ..batch import PackedBatch
from ..errors import FastmaeError
from .order import ORDER_VERSION, StepPlanner, StepSizes
from .sequences import SequenceIndex
from .shards import ShardSet

if TYPE_CHECKING:
    from ..config import RunConfig

CURSORS_KEPT = 8
"""Cursors remembered for steps already planned: a checkpoint asks for the one its trainer has reached, which lags the
loader by the batches copied ahead."""


class PackedLoader:
    """Endless iterator of host-side `PackedBatch`es for one data-parallel rank: `grad_accum` per optimizer step."""

    def __init__(self, data_dir: str | Path, split: str = "train", max_seq_len: int = 512, packing: str = "full",
                 tokens_per_batch: int = 8192, rank: int = 0, world_size: int = 1, seed: int = 0,
                 verify_checksum: bool = False, grad_accum: int = 1, step_sizes: StepSizes | None = None):
        if tokens_per_batch < max_seq_len:
            raise FastmaeError(f"tokens_per_batch {tokens_per_batch} is smaller than max_seq_len {max_seq_len}")
        if not 0 <= rank < world_size:
            raise FastmaeError(f"rank {rank} is not in [0, world_size={world_size})")
        if grad_accum < 1:
            raise FastmaeError(f"grad_accum {grad_accum}: must be at least 1")
        self.data = ShardSet(data_dir, split, verify_checksum)
        self.index = SequenceIndex.of(self.data, max_seq_len, packing)
        if len(self.index) == 0:
            raise FastmaeError(f"{self.data.directory}: split {split!r} holds no tokens")
        self.split, self.max_seq_len, self.packing = split, max_seq_len, packing
        self.tokens_per_batch, self.rank, self.world_size, self.seed = tokens_per_batch, rank, world_size, seed
        self.micro_batches_per_step = world_size * grad_accum  # a full step's (`step_sizes`: a warm-up's smaller)
        self.step_sizes = step_sizes or StepSizes(self.micro_batches_per_step, world_size)
        self.planner = StepPlanner(self.index.lengths, seed, tokens_per_batch, self.micro_batches_per_step)
        self._step = 0  # optimizer steps planned so far
        self._cursors: dict[int, tuple[int, int]] = {0: (0, 0)}  # step -> (epoch, position) where it starts

    @classmethod
    def for_run(cls, config: RunConfig, rank: int = 0, world_size: int = 1,
                verify_checksum: bool = False) -> PackedLoader:
        """The training stream of `config` (data path, packing, micro-batch budget, grad_accum, the model's length,
        train.seed) as data-parallel rank `rank` of `world_size` draws it."""
        data = config.data
        if data.tokens_per_micro_batch < config.model.max_seq_len:
            raise FastmaeError(f"data.tokens_per_micro_batch={data.tokens_per_micro_batch} is smaller than "
                               f"model.max_seq_len={config.model.max_seq_len}: a micro-batch holds whole sequences")
        train = config.train
        sizes = StepSizes.of_train(train, world_size, data.tokens_per_micro_batch)
        return cls(data.directory, "train", max_seq_len=config.model.max_seq_len, packing=data.packing,
                   tokens_per_batch=data.tokens_per_micro_batch, rank=rank, world_size=world_size, seed=train.seed,
                   verify_checksum=verify_checksum, grad_accum=train.grad_accum, step_sizes=sizes)

    def every_rank(self) -> PackedLoader:
        """The same stream as all ranks together draw it, from its start: every micro-batch of every step, in order."""
        whole = copy.copy(self)
        whole.rank, whole.world_size = 0, 1
        whole._step, whole._cursors = 0, {0: (0, 0)}
        return whole

    @property
    def num_sequences(self) -> int:
        return len(self.index)

    @property
    def vocab_size(self) -> int:
        return self.data.vocab_size

    def sequence_lengths(self, sequences: np.ndarray) -> np.ndarray:
        """Length in tokens (with <s> and </s>) of each of `sequences` (ids in [0, num_sequences), file order)."""
        return self.index.lengths[sequences].astype(np.int64)

    def tokens_of(self, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated token ids (with <s> ... </s>) and lengths of `sequences` (ids in [0, num_sequences), file
        order, whatever the rank, world size or epoch)."""
        return self.index.tokens_of(self.data, sequences)

    def fingerprint(self) -> dict:
        """What must be equal for a saved cursor to mean the same stream (the rank count and micro-batch size may
        change: the order does not depend on them)."""
        return {"tokenizer_sha256": self.data.tokenizer_sha256, "split": self.split, "tokens": self.data.num_tokens,
                "max_seq_len": self.max_seq_len, "packing": self.packing, "seed": self.seed, "order": ORDER_VERSION}

    # ----------------------------------------------------------------------------------------------- steps
    def step_sequences(self, epoch: int, bounds: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """This rank's micro-batches of the step bounded by `bounds` in epoch `epoch`: (place in the step, sequence
        ids). Rank r runs places r, r + world_size, ...: the one place where the interleave is written down."""
        order = self.planner.order(epoch)
        return [(j, order[np.arange(bounds[j], bounds[j + 1])])
                for j in range(self.rank, len(bounds) - 1, self.world_size)]

    def __iter__(self) -> Iterator[PackedBatch]:
        while True:
            epoch, position = self._cursors[self._step]
            bounds = self.planner.plan_step(epoch, position, self.step_sizes.count(self._step))
            if bounds is None:
                if position == 0:
                    raise FastmaeError(
                        f"{self.data.directory} split {self.split!r}: one epoch does not fill one optimizer step of "
                        f"{self.step_sizes.count(self._step)} micro-batches ({self.world_size} rank(s) x "
                        f"{self.step_sizes.per_rank(self._step)}) of "
                        f"{self.tokens_per_batch} tokens; lower the tokens per step or add data")
                self._cursors[self._step] = (epoch + 1, 0)
                continue
            self._step += 1
            self._cursors[self._step] = (epoch, int(bounds[-1]))
            for old in [s for s in self._cursors if s <= self._step - CURSORS_KEPT]:
                del self._cursors[old]
            first_index = (self._step - 1) * self.micro_batches_per_step  # a warm-up's smaller steps leave gaps
            for place, sequences in self.step_sequences(epoch, bounds):
                tokens, lengths = self.tokens_of(sequences)
                if tokens.max() >= self.vocab_size:  # a damaged shard: stop here, not in an embedding lookup
                    self._out_of_vocabulary(tokens, lengths, sequences)
                yield PackedBatch.from_packed(tokens, lengths, dataset_ids=sequences, index=first_index + place,
                                              special=self.data.special_tokens)

    def _out_of_vocabulary(self, tokens: np.ndarray, lengths: np.ndarray, sequences: np.ndarray) -> NoReturn:
        """Raise the error naming the shard of the first sequence of a batch that holds an id >= vocab_size."""
        bad = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(tokens >= self.vocab_size)), side="right"))
        shard = self.data.shards[int(self.index.stream_spans(sequences[bad:bad + 1])[0][0])]
        raise FastmaeError(f"{shard.path}: token id {int(tokens.max())} is outside the vocabulary of "
                           f"{self.vocab_size} (sequence {int(sequences[bad])} of split {self.split!r}): corrupt "
                           "shard; check it with data.verify_checksums=true or re-run fastmae prepare")

    # ------------------------------------------------------------------------------------------------ state
    @property
    def epoch(self) -> int:
        """The epoch the next step is drawn from."""
        return self._cursors[self._step][0]

    def state_dict(self, step: int | None = None) -> dict:
        """The cursor after `step` optimizer steps (default: every step planned so far): restored, on any number of
        ranks, the next step is the one that followed."""
        step = self._step if step is None else step
        if step not in self._cursors:
            raise FastmaeError(f"data loader: no cursor for step {step} (planned up to {self._step})")
        epoch, position = self._cursors[step]
        return {"epoch": epoch, "position": position, "step": step, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint():
            raise FastmaeError(f"data loader state does not match this data/config: saved {state.get('fingerprint')},"
                               f" now {self.fingerprint()}")
        self._step = int(state["step"])
        self._cursors = {self._step: (int(state["epoch"]), int(state["position"]))}
