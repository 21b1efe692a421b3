"""The order of an epoch and its cut into micro-batches, without materialising either.

`EpochOrder` is a uniformly random-looking permutation of the sequence ids that is evaluated at any positions on
demand (O(1) memory and O(1) per position), so no rank stores a permutation of tens of millions of ids and a resumed
run jumps straight to its position. It is a keyed 4-round Feistel network over [0, a^2), a = ceil(sqrt(n)), walked
back into [0, n) ("cycle walking"): the random-access shuffle of Google's Grain (`index_shuffle`) in spirit.

`batch_ends` is the greedy token-budget cut, vectorised: for every start, where the micro-batch starting there ends.
Following those ends from a start is a loop over micro-batches, never over sequences or tokens.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import FastmaeError

if TYPE_CHECKING:
    from ..config import TrainConfig

ROUNDS = 4
ORDER_VERSION = "feistel4-v1"
"""Stored in loader cursors: a cursor only means something under the order that made it."""


def _mix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser (a bijective avalanche mix) of a uint32 array."""
    x = x ^ (x >> np.uint32(16))
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return x


class EpochOrder:
    """The shuffled order of `n` sequences in epoch `epoch` under `seed`: `order[positions]` are the sequence ids at
    those positions of the epoch. A bijection on [0, n) for any n < 2**32; another (seed, epoch) gives another."""

    def __init__(self, n: int, seed: int, epoch: int):
        if not 0 < n < 2**32:
            raise ValueError(f"EpochOrder: {n} sequences; 1 to 2**32 - 1 are supported")
        self.n, self.epoch = n, epoch
        self.side = math.isqrt(n - 1) + 1  # the network permutes [0, side**2) ⊇ [0, n)
        keys = np.random.default_rng([seed, epoch, 0x5EED]).integers(0, 2**32, ROUNDS, dtype=np.uint64)
        self.keys = keys.astype(np.uint32)

    def _network(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over [0, side**2): (left, right) -> (right, left + F(right) mod side)."""
        side = np.uint32(self.side)
        left, right = np.divmod(x, side)
        for key in self.keys:
            # F(right) in [0, side): the top 32 bits of a 32-bit hash times side (no division)
            f = ((_mix32(right ^ key).astype(np.uint64) * np.uint64(self.side)) >> np.uint64(32)).astype(np.uint32)
            f += left
            f -= side * (f >= side)
            left, right = right, f
        return left * side + right

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"EpochOrder: positions outside [0, {self.n})")
        ids = self._network(positions.astype(np.uint32))
        outside = np.flatnonzero(ids >= self.n)
        while outside.size:  # cycle walking: at most side**2 - n < 2 * side + 1 values ever leave [0, n)
            ids[outside] = self._network(ids[outside])
            outside = outside[ids[outside] >= self.n]
        return ids.astype(np.int64)


def batch_ends(lengths: np.ndarray, budget: int) -> np.ndarray:
    """For each i, the end (exclusive) of the greedy micro-batch that starts at sequence i: as many consecutive
    sequences as fit in `budget` tokens, and at least one (a longer sequence gets a micro-batch of its own)."""
    cumulative = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cumulative[1:])
    ends = np.searchsorted(cumulative, cumulative[:-1] + budget, side="right") - 1
    return np.maximum(ends, np.arange(1, len(lengths) + 1))


def follow_ends(ends: np.ndarray, size: int, count: int) -> list[int]:
    """Boundaries of the first `count` consecutive micro-batches of `batch_ends`' output over `size` sequences,
    from 0 (fewer if the sequences run out). A loop over micro-batches, not sequences."""
    ends, bounds = memoryview(ends), [0]
    while len(bounds) <= count and bounds[-1] < size:
        bounds.append(ends[bounds[-1]])
    return bounds


def cut_by_budget(lengths: np.ndarray, budget: int) -> list[slice]:
    """Greedy cut of consecutive sequences of `lengths` into runs of at most `budget` tokens (a longer sequence
    gets a run of its own)."""
    bounds = follow_ends(batch_ends(np.asarray(lengths), budget), len(lengths), len(lengths))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])] or [slice(0, 0)]


@dataclass(frozen=True)
class StepSizes:
    """How many micro-batches (all ranks together) each optimizer step takes: `full` from the start, or with a batch
    warm-up (ModernBERT's batch-size warm-up) `start` at step 0, growing by `world` (one more on every rank) at each of
    `ends` (the first step of each larger size; each size held for the same number of steps), `full` from the last.
    `warmup` keeps the settings it came from (train.batch_warmup_tokens, train.batch_warmup_from), which do not depend
    on the rank count."""

    full: int
    world: int = 1
    start: int = 0
    ends: tuple[int, ...] = ()
    warmup: tuple[int, int] = (0, 0)

    @classmethod
    def warming_up(cls, world: int, grad_accum: int, micro_tokens: int, warmup_tokens: int,
                   warmup_from: int) -> StepSizes:
        """`world` ranks of `grad_accum` micro-batches of `micro_tokens` tokens a full step; over the first
        `warmup_tokens` (nominal) tokens the step grows linearly, one micro-batch a rank at a time, from
        `warmup_from` tokens (rounded down to whole micro-batches on every rank, at least one)."""
        full = world * grad_accum
        if not warmup_tokens:
            return cls(full, world)
        first = max(1, warmup_from // (world * micro_tokens))  # micro-batches a rank takes at step 0
        if first >= grad_accum:
            raise FastmaeError(f"train.batch_warmup_from={warmup_from} is not below the full step's {grad_accum} "
                               f"micro-batch(es) a rank ({world} rank(s) x {micro_tokens} tokens each): the warm-up "
                               "needs a smaller start, or more micro-batches a step (train.tokens_per_step)")
        sizes = range(first, grad_accum)
        per_size = warmup_tokens / (world * micro_tokens * sum(sizes))  # steps each size holds
        ends = tuple(math.ceil(per_size * (i + 1)) for i in range(len(sizes)))
        return cls(full, world, first * world, ends, (warmup_tokens, warmup_from))

    @classmethod
    def of_train(cls, train: TrainConfig, world: int, micro_tokens: int) -> StepSizes:
        """The step sizes a run's train config (its grad_accum resolved for `world` ranks) gives."""
        return cls.warming_up(world, train.grad_accum, micro_tokens, train.batch_warmup_tokens, train.batch_warmup_from)

    def count(self, step: int) -> int:
        """Micro-batches of step `step` (0-based), all ranks together."""
        return self.start + self.world * bisect.bisect_right(self.ends, step) if self.ends else self.full

    def per_rank(self, step: int) -> int:
        """Micro-batches of step `step` on each rank."""
        return self.count(step) // self.world

    def before(self, step: int) -> int:
        """Micro-batches of the steps before step `step` (the progress line's measure of work done)."""
        done = bisect.bisect_right(self.ends, step)
        counted, first = 0, 0
        for i, end in enumerate(self.ends[:done]):
            counted, first = counted + (end - first) * (self.start + self.world * i), end
        return counted + (step - first) * self.count(step)

    def batch(self, micro_tokens: int) -> str:
        """The global batch in words (the model card's and `fastmae train --plan`'s), its warm-up's settings too."""
        tokens, start = self.warmup
        warmup = f"; warmed up from {start:,} tokens a step over the first {tokens:,} tokens" if tokens else ""
        return (f"{self.world} rank(s) x {self.full // self.world} micro-batch(es) of at most {micro_tokens:,} tokens "
                f"({self.full * micro_tokens:,} tokens a step){warmup}")

    def describe(self, micro_tokens: int, steps: int) -> str:
        """A clause for the log's line of schedules ('' without a warm-up), saying where a run of `steps` steps ends
        inside the warm-up."""
        if not self.ends:
            return ""
        sizes, last = len(self.ends), self.ends[-1]
        cut = (f", cut by the run's end at step {steps:,}: the last step at {self.per_rank(steps - 1)} a rank, never "
               "the full batch" if steps < last else "")
        return (f"; batch warm-up: {self.start // self.world} -> {self.full // self.world} micro-batch(es) of "
                f"{micro_tokens:,} tokens a rank a step, one more every {last / sizes:,.1f} steps on average ({sizes} "
                f"sizes below the full one), the full step from step {last:,}{cut}")


class StepPlanner:
    """Cuts each epoch's order of the sequences of `lengths` into optimizer steps of `micro_batches_per_step` greedy
    micro-batches of at most `tokens_per_batch` tokens, one step at a time, reading only that step's lengths."""

    def __init__(self, lengths: np.ndarray, seed: int, tokens_per_batch: int, micro_batches_per_step: int):
        self.lengths, self.seed = lengths, seed
        self.tokens_per_batch, self.micro_batches_per_step = tokens_per_batch, micro_batches_per_step
        self._per_batch = tokens_per_batch / float(lengths.mean())  # sequences a micro-batch takes, on average
        self._margin = 1.1  # sequences looked at per expected one; doubled whenever a cut needs more
        self._order: EpochOrder | None = None

    def order(self, epoch: int) -> EpochOrder:
        """Sequence ids of epoch `epoch` by position."""
        if self._order is None or self._order.epoch != epoch:
            self._order = EpochOrder(len(self.lengths), self.seed, epoch)
        return self._order

    def _cut(self, epoch: int, position: int, count: int) -> list[int]:
        """Positions bounding the next `count` greedy micro-batches of epoch `epoch` from `position` (fewer only at
        the epoch's end), relative to `position`. Reads the lengths of about as many sequences as they hold."""
        order, n = self.order(epoch), len(self.lengths)
        while True:
            stop = min(n, position + int(count * self._per_batch * self._margin) + 64)
            size = stop - position
            bounds = follow_ends(batch_ends(self.lengths[order[np.arange(position, stop)]], self.tokens_per_batch),
                                 size, count)
            if stop == n or (len(bounds) > count and bounds[-1] < size):
                return bounds
            self._margin *= 2  # the window may have cut the last micro-batch short: look further

    def plan_step(self, epoch: int, position: int, count: int | None = None) -> np.ndarray | None:
        """Positions in epoch `epoch`'s order bounding the `count` (default micro_batches_per_step) micro-batches of
        the step that starts at `position` (count + 1 of them), or None when the rest of the epoch cannot fill a
        step."""
        count = count or self.micro_batches_per_step
        bounds = self._cut(epoch, position, count)
        return position + np.array(bounds, dtype=np.int64) if len(bounds) > count else None

    def steps_per_epoch(self, epoch: int = 0) -> int:
        """Optimizer steps epoch `epoch` makes: its micro-batches (a pass over its lengths, in chunks of ~16K
        sequences, which stay in the CPU's cache) by the step, the rest dropped."""
        chunk = max(1, int(2**14 / self._per_batch))
        batches, position = 0, 0
        while position < len(self.lengths):
            bounds = self._cut(epoch, position, chunk)
            batches, position = batches + len(bounds) - 1, position + bounds[-1]
        return batches // self.micro_batches_per_step


DIGEST_MODULUS = 2**40
"""Digests live mod 2**40: a sum of one per rank stays exact in a float64 all-reduce up to 8,192 ranks."""


def sequences_digest(ids: np.ndarray) -> int:
    """An order-free fingerprint of a multiset of sequence ids: the sum, mod DIGEST_MODULUS, of a 64-bit hash
    (splitmix64's finaliser) of each. Digests add up (mod DIGEST_MODULUS) to the digest of the union, so two runs
    that drew the same sequences in each step log the same digests."""
    z = np.asarray(ids, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return int((z % np.uint64(DIGEST_MODULUS)).sum() % np.uint64(DIGEST_MODULUS))
