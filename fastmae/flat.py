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


class FlatParameters(nn.Module):
    """The parameters of `owner` named in `groups` (group name -> parameter names), held as one flat parameter per
    group (this module's parameter of that name), in the order given.

    Made once, before the optimizer and DeepSpeed see the model; the values are copied, so the flat parameters start
    where the originals were. `owner.state_dict()` then holds the flat parameters; `unflatten` gives names back.
    """

    def __init__(self, owner: nn.Module, groups: dict[str, list[str]]):
        super().__init__()
        self._slots: dict[str, list[tuple[nn.Module, str, str, torch.Size]]] = {}  # (module, attribute, name, shape)
        for group, names in groups.items():
            params = [owner.get_parameter(name) for name in names]
            self.register_parameter(group, nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params])))
            slots = []
            for name, param in zip(names, params):
                module_name, _, attribute = name.rpartition(".")
                module = owner.get_submodule(module_name)
                del module._parameters[attribute]
                slots.append((module, attribute, name, param.shape))
            self._slots[group] = slots
        self.bind()

    def bind(self) -> None:
        """Point every module's parameter attribute at its view of the flat parameter as it is now (after a dtype
        change, a ZeRO repartition, an optimizer step that replaced the storage)."""
        for group, slots in self._slots.items():
            views = getattr(self, group).split([shape.numel() for _, _, _, shape in slots])
            for (module, attribute, _, shape), view in zip(slots, views):
                setattr(module, attribute, view.view(shape))

    def unflatten(self, named: dict[str, torch.Tensor], prefix: str = "flat.") -> dict[str, torch.Tensor]:
        """`named` (tensors by the owner's parameter names, e.g. gathered master weights) with each flat parameter's
        entry (`prefix` + group name) replaced by copies of its pieces under their original names."""
        out = {name: tensor for name, tensor in named.items() if not name.startswith(prefix)}
        for group, slots in self._slots.items():
            views = named[prefix + group].split([shape.numel() for _, _, _, shape in slots])
            out.update({name: view.view(shape).clone() for (_, _, name, shape), view in zip(slots, views)})
        return out
