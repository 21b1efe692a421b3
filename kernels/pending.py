"""What the backwards of one forward leave to the end of the backward for its views of a flat parameter (fastmae.flat
makes both for each forward's views and calls them, in this order, where the views' gradients reach the flat one):

- PendingSums: partial sums of parameter gradients whose adding a backward defers, so that one launch adds several
  (the fused ops of kernels/norm.py, activation.py and projection.py write per-program partial sums of their
  parameters' gradients, which `launch.sum_parts` adds up in a fixed order). An op's forward asks `defer_sums` for
  its parameters and its backward hands the Deferral to `sum_parts`, which hands over its launcher with each entry.
- GradientSlots: the flat gradient itself, allocated at the first backward that asks for a view's piece of it
  (`claim_slot`): a weight's gradient GEMM, an embedding table's gradient and the tied LM head's write theirs in
  place, so the flat gradient is not a concatenation of copies (a whole-model copy a backward); the others' (the
  small sums of norms and biases, a view read twice) are copied in. A table's gradient may also start from another
  reader's gradient of the same view (`table_handoff`: the LM head's, of the token embeddings it is tied to), which
  its kernels add into, where autograd would zero-fill the table's and add the two.

No Triton here (fastmae.flat imports it).
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
    SUM_ENTRIES a launch where each was a launch of its own, the rest when the views' gradients are gathered into
    the flat one (`flush`). Safe where that gathering is the only reader of the views' gradients: a view a forward
    reads twice (autograd would add its gradients first) has its sums made at once, and `flush` checks that every
    deferred sum reaches the gathering as the tensor it fills."""

    ATTRIBUTE = PENDING_ATTRIBUTE

    def __init__(self):
        self.index: dict[int, int] = {}  # a view's gradient's place among the views' (`attach`)
        self.reads: dict[int, int] = {}
        self.entries: list[tuple[torch.Tensor, torch.Tensor, tuple[int | None, ...]]] = []
        self.launch: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None  # `add`'s launcher

    def attach(self, views: tuple[torch.Tensor, ...]) -> None:
        """Take on the forward's views, each naming this object in its attribute ATTRIBUTE."""
        self.index = {id(view): i for i, view in enumerate(views)}
        for view in views:
            setattr(view, self.ATTRIBUTE, self)

    def claim(self, params: tuple[torch.Tensor | None, ...]) -> Deferral:
        """At a fused op's forward: its parameters' keys, each read counted."""
        keys = tuple([None if p is None else id(p) for p in params])  # a list: one Python call, not one an item
        for key in keys:
            if key is not None:
                self.reads[key] = self.reads.get(key, 0) + 1
        return Deferral(self, keys)

    def add(self, parts: torch.Tensor, sums: torch.Tensor, keys: tuple[int | None, ...],
            launch: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]) -> bool:
        """At a backward: defer `sums` = `parts` summed (True) to a later call of `launch` (`launch.launch_sums`) with
        others, or decline (False: a parameter read twice)."""
        for key in keys:
            if key is not None and self.reads[key] > 1:
                return False
        self.entries.append((parts, sums, keys))
        self.launch = launch
        if len(self.entries) == SUM_ENTRIES:
            self._launch()
        return True

    def flush(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """At the gathering of the views' gradients `grads` (fastmae.flat): the deferred sums made, each checked to be
        the gradient the gathering reads."""
        for _, sums, keys in self.entries:
            for row, key in enumerate(keys):
                grad = None if key is None else grads[self.index[key]]
                if grad is not None and grad.data_ptr() != sums[row].data_ptr():
                    raise RuntimeError("a deferred parameter gradient reached its flat parameter as another tensor "
                                       "(read by something besides the gathering): kernels/pending.py")
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


SLOTS_ATTRIBUTE = "_fastmae_gradient_slots"
"""The attribute of a flat parameter's view (fastmae.flat) naming the GradientSlots of the forward that bound it."""
SLOT_ALIGNMENT = 16
"""Bytes a slot's start is a multiple of: a GEMM or a kernel writing it gets the aligned, vectorised stores it gets
from a fresh allocation. A view whose piece starts elsewhere gets no slot (its gradient is copied in)."""


class GradientSlots:
    """The flat gradient of one forward's views of a flat parameter, built in place: a view's slot is its piece of
    one buffer, allocated at the first request, each slot handed out once (a second reader of a view makes its own,
    which autograd adds to the first into a new tensor); `gather` makes the buffer the flat gradient, copying in the
    gradients that arrive elsewhere. A table handoff (`expect_table`, `table_handoff`) passes a later reader's
    gradient of a view to the table op that read it first, whose backward runs last."""

    ATTRIBUTE = SLOTS_ATTRIBUTE
    attach = PendingSums.attach

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype, device: torch.device):
        self.index: dict[int, int] = {}  # a view's place among the views (`attach`)
        self.shapes = shapes
        self.offsets = [0]
        for shape in shapes:
            self.offsets.append(self.offsets[-1] + shape.numel())
        self.dtype, self.device = dtype, device
        self.buffer: torch.Tensor | None = None
        self.given: set[int] = set()  # views whose slot is handed out in this backward
        self.tables: set[int] = set()  # views a table op read, which takes a handed gradient
        self.handed: dict[int, torch.Tensor] = {}  # a view's gradient handed to its table op, not yet taken
        self.taken: set[int] = set()  # table ops that ran in this backward

    def slot(self, index: int, dtype: torch.dtype) -> torch.Tensor | None:
        """View `index`'s piece of the flat gradient (uninitialised) for a gradient of `dtype`, the first time it is
        asked for and where the dtype is the flat parameter's and the piece aligned; else None."""
        start = self.offsets[index]
        if index in self.given or dtype != self.dtype or start * dtype.itemsize % SLOT_ALIGNMENT:
            return None
        if self.buffer is None:
            self.buffer = torch.empty(self.offsets[-1], dtype=self.dtype, device=self.device)
        self.given.add(index)
        return self.buffer[start:self.offsets[index + 1]].view(self.shapes[index])

    def hand(self, index: int, grad: torch.Tensor) -> bool:
        """A reader's backward hands its gradient of view `index` to the table op that read the view first (True),
        unless that op's backward already ran (False: the reader returns it to autograd)."""
        if index not in self.tables or index in self.taken:
            return False
        self.handed[index] = grad
        return True

    def take_handed(self, index: int) -> torch.Tensor | None:
        """At the table op's backward: the gradient handed to it (None if none was), released."""
        self.taken.add(index)
        return self.handed.pop(index, None)

    def gather(self, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        """The flat gradient from the views' gradients `grads` (None: none reached the view): the buffer, with the
        gradients written outside their slots copied in and zeros where none came; without a slot handed out, their
        concatenation. A handed gradient no table op took is added in."""
        grads = list(grads)
        for index, handed in self.handed.items():
            grads[index] = handed if grads[index] is None else grads[index] + handed
        self.handed.clear()
        self.given.clear()
        self.taken.clear()
        buffer, self.buffer = self.buffer, None
        if buffer is None:
            return torch.cat([(torch.zeros(shape, dtype=self.dtype, device=self.device) if grad is None else grad)
                              .reshape(-1) for grad, shape in zip(grads, self.shapes)])
        copies, zeros = ([], []), []
        for index, grad in enumerate(grads):
            piece = buffer[self.offsets[index]:self.offsets[index + 1]]
            if grad is None:
                zeros.append(piece)
            elif not (grad.data_ptr() == piece.data_ptr() and grad.is_contiguous()):
                copies[0].append(piece)
                copies[1].append(grad.reshape(-1))
        if copies[0]:
            torch._foreach_copy_(*copies)
        if zeros:
            torch._foreach_zero_(zeros)
        return buffer


class SlotClaim(NamedTuple):
    """A view's place in its forward's GradientSlots (`claim_slot`), kept by an op's forward for its backward."""

    slots: GradientSlots
    index: int

    def take(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The view's slot for a gradient of `dtype` (GradientSlots.slot)."""
        return self.slots.slot(self.index, dtype)

    def hand(self, grad: torch.Tensor) -> bool:
        """GradientSlots.hand."""
        return self.slots.hand(self.index, grad)

    def take_handed(self) -> torch.Tensor | None:
        """GradientSlots.take_handed."""
        return self.slots.take_handed(self.index)


def claim_slot(param: torch.Tensor | None) -> SlotClaim | None:
    """At an op's forward: where `param` is a view bound by a flat parameter for this forward (fastmae.flat) and
    takes a gradient, its SlotClaim; else None (its gradient allocated as usual). Never under torch.compile."""
    slots = getattr(param, SLOTS_ATTRIBUTE, None)
    if slots is None or torch.compiler.is_compiling():
        return None
    return SlotClaim(slots, slots.index[id(param)])


def expect_table(param: torch.Tensor) -> SlotClaim | None:
    """At a table op's forward (an embedding lookup whose backward builds the table's gradient): its SlotClaim, the
    table marked as one a later reader may hand its gradient to (`table_handoff`)."""
    claim = claim_slot(param)
    if claim is not None:
        claim.slots.tables.add(claim.index)
    return claim


def table_handoff(param: torch.Tensor) -> SlotClaim | None:
    """At a reader's forward: the SlotClaim through which its backward may hand its gradient of `param` to the table
    op that read `param` earlier in this forward (`expect_table`), None where none did."""
    claim = claim_slot(param)
    return claim if claim is not None and claim.index in claim.slots.tables else None
