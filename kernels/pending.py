"""Partial sums of parameter gradients whose adding a backward defers, so that one launch adds several (the fused
ops of kernels/norm.py, activation.py and projection.py write per-program partial sums of their parameters' gradients,
which `launch.sum_parts` adds up in a fixed order). fastmae.flat makes a PendingSums for each forward's views of a
flat parameter and hooks its `flush` on the concatenation of their gradients; an op's forward asks `defer_sums` for
its parameters and its backward hands the Deferral to `sum_parts`, which hands over its launcher with each entry. No
Triton here (fastmae.flat imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

SUM_ENTRIES = 4
"""(partial sums, sums) pairs one launch of `launch._sum_parts_kernel` adds up: a post-LN layer's four (its two
norms', its bias + GELU's, its QKV projection bias's) where its backward defers them."""
PENDING_ATTRIBUTE = "_fastmae_pending_sums"
"""The attribute of a flat parameter's view (fastmae.flat) naming the PendingSums of the forward that bound it."""


class Deferral(NamedTuple):
    """Where a fused op's backward defers the sums of its parameters' gradients (`defer_sums`): the forward's
    PendingSums and the parameters' keys, in the order of the rows of its sums (None: a row no parameter takes)."""

    pending: PendingSums
    keys: tuple[int | None, ...]


class PendingSums:
    """The gradients of one forward's flat-parameter views whose partial sums the fused ops' backwards defer,
    SUM_ENTRIES a launch where each was a launch of its own, the rest when the views' gradients are concatenated
    (`flush`). Safe where that concatenation is the only reader of the views' gradients: a view a forward reads twice
    (autograd would add its gradients first) has its sums made at once, and `flush` checks that every deferred sum
    reaches the concatenation as the tensor it fills."""

    def __init__(self, views: list[torch.Tensor]):
        self.index = {id(view): i for i, view in enumerate(views)}  # a view's gradient's place in the concatenation
        self.reads: dict[int, int] = {}
        self.entries: list[tuple[torch.Tensor, torch.Tensor, tuple[int | None, ...]]] = []
        self.launch: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None  # `add`'s launcher

    def claim(self, params: tuple[torch.Tensor | None, ...]) -> Deferral:
        """At a fused op's forward: its parameters' keys, each read counted."""
        keys = tuple(None if p is None else id(p) for p in params)
        for key in filter(None, keys):
            self.reads[key] = self.reads.get(key, 0) + 1
        return Deferral(self, keys)

    def add(self, parts: torch.Tensor, sums: torch.Tensor, keys: tuple[int | None, ...],
            launch: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]) -> bool:
        """At a backward: defer `sums` = `parts` summed (True) to a later call of `launch` (`launch.launch_sums`) with
        others, or decline (False: a parameter read twice)."""
        if any(key is not None and self.reads[key] > 1 for key in keys):
            return False
        self.entries.append((parts, sums, keys))
        self.launch = launch
        if len(self.entries) == SUM_ENTRIES:
            self._launch()
        return True

    def flush(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """The hook on the concatenation of the views' gradients `grads`: the deferred sums made, each checked to be
        the gradient the concatenation reads."""
        for _, sums, keys in self.entries:
            for row, key in enumerate(keys):
                grad = None if key is None else grads[self.index[key]]
                if grad is not None and grad.data_ptr() != sums[row].data_ptr():
                    raise RuntimeError("a deferred parameter gradient reached its flat parameter as another tensor "
                                       "(read by something besides the concatenation): kernels/pending.py")
        self._launch()

    def _launch(self) -> None:
        if self.entries:  # nothing deferred (the reference path, or none of the fused ops): no launch, no Triton
            self.launch([(parts, sums) for parts, sums, _ in self.entries])
        self.entries.clear()


def defer_sums(*params: torch.Tensor | None) -> Deferral | None:
    """At a fused op's forward, for the parameters whose gradients its backward sums from partial sums (None for a
    row of the sums that no parameter takes): where they are views bound by one flat parameter for this forward
    (fastmae.flat), the Deferral for `launch.sum_parts`; else None (summed at once). Never under torch.compile."""
    if torch.compiler.is_compiling():
        return None
    owners = {getattr(p, PENDING_ATTRIBUTE, None) for p in params if p is not None}
    if len(owners) != 1 or None in owners:
        return None
    return owners.pop().claim(params)
