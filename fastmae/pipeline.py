"""The host stage of the training input: each micro-batch masked, padded to a fixed shape where CUDA graphs replay, and
packed into one buffer, by a background thread ahead of the step (ARCHITECTURE.md section 2). It sees both masking
(`fastmae.masking`) and padding (`fastmae.padding`), which know nothing of each other's callers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .batch import PackedBatch, ahead_in_thread
from .config import ModelConfig
from .masking import MaskedBatch, mask_batch
from .padding import ShapeLadder


def masked_ahead(batches: Iterator[PackedBatch], config: ModelConfig, seed: int, depth: int = 2,
                 pin_memory: bool = False, shapes: ShapeLadder | None = None,
                 rate_of: Callable[[int], float] | None = None) -> Iterator[MaskedBatch]:
    """The data loader's host batches masked on the host for (seed, each batch's index), with the layouts the model
    reads, packed into one buffer (page-locked with `pin_memory`: for CUDA), by a background thread up to `depth`
    ahead (ARCHITECTURE.md section 2): the training step then finds masks and layouts ready and moves each micro-batch
    in one copy (`MaskedBatch.to`). With `shapes` each masked batch is padded to the first of its shapes it fits
    (`fastmae.padding`; one that fits none stays as it is). `rate_of(index)`: the masking rate of the micro-batch
    of that index (a masking-rate schedule; default config.mask_rate)."""

    def mask(batch: PackedBatch) -> MaskedBatch:
        rate = None if rate_of is None else rate_of(batch.index)
        masked = mask_batch(batch, config, seed, batch.index, mask_rate=rate, host=True)
        if shapes is not None:
            masked = (shapes if rate is None else shapes.at_rate(rate)).pad(masked)
        return masked.packed(pin_memory)

    return ahead_in_thread(map(mask, batches), depth)
