"""Fused linear cross-entropy (Triton) against the torch reference and an fp64 oracle, forward and backward."""

from collections import Counter

import pytest
import torch
from conftest import KERNEL_DEVICE
from fastmae.kernels import cross_entropy, linear_cross_entropy, linear_cross_entropy_reference
from fastmae.kernels.cross_entropy import (
    CE_BLOCK_V,
    CE_CHUNK_BYTES,
    CE_GROUP_ROWS,
    CE_MIN_CHUNK_ROWS,
    CE_VOCAB_ALIGN,
    chunk_rows,
)
from tolerance import assert_as_accurate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# DeepSpeed hands the loss a gradient of loss_scale / grad_accum (times fastmae's per-token weight), not 1
INCOMING_GRAD = 0.37 * 2**10
SHAPES = [pytest.param(1, 8, 7, id="N1-H8-V7"), pytest.param(33, 20, 1000, id="N33-H20-V1000"),
          pytest.param(70, 48, CE_BLOCK_V + 907, id=f"N70-H48-V{CE_BLOCK_V + 907}"),
          pytest.param(4096, 768, 50265, id="N4096-H768-V50265", marks=pytest.mark.large)]
OPTIONS = [pytest.param({}, id="plain"), pytest.param({"label_smoothing": 0.1}, id="smoothing"),
           pytest.param({"z_loss": 1e-3}, id="z-loss"), pytest.param({"ignore": True}, id="ignore-index")]


@pytest.mark.parametrize("rows, hidden, vocab", SHAPES)
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_linear_cross_entropy(rows, hidden, vocab, options, dtype, nan_empty):
    gen = torch.Generator().manual_seed(rows + sum(map(ord, "".join(options))))  # a seed per shape and option
    x, w, b = torch.randn(rows, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen) / hidden**0.5, \
        torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    options = dict(options)
    if options.pop("ignore", False):
        labels[::3] = -100

    got = _loss_and_grads(linear_cross_entropy, x, w, b, labels, dtype, options)
    plain = _loss_and_grads(linear_cross_entropy_reference, x, w, b, labels, dtype, options)
    exact = _loss_and_grads(linear_cross_entropy_reference, x, w, b, labels, torch.float64, options)
    assert got[0].dtype == torch.float32
    for i, (g, p, e) in enumerate(zip(got, plain, exact)):
        assert_as_accurate(["loss", "dx", "dw", "db"][i], g, p, e, dtype, factor=2 if i == 0 else 3)


def _loss_and_grads(fn, x, w, b, labels, dtype, options):
    leaves = [t.to(KERNEL_DEVICE, dtype).requires_grad_() for t in (x, w, b)]
    loss = fn(*leaves, labels.to(KERNEL_DEVICE), **options)
    return [loss, *torch.autograd.grad(loss, leaves, torch.tensor(INCOMING_GRAD, device=loss.device))]


def test_the_accuracy_rule_catches_a_dropped_vocabulary_block_in_bf16():
    gen = torch.Generator().manual_seed(0)
    rows, hidden, vocab = 70, 48, CE_BLOCK_V + 907
    x, w, b = torch.randn(rows, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen) / hidden**0.5, \
        torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    got = _loss_and_grads(linear_cross_entropy, x, w, b, labels, torch.bfloat16, {})
    plain = _loss_and_grads(linear_cross_entropy_reference, x, w, b, labels, torch.bfloat16, {})
    exact = _loss_and_grads(linear_cross_entropy_reference, x, w, b, labels, torch.float64, {})
    assert_as_accurate("db", got[3], plain[3], exact[3], torch.bfloat16, factor=3)
    dropped = got[3].clone()
    dropped[CE_BLOCK_V:] = 0  # what a kernel that skipped the last vocabulary block would return
    with pytest.raises(AssertionError, match="db: error"):
        assert_as_accurate("db", dropped, plain[3], exact[3], torch.bfloat16, factor=3)


def test_fp16_gradients_survive_until_the_loss_scale():
    """In fp16 the per-logit gradients divided by the row count underflow; the kernel keeps them unscaled in fp32
    until backward, so with a typical loss scale no gradient that matters is lost."""
    gen = torch.Generator().manual_seed(1)
    rows, hidden, vocab = 512, 32, 3000
    x, w = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    options = {}
    got = _loss_and_grads(linear_cross_entropy, x, w, torch.zeros(vocab), labels, torch.float16, options)
    exact = _loss_and_grads(linear_cross_entropy_reference, x, w, torch.zeros(vocab), labels, torch.float64, options)
    for name, g, e in zip(["dx", "dw"], got[1:3], exact[1:3]):
        assert ((g.double() - e).norm() / e.norm()).item() < 1e-2, name


