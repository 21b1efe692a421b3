import pytest
import torch

from fastmae.dropout import Dropout, drop_mask, dropout


@pytest.mark.parametrize("p", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_drop_rate_and_survivor_scale(p, seed):
    torch.manual_seed(seed)
    x = torch.randn(512, 1031)  # an element count that is not a multiple of four
    y = dropout(x, p)
    dropped = y == 0
    rate = dropped.double().mean().item()
    assert abs(rate - p) < 5 * (p * (1 - p) / x.numel()) ** 0.5  # 5 sigma of a binomial rate
    p_used = round(p * 65536) / 65536
    torch.testing.assert_close(y[~dropped], x[~dropped] / (1 - p_used), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_is_the_same_mask_and_scale(dtype):
    torch.manual_seed(3)
    x = torch.randn(64, 33, dtype=dtype, requires_grad=True)
    y = dropout(x, 0.3)
    grad = torch.randn_like(y)
    y.backward(grad)
    keep = (y != 0).to(dtype)
    scale = 1 / (1 - round(0.3 * 65536) / 65536)
    torch.testing.assert_close(x.grad, grad * keep * scale)


def test_seeded_draws_repeat_and_differ_between_calls():
    torch.manual_seed(7)
    first, second = drop_mask((100, 10), 0.2)[0], drop_mask((100, 10), 0.2)[0]
    torch.manual_seed(7)
    assert torch.equal(drop_mask((100, 10), 0.2)[0], first)
    assert not torch.equal(first, second)


def test_identity_in_eval_and_at_zero_and_bad_probabilities_named():
    x = torch.randn(10, 10)
    module = Dropout(0.5).eval()
    assert module(x) is x
    assert dropout(x, 0.0) is x
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=str(bad)):
            Dropout(bad)
        with pytest.raises(ValueError, match=str(bad)):
            dropout(x, bad)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_hashed_dropout_drops_at_its_rate_and_each_key_its_own_elements(p):
    """The fused norm kernel's dropout (kernels/hashing.py `hashed_keep`): the rate p within 5 sigma over each row and
    column band, the scale 1 / (1 - p used), and two keys' masks as unrelated as two draws (agreeing on p^2 + (1-p)^2
    of the elements)."""
    from fastmae.kernels.hashing import dropout_threshold, hashed_keep

    rows, hidden = 4096, 768
    masks = [hashed_keep(rows, hidden, p, torch.tensor([key]))[0] for key in (0, 1, 0x9E3779B1)]
    sigma = (p * (1 - p) / (rows * hidden)) ** 0.5
    for kept in masks:
        assert abs(1 - kept.double().mean().item() - p) < 5 * sigma
        for band in (kept[:64], kept[:, :16]):  # the first rows, the first columns: no counter pattern shows
            assert abs(1 - band.double().mean().item() - p) < 5 * (p * (1 - p) / band.numel()) ** 0.5
    agree = (masks[0] == masks[1]).double().mean().item()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 10 * sigma
    threshold, scale = dropout_threshold(p)
    assert threshold == round(p * 2**31) and scale == pytest.approx(1 / (1 - p), rel=1e-8)
    with pytest.raises(ValueError, match="not in"):
        dropout_threshold(1.0)
