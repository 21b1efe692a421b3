"""Flat parameters (fastmae/flat.py): the same model, its parameters held in one tensor per weight-decay group."""

import copy

import pytest
import torch
from conftest import tiny_batch, tiny_model

from fastmae.flat import FlatParameters
from fastmae.masking import mask_batch
from fastmae.optim import decay_groups, param_groups


@pytest.mark.parametrize("preset, extra", [("3ml", {}), ("mlm", {"norm_position": "pre"}),
                                           ("mae-lm", {"position_embedding": "rotary", "decoder_kind": "cross"})])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_flat_model_computes_the_same_loss_and_gradients(preset, extra, seed):
    plain = tiny_model(preset, seed=seed, **extra)
    flat = copy.deepcopy(plain)
    groups = decay_groups(flat)
    flat.flat = FlatParameters(flat, groups)
    assert [name for name, _ in flat.named_parameters()] == ["flat_decay", "flat_no_decay"]
    batch = tiny_batch(seed=seed)
    masked = mask_batch(batch, plain.config, seed=seed, step=3)
    for _ in range(2):  # the second forward rebinds the views to the (updated) flat parameters
        expected, got = plain(masked), flat(masked)
        torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)
        expected.loss.backward()
        got.loss.backward()
        grads = flat.flat.unflatten({name: p.grad for name, p in flat.named_parameters()})
        for name, param in plain.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=0, msg=name)
        with torch.no_grad():  # one SGD step on both, through the flat tensors on one side
            for param in [*plain.parameters(), *flat.parameters()]:
                param -= 0.1 * param.grad
                param.grad = None
    weights = flat.flat.unflatten(dict(flat.named_parameters()))
    assert {name: tensor.shape for name, tensor in weights.items()} == {
        name: p.shape for name, p in plain.named_parameters()}
    for name, param in plain.named_parameters():
        torch.testing.assert_close(weights[name], param.detach(), rtol=0, atol=0, msg=name)
    flat.double(), plain.double()  # new storage, which the next forward's views must read
    torch.testing.assert_close(flat.encode(batch), plain.encode(batch), rtol=0, atol=0)


def test_the_flat_groups_are_the_weight_decay_groups():
    model = tiny_model("3ml")
    groups = decay_groups(model)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    assert "embeddings.tokens.weight" in groups["decay"] and "embeddings.norm.weight" in groups["no_decay"]
    model.flat = FlatParameters(model, groups)
    decay, no_decay = param_groups(model, 0.01)
    assert decay["params"] == [model.flat_decay] and decay["weight_decay"] == 0.01
    assert no_decay["params"] == [model.flat_no_decay] and no_decay["weight_decay"] == 0.0
    assert model.flat_decay.numel() == sum(sizes[name] for name in groups["decay"])
    assert model.flat_no_decay.numel() == sum(sizes[name] for name in groups["no_decay"])


def test_a_tied_parameter_is_one_view_that_every_holder_reads():
    # as Hugging Face ties its LM head to the embeddings: one parameter, two modules, gradients of both uses summed
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    plain[1].weight = plain[0].weight
    flat = copy.deepcopy(plain)
    flat.flat = FlatParameters(flat, decay_groups(flat))
    ids = torch.tensor([1, 2, 3, 2])
    expected, got = plain(ids), flat(ids)  # the forward pre-hook binds the views
    assert flat[0].weight is flat[1].weight and torch.equal(got, expected)
    expected.square().sum().backward()
    got.square().sum().backward()
    grads = flat.flat.unflatten({name: p.grad for name, p in flat.named_parameters()})
    assert sorted(grads) == ["0.weight", "1.bias"]
    torch.testing.assert_close(grads["0.weight"], plain[0].weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(grads["1.bias"], plain[1].bias.grad, rtol=0, atol=0)