def test_no_rows_gives_zero_loss_and_gradient():
    x = torch.zeros(0, 8, device=KERNEL_DEVICE, requires_grad=True)
    w = torch.randn(11, 8, device=KERNEL_DEVICE, requires_grad=True)
    loss = linear_cross_entropy(x, w, None, torch.zeros(0, dtype=torch.long, device=KERNEL_DEVICE))
    loss.backward()
    assert loss.item() == 0.0 and w.grad.abs().sum() == 0


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="do not fit"):
        linear_cross_entropy(torch.randn(3, 8), torch.randn(10, 7), None, torch.zeros(3, dtype=torch.long))


def test_chunks_are_sized_from_the_memory_budget():
    # base size: T_m = 8,192 predicted rows of a 50,265-piece vocabulary -> a handful of chunks, each within budget
    for element_bytes, expected_rows in ((2, 2048), (4, 1024)):
        rows = chunk_rows(8192, 50265, element_bytes, CE_CHUNK_BYTES)
        assert rows == expected_rows and rows * 50265 * element_bytes <= CE_CHUNK_BYTES
        assert 8192 // rows <= 8
    assert chunk_rows(70, 5003, 4, CE_CHUNK_BYTES) == 128  # small batches: one chunk
    assert chunk_rows(8192, 50265, 4, 1000) == CE_MIN_CHUNK_ROWS  # never below the GEMM-sized minimum


class _Allocations(TorchDispatchMode):
    """Counts the shapes of the tensors that aten ops allocate."""

    def __init__(self):
        super().__init__()
        self.shapes = Counter()
        self.zeroed = 0  # zero fills of tensors with more than one element
        self.summed = Counter()  # the shapes torch's sums read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.zeros.default, torch.ops.aten.zero_.default) and out.numel() > 1:
            self.zeroed += 1
        if func.overloadpacket is torch.ops.aten.sum:
            self.summed[tuple(args[0].shape)] += 1
        # views, in-place ops and out= overloads allocate nothing
        if not func.is_view and not func._schema.name.endswith("_") and "out" not in func._overloadname:
            self.shapes.update(tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_work_and_allocations(dtype, monkeypatch):
    """Four chunks of 32 rows: one [32, V'] logits tensor each (V' = V padded to CE_VOCAB_ALIGN); the weight gradient
    adds in place into one [V', H] fp32 buffer (in bf16 on CPU through one [V', H] product per chunk and its fp32
    copy); the bias's is summed from the gradient kernel's partial sums (one [V] row a group of rows: four here), no
    torch sum reading the logits again; backward writes the scaled gradients of x, the weight and the bias in their
    dtypes, each into an allocation of its own (the parameters' outlive x's: `launch.carve`), no [V, H] product in
    fp32 and then its cast; under no_grad no gradient work."""
    rows, hidden, vocab = 128, 16, 1000
    padded = vocab + -vocab % CE_VOCAB_ALIGN
    monkeypatch.setattr(cross_entropy, "CE_CHUNK_BYTES", 32 * padded * torch.tensor([], dtype=dtype).element_size())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, hidden, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
    b = torch.randn(vocab, generator=gen).to(KERNEL_DEVICE, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), generator=gen).to(KERNEL_DEVICE)
    with _Allocations() as train:
        linear_cross_entropy(x, w, b, labels).backward()
    assert train.shapes[(32, padded)] == 4 and train.shapes[(rows, padded)] == 0
    # the padded weight and the fp32 buffer (not zero-filled: the first chunk's product writes it); on CPU in bf16
    # each chunk's product, added into the buffer as it is
    per_chunk = 1 if dtype == torch.bfloat16 and KERNEL_DEVICE == "cpu" else 0
    assert train.shapes[(padded, hidden)] == 2 + 4 * per_chunk
    assert train.zeroed == 0  # nor the bias's
    # x's gradient: one [N, H] buffer its GEMMs write in place, no [32, H] product a chunk
    assert train.shapes[(32, hidden)] == 0
    # the bias's gradient: four rows of partial sums, summed into one fp32 [V] (not padded), no torch sum but the
    # loss's over its rows
    assert train.shapes[(4, vocab)] == 1 and set(train.summed) == {(rows,)}
    # backward: each scaled gradient in its own allocation, in its dtype: [N, H] twice (the forward's unscaled
    # gradient of x, and this), [V, H] once (the forward's is a slice of its padded-vocabulary buffer), [V] twice
    # (the forward's fp32 sums, and this)
    assert train.shapes[(vocab, hidden)] == 1 and train.shapes[(rows, hidden)] == 2 and train.shapes[(vocab,)] == 2
    with torch.no_grad(), _Allocations() as evaluation:
        loss = linear_cross_entropy(x, w, b, labels)
    assert evaluation.shapes[(32, padded)] == 4 and evaluation.shapes[(padded, hidden)] == 1
    assert evaluation.shapes[(vocab, hidden)] == 0
    with torch.no_grad(), _Allocations() as aligned:  # an aligned vocabulary is used as it is: no padded copy
        linear_cross_entropy(x, w[:padded - CE_VOCAB_ALIGN], b[:padded - CE_VOCAB_ALIGN], labels % 960)
    assert aligned.shapes[(padded - CE_VOCAB_ALIGN, hidden)] == 0
    assert evaluation.shapes[(rows, hidden)] == 0 and evaluation.shapes[(vocab,)] == 0
    reference = linear_cross_entropy_reference(x.double(), w.double(), b.double(), labels)
    assert_as_accurate("loss", loss, linear_cross_entropy_reference(x, w, b, labels), reference, dtype, factor=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed, group_rows, options", [
    pytest.param(0, CE_GROUP_ROWS, {}, id="group-a-chunk"),
    pytest.param(1, 10, {"label_smoothing": 0.1, "z_loss": 1e-3}, id="groups-of-10-smoothing-z-loss")])
