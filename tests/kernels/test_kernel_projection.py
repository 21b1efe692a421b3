"""The QKV projection whose backward gathers the three heads' gradients (q's and k's rotated back where the forward
rotated them) and sums the bias's in one kernel (Triton), against the torch reference (linear, view, unbind, rotary),
forward and backward: with a bias, a rotary or both, widths of one, two (the last partial) and nine column blocks
(`launch.column_block`), rows no tile divides, the heads' gradients strided as an attention's backward may leave
them, fp32 and bf16."""

import pytest
import torch
from conftest import KERNEL_DEVICE
from fastmae.kernels import project_qkv, project_qkv_reference, projection
from tolerance import assert_as_accurate

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("rows, hidden, heads", [pytest.param(9, 1152, 18, id="N9-H1152"),  # nine blocks of 128
                                                  pytest.param(9, 1056, 33, id="N9-H1056"),  # two, the last partial
                                                  pytest.param(150, 64, 2, id="N150-H64")])  # several programs
@pytest.mark.parametrize("with_bias, with_rotary", [pytest.param(True, False, id="bias"),  # RoBERTa's
                                                    pytest.param(False, True, id="rotary"),  # ModernBERT's
                                                    pytest.param(True, True, id="bias+rotary")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_project_qkv_matches_the_reference_forward_and_backward(rows, hidden, heads, with_bias, with_rotary, dtype,
                                                                monkeypatch):
    monkeypatch.setattr(projection, "ROWS_PER_BIAS_PROGRAM", 16)
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, hidden, generator=gen), torch.randn(3 * hidden, hidden, generator=gen) / 8
    bias, grad = torch.randn(3 * hidden, generator=gen), torch.randn(3 * rows * hidden, generator=gen)
    angles = torch.rand(rows, hidden // heads // 2, generator=gen) * 6.3
    rotary = (angles.cos().to(KERNEL_DEVICE), angles.sin().to(KERNEL_DEVICE)) if with_rotary else None

    def run(fn, run_dtype):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (x, weight, bias)]
        q, k, v = fn(leaves[0], leaves[1], leaves[2] if with_bias else None, heads, rotary=rotary)
        # q's and v's gradients come back with heads, not rows, outermost (strided), k's contiguous
        flat = torch.cat([q.transpose(0, 1).reshape(-1), k.reshape(-1), v.transpose(0, 1).reshape(-1)])
        grads = torch.autograd.grad(flat, leaves if with_bias else leaves[:2], grad.to(KERNEL_DEVICE, run_dtype))
        return (flat, *grads)

    got, plain = run(project_qkv, dtype), run(project_qkv_reference, dtype)
    exact = run(project_qkv_reference, torch.float64)
    for name, g, p, e in zip(("qkv", "dx", "dweight", "dbias"), got, plain, exact):
        assert g.dtype == dtype
        assert_as_accurate(f"project_qkv {name}", g.cpu(), p.cpu(), e.cpu(), dtype, factor=2)


def test_project_qkv_names_what_it_cannot_take():
    x = torch.randn(4, 8, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"weight \[3H, H\]"):
        project_qkv(x, torch.randn(16, 8, device=KERNEL_DEVICE), torch.randn(16, device=KERNEL_DEVICE), 2)
    with pytest.raises(ValueError, match="3 heads do not divide the width 8"):
        project_qkv(x, torch.randn(24, 8, device=KERNEL_DEVICE), torch.randn(24, device=KERNEL_DEVICE), 3)


@pytest.mark.parametrize("claimed", [True, False], ids=["claimed", "unclaimed"])
def test_a_residuals_gradient_handed_to_the_projection_is_added_by_its_gemm(claimed):
    """x feeds a projection and, as the residual, the norm after it (a post-LN sublayer): where the projection claims
    the handoff, the norm's backward hands it the residual's gradient and returns none, and the projection's input
    gradient adds it, in place: the gradient is the handed tensor (torch's out-of-place addmm would copy it into a
    new output first, a pass over the rows); unclaimed, the norm returns it and autograd adds the two. Either way x's
    gradient is torch's."""
    from fastmae.kernels import ResidualGrad, add_layer_norm, add_layer_norm_reference, project

    gen = torch.Generator().manual_seed(11)
    x, weight = torch.randn(21, 48, generator=gen), torch.randn(48, 48, generator=gen) / 7
    norm_weight, grad = 1 + 0.1 * torch.randn(48, generator=gen), torch.randn(21, 48, generator=gen)

    class Recorded(ResidualGrad):
        def put(self, grad):
            handed.append(grad.shape)
            pointers.append(grad.data_ptr())
            super().put(grad)

    handed, pointers = [], []

    def run(fused, dtype):
        leaf = x.to(KERNEL_DEVICE, dtype).requires_grad_()
        w, nw = weight.to(KERNEL_DEVICE, dtype), norm_weight.to(KERNEL_DEVICE, dtype)
        handoff = Recorded()
        if fused:
            y, _ = add_layer_norm(project(leaf, w, handoff if claimed else None), leaf, nw, None,
                                  residual_grad=handoff)
        else:
            y, _ = add_layer_norm_reference(leaf @ w.t(), leaf, nw, None)
        (dx,) = torch.autograd.grad(y, leaf, grad.to(KERNEL_DEVICE, dtype))
        assert handoff.take() is None  # taken by the projection's backward, or never put
        if fused and claimed:  # the projection's input gradient, added by its GEMM into the handed tensor
            assert dx.data_ptr() == pointers[-1], "the handed gradient was copied"
        return [dx]

    got, plain, exact = run(True, torch.float32), run(False, torch.float32), run(False, torch.float64)
    assert handed == ([(21, 48)] if claimed else [])  # the norm handed its residual's gradient over only if claimed
    assert_as_accurate(f"residual handoff dx ({'claimed' if claimed else 'unclaimed'})", got[0].cpu(),
                       plain[0].cpu(), exact[0].cpu(), torch.float32, factor=2)
