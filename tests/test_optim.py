"""fastmae's optimizer: device-side clipping against torch's clip_grad_norm_ + AdamW, and the skip of a non-finite
gradient."""

import pytest
import torch

from fastmae import MaskedLM, ModelConfig
from fastmae.config import load_run_config
from fastmae.optim import ClippingAdamW


def _params(seed: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=gen).requires_grad_() for shape in ((7, 5), (5,), (3, 4, 2))]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=gen)
    return params


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale, max_norm", [(10.0, 2.0), (0.01, 2.0), (10.0, 0.0)])  # clipped, not, clipping off
def test_clipping_adamw_is_clip_grad_norm_then_adamw(seed, scale, max_norm):
    ours, reference = _params(seed, scale), _params(seed, scale)
    found_inf = torch.zeros(())
    optimizer = ClippingAdamW(ours, lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01, max_norm=max_norm,
                              found_inf=found_inf)
    expected = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    for _ in range(2):
        norm = torch.nn.utils.get_total_norm([p.grad for p in reference])
        if max_norm:
            torch.nn.utils.clip_grad_norm_(reference, max_norm)
        expected.step()
        optimizer.step()
        torch.testing.assert_close(optimizer.last_norm, norm, rtol=1e-6, atol=0)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert found_inf.item() == 0


def test_a_non_finite_gradient_sets_the_skip_flag_and_changes_nothing():
    params = _params(0, 1.0)
    before = [p.detach().clone() for p in params]
    params[1].grad[2] = float("nan")
    found_inf = torch.zeros(())
    ClippingAdamW(params, lr=1e-2, max_norm=2.0, found_inf=found_inf).step()
    assert found_inf.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def test_lamb_is_refused_where_deepspeed_cannot_build_it(monkeypatch):
    """DeepSpeed's fused LAMB is CUDA only and, unless prebuilt, compiled at first use with nvcc: refused before
    DeepSpeed starts, with the reason, instead of a build failure inside deepspeed.initialize."""
    from deepspeed.ops.op_builder.fused_lamb import FusedLambBuilder
    from torch.utils import cpp_extension

    from fastmae.engine import build_engine, lamb_obstacle
    from fastmae.errors import FastmaeError

    assert "CUDA only" in lamb_obstacle(torch.device("cpu"))
    config = load_run_config(None, ["train.optimizer=lamb"])
    with pytest.raises(FastmaeError, match="train.optimizer=lamb: DeepSpeed's fused LAMB runs on CUDA only"):
        build_engine(MaskedLM(ModelConfig.preset("mlm", hidden_size=16, num_heads=2, encoder_layers=1,
                                                 vocab_size=64)), config, "fp32", torch.device("cpu"))
    monkeypatch.setattr(FusedLambBuilder, "is_compatible", lambda self, verbose=False: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert "needs nvcc" in lamb_obstacle(torch.device("cuda"))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    assert lamb_obstacle(torch.device("cuda")) is None
    monkeypatch.setattr(FusedLambBuilder, "is_compatible", lambda self, verbose=False: False)
    assert "cannot build it" in lamb_obstacle(torch.device("cuda"))
