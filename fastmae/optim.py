"""The optimizer (fused AdamW that clips on the device) and its parameter groups (the learning-rate schedule:
fastmae/schedule.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class ClippingAdamW(torch.optim.AdamW):
    """torch's fused AdamW that first scales the gradients it steps to a global norm of at most `max_norm`, on the
    device: nothing is read back to the host (DeepSpeed's clipping reads the norm to decide; ARCHITECTURE.md
    section 5).

    The global norm is computed here from the gradients stepped, unless `global_norm` supplies it: DeepSpeed's ZeRO
    optimizers step one parameter group at a time with only that group's gradients, having computed the global norm
    (summed over ranks) first, and `fastmae.engine` points `global_norm` at it. A non-finite norm sets `found_inf`
    (the run's skip flag, a device fp32 scalar), and the fused step then changes nothing. The coefficient is
    DeepSpeed's: max_norm / (norm + 1e-6), applied when below 1, by the fused step itself as it reads each gradient
    (its `grad_scale`, the divisor (norm + 1e-6) / max_norm at least 1: no pass of its own over the gradients).
    """

    def __init__(self, params, *, max_norm: float, found_inf: torch.Tensor | None, **kwargs):
        super().__init__(params, fused=True, **kwargs)
        self.max_norm = max_norm
        self.found_inf = found_inf  # read by the fused kernel on every step (None: never skip)
        self.global_norm: Callable[[], torch.Tensor] | None = None
        self.last_norm: torch.Tensor | None = None  # the global norm before clipping, on the device
        self.grad_scale: torch.Tensor | None = None  # what the fused step divides the gradients by: the clip

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            if self.global_norm is None:
                norm = torch.stack(torch._foreach_norm(grads)).float().square().sum().sqrt()
            else:
                norm = self.global_norm()
            if norm is not self.last_norm:  # under ZeRO each group's step sees the same norm: once per norm
                self.last_norm = norm
                if self.found_inf is not None:
                    torch.maximum(self.found_inf, (norm * 0).ne(0), out=self.found_inf)  # inf, NaN: NaN
                if self.max_norm > 0:  # 1 / torch's clip_grads_with_norm_ coefficient, without a host read
                    self.grad_scale = torch.clamp((norm + 1e-6) / self.max_norm, min=1.0).float()
        return super().step(closure)


def decay_groups(model: nn.Module) -> dict[str, list[str]]:
    """Names of the trained parameters by weight decay: "decay" for matrices, "no_decay" for biases, LayerNorm
    parameters and 1-D tensors (as in RoBERTa)."""
    groups = {"decay": [], "no_decay": []}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups["decay" if param.ndim >= 2 and "norm" not in name else "no_decay"].append(name)
    return groups


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The optimizer's two groups (`decay_groups`), with weight decay on the first only; a model whose parameters
    are flat (`fastmae.flat`) has one flat parameter per group."""
    flat = getattr(model, "flat", None)
    decays = {"decay": weight_decay, "no_decay": 0.0}
    if flat is not None:
        return [{"params": [flat.parameter(group)], "weight_decay": decay} for group, decay in decays.items()]
    named = dict(model.named_parameters())
    return [{"params": [named[name] for name in names], "weight_decay": decays[group]}
            for group, names in decay_groups(model).items()]