def test_many_chunks_match_the_reference(dtype, seed, group_rows, options, monkeypatch):
    """The default budget puts small test batches in one chunk; this forces chunks of 32 rows (and a ragged last
    one) through forward and backward, the bias's gradient summed over one group of rows a chunk, or over groups of
    10 (a ragged tile of the gradient kernel's rows in each, and a ragged group in each chunk)."""
    rows, hidden, vocab = 70, 48, CE_BLOCK_V + 907
    padded = vocab + -vocab % CE_VOCAB_ALIGN
    monkeypatch.setattr(cross_entropy, "CE_CHUNK_BYTES", 32 * padded * torch.tensor([], dtype=dtype).element_size())
    monkeypatch.setattr(cross_entropy, "CE_GROUP_ROWS", group_rows)
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, hidden, generator=gen), torch.randn(vocab, hidden, generator=gen) / hidden**0.5, \
        torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::3] = -100
    got = _loss_and_grads(linear_cross_entropy, x, w, b, labels, dtype, options)
    plain = _loss_and_grads(linear_cross_entropy_reference, x, w, b, labels, dtype, options)
    exact = _loss_and_grads(linear_cross_entropy_reference, x, w, b, labels, torch.float64, options)
    for i, (g, p, e) in enumerate(zip(got, plain, exact)):
        assert_as_accurate(["loss", "dx", "dw", "db"][i], g, p, e, dtype, factor=2 if i == 0 else 3)


@pytest.mark.parametrize("fn", [linear_cross_entropy, linear_cross_entropy_reference], ids=["triton", "reference"])
def test_a_host_count_of_the_rows_gives_the_same_loss_and_gradients(fn):
    # the model passes its host count of predicted rows (num_counted): no device count, the same result
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(33, 20, generator=gen), torch.randn(1000, 20, generator=gen), torch.randn(1000, generator=gen)
    labels = torch.randint(0, 1000, (33,), generator=gen)
    labels[::4] = -100
    counted = _loss_and_grads(fn, x, w, b, labels, torch.float32, {"num_counted": int((labels != -100).sum())})
    for got, expected in zip(counted, _loss_and_grads(fn, x, w, b, labels, torch.float32, {})):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    wrong = _loss_and_grads(fn, x, w, b, labels, torch.float32, {"num_counted": 33})
    assert not torch.allclose(wrong[0], counted[0])  # the count is what divides
