"""Flat parameters: a model's parameters held in one contiguous tensor per optimizer group (ARCHITECTURE.md
section 5).

DeepSpeed's ZeRO-1/2 optimizers and its bf16 gradient hooks work parameter by parameter: a cast, an add or a copy of
every gradient and a norm of every partition, ~4 device ops per parameter and optimizer step, which for base's ~200
parameters is more ops than the model's own forward and backward together. Held flat, the same work is a few ops on
two tensors, as FSDP does it.

The modules keep reading `self.weight`: their parameters become plain tensor attributes, views into the flat
parameter that `bind()` makes afresh at the start of every forward (views only, no copy). The views' gradients become
the flat parameter's at the end of the backward (`_Views`): the fused ops write the large ones (weights' GEMMs,
embedding tables, the tied LM head) in place, into their pieces of one buffer, and the rest are copied in
(kernels/pending.py), where autograd's split would concatenate copies of them all. The flat gradient is ready only
when the whole backward is done: ZeRO's reduction cannot overlap the backward (`train.flat_parameters`).
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels.pending import GradientSlots, PendingSums


def _pieces(flat: torch.Tensor, shapes: list[torch.Size]) -> tuple[torch.Tensor, ...]:
    """`flat` split into consecutive views of `shapes` (no copy)."""
    return tuple([piece.view(shape) for piece, shape in zip(flat.split([s.numel() for s in shapes]), shapes)])


class _Views(torch.autograd.Function):
    """A flat parameter's views of `shapes`; backward: the deferred partial sums made, then the flat gradient
    gathered (kernels/pending.py)."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, shapes: list[torch.Size], sums: PendingSums, slots: GradientSlots):
        ctx.set_materialize_grads(False)
        ctx.sums, ctx.slots = sums, slots
        return _pieces(flat, shapes)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        ctx.sums.flush(grads)
        return ctx.slots.gather(grads), None, None, None


class FlatParameters:
    """The parameters of `owner` named in `groups` (group name -> parameter names), held as one flat parameter per
    group (`owner`'s parameter "flat_" + group name), in the order given.

    Made once, before the optimizer and DeepSpeed see the model; the values are copied, so the flat parameters start
    where the originals were. A parameter shared by several modules (tied weights) becomes one view that each of them
    reads. `owner`'s forward binds the views first (a forward pre-hook); a method of `owner` that reads parameters
    outside its forward calls `bind` itself. `owner.state_dict()` then holds the flat parameters; `unflatten` gives
    names back.
    """

    PREFIX = "flat_"

    def __init__(self, owner: nn.Module, groups: dict[str, list[str]]):
        self._owner = owner
        holders: dict[int, list[tuple[nn.Module, str]]] = {}  # every (module, attribute) holding a parameter
        for name, param in owner.named_parameters(remove_duplicate=False):
            module_name, _, attribute = name.rpartition(".")
            holders.setdefault(id(param), []).append((owner.get_submodule(module_name), attribute))
        self._slots: dict[str, list[tuple[list[tuple[nn.Module, str]], str, torch.Size]]] = {}  # (holders, name, shape)
        for group, names in groups.items():
            params = [owner.get_parameter(name) for name in names]
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            owner.register_parameter(self.PREFIX + group, nn.Parameter(flat))
            self._slots[group] = [(holders[id(param)], name, param.shape) for name, param in zip(names, params)]
            for module, attribute in (holder for param in params for holder in holders[id(param)]):
                del module._parameters[attribute]
        self.bind()
        owner.register_forward_pre_hook(lambda module, args: self.bind())

    def bind(self) -> None:
        """Point every module's parameter attribute at its view of the flat parameter as it is now (after a dtype
        change, a ZeRO repartition, an optimizer step that replaced the storage). Where the views take gradients, the
        fused kernels' backwards may defer the partial sums of theirs and write theirs in place, into the flat
        gradient (kernels/pending.py)."""
        for group, slots in self._slots.items():
            flat, shapes = self.parameter(group), [shape for _, _, shape in slots]
            if flat.requires_grad and torch.is_grad_enabled() and shapes:
                sums, gradient = PendingSums(), GradientSlots(shapes, flat.dtype, flat.device)
                views = _Views.apply(flat, shapes, sums, gradient)
                sums.attach(views)
                gradient.attach(views)
            else:
                views = _pieces(flat, shapes)
            for (holders, _, _), view in zip(slots, views):
                for module, attribute in holders:  # a plain attribute since __init__: nn.Module.__setattr__'s
                    module.__dict__[attribute] = view  # checks for a parameter, buffer or submodule (3 calls) skipped

    def parameter(self, group: str) -> nn.Parameter:
        """The flat parameter of `group`."""
        return getattr(self._owner, self.PREFIX + group)

    def unflatten(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`named` (tensors by the owner's parameter names, e.g. gathered master weights) with each flat parameter's
        entry replaced by copies of its pieces under their original names."""
        flat_names = {self.PREFIX + group for group in self._slots}
        out = {name: tensor for name, tensor in named.items() if name not in flat_names}
        for group, slots in self._slots.items():
            views = named[self.PREFIX + group].split([shape.numel() for _, _, shape in slots])
            out.update({name: view.view(shape).clone() for (_, name, shape), view in zip(slots, views)})
        return out
