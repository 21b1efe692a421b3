"""Flat parameters: a model's parameters held in one contiguous tensor per optimizer group (ARCHITECTURE.md
section 5).

DeepSpeed's ZeRO-1/2 optimizers and its bf16 gradient hooks work parameter by parameter: a cast, an add or a copy of
every gradient and a norm of every partition, ~4 device ops per parameter and optimizer step, which for base's ~200
parameters is more ops than the model's own forward and backward together. Held flat, the same work is a few ops on
two tensors, as FSDP does it.

The modules keep reading `self.weight`: their parameters become plain tensor attributes, views into the flat
parameter that `bind()` makes afresh at the start of every forward (one split: views only, no copy). Autograd sums the
views' gradients into the flat parameter's gradient with one concatenation in the backward, so the flat gradient is
ready only when the whole backward is done: ZeRO's reduction cannot overlap the backward (`train.flat_parameters`).
"""

from __future__ import annotations

import torch
from torch import nn

from .kernels.pending import PENDING_ATTRIBUTE, PendingSums


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
        fused kernels' backwards may defer the partial sums of theirs to the concatenation of them
        (kernels/pending.py, flushed by a hook on it)."""
        for group, slots in self._slots.items():
            pieces = self.parameter(group).split([shape.numel() for _, _, shape in slots])
            views = [piece.view(shape) for (_, _, shape), piece in zip(slots, pieces)]
            if pieces and pieces[0].grad_fn is not None:
                pending = PendingSums(views)
                pieces[0].grad_fn.register_prehook(pending.flush)
                for view in views:
                    setattr(view, PENDING_ATTRIBUTE, pending)
            for (holders, _, _), view in zip(slots, views):
                for module, attribute in holders:
                    setattr(module, attribute, view)

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
