"""The model with its Triton kernels equals the model with the torch references: losses, gradients, training."""

import collections
import sys
from pathlib import Path

import pytest
import torch
from conftest import KERNEL_DEVICE, tiny_batch, tiny_model
from fastmae.kernels import launch, pending
from simple_training import LoopConfig, demo_documents, train_on_documents
from torch.utils._python_dispatch import TorchDispatchMode

from fastmae import kernels
from fastmae.flat import FlatParameters
from fastmae.optim import decay_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from host_overhead import StepCounter, _is_metadata  # noqa: E402

VARIANTS = [
    pytest.param("mlm", {}, id="mlm"),
    pytest.param("mae-lm", {}, id="mae-lm"),
    pytest.param("3ml", {"decoder_kind": "cross"}, id="3ml-cross"),
    pytest.param("mae-lm", {"decoder_layers": 1}, id="mae-lm-one-decoder-layer"),
    pytest.param("3ml", {"position_embedding": "rotary", "norm_position": "pre"}, id="3ml-rotary-pre"),
    pytest.param("mlm", {"insert_layer": 1}, id="mask-later-k1"),
    pytest.param("mae-lm", {"relative_attention_bias": True}, id="mae-lm-relative-bias"),
]


@pytest.mark.parametrize("preset, extra", [VARIANTS[0], VARIANTS[4]])
def test_a_parameters_gradient_keeps_no_rows_alive(preset, extra, monkeypatch):
    """The fused backwards return each parameter's gradient in an allocation of parameter gradients only: autograd
    holds them to the end of the backward (flat parameters concatenate them there), so one carved beside a backward's
    rows' gradients (`launch.carve`) kept those rows alive with it, every layer's, until the backward ended."""
    _, grads = loss_and_grads(preset, extra, "triton", monkeypatch)
    by_storage: dict[int, list[torch.Tensor]] = {}
    for grad in grads.values():
        by_storage.setdefault(grad.untyped_storage().data_ptr(), []).append(grad)
    for shared in by_storage.values():
        held = shared[0].untyped_storage().nbytes()
        own = sum(-(-g.numel() * g.element_size() // 256) * 256 for g in shared)  # carve aligns to 256 bytes
        assert held <= own, ([tuple(g.shape) for g in shared], held, own)


class CountedLaunches:
    """A Triton kernel whose launches' grids are kept: `launch._sum_parts_kernel`'s third index counts its entries."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("preset, extra", [VARIANTS[0], VARIANTS[4]])
def test_flat_parameters_sum_their_partial_sums_together(preset, extra, monkeypatch):
    """Under flat parameters the fused backwards defer their parameters' partial sums (kernels/pending.py): a launch
    adds up to SUM_ENTRIES of them, the last ones when the views' gradients are concatenated; the gradients those
    summed one at a time give, bit for bit, in fewer launches."""
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")
    kernel = launch._sum_parts_kernel
    runs = []
    for defer in (True, False):
        if not defer:  # every deferral declined: each sum at once, as without flat parameters
            monkeypatch.setattr(pending.PendingSums, "add", lambda self, *entry: False)
        counted = CountedLaunches(kernel)
        monkeypatch.setattr(launch, "_sum_parts_kernel", counted)
        model = tiny_model(preset, **extra).to(KERNEL_DEVICE)
        model.flat = FlatParameters(model, decay_groups(model))
        model(tiny_batch(4, seed=4).to(KERNEL_DEVICE), seed=3, step=1).loss.backward()
        runs.append(({name: p.grad for name, p in model.named_parameters()}, [grid[2] for grid in counted.grids]))
    (grads, entries), (one_at_a_time, entries_one_at_a_time) = runs
    assert grads.keys() == one_at_a_time.keys() and all(torch.equal(grads[n], one_at_a_time[n]) for n in grads)
    # a launch takes the sums of one tile (`launch.sum_tile`): at these few rows a norm's partial rows and a bias's
    # differ in number, at the throughput benchmark's a layer's four are 1,024 rows each, one launch
    assert set(entries_one_at_a_time) == {1} and max(entries) > 1, entries
    assert sum(entries) == sum(entries_one_at_a_time) and len(entries) < len(entries_one_at_a_time), entries


@pytest.mark.parametrize("preset, extra", [pytest.param("3ml", {}, id="3ml")])  # post-LN, the `<mask>` row
def test_flat_gradients_are_written_in_place(preset, extra, monkeypatch):
    """Under flat parameters the weights' gradient GEMMs, the embedding tables' kernels and the tied LM head write
    their gradients into the flat gradient, the head's handed to the token table's kernels, which add into it
    (kernels/pending.py): the gradients the model without flat parameters gets, bit for bit, without a pass over a
    tensor the token table's size in the backward, where that model zero-fills the table's gradient and adds the
    head's to it (and autograd's split would concatenate copies of the weights' gradients; the no-decay group's,
    norms and biases summed by the sums kernel, still is)."""
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")
    grads, passes = [], []
    for flat in (True, False):
        model = tiny_model(preset, **extra).to(KERNEL_DEVICE)
        if flat:
            model.flat = FlatParameters(model, decay_groups(model))
        sizes = {model.embeddings.tokens.weight.numel()} | ({model.flat_decay.numel()} if flat else set())
        out = model(tiny_batch(4, seed=4).to(KERNEL_DEVICE), seed=3, step=1)
        with TouchingSizes(sizes) as touching:
            out.loss.backward()
        named = {name: p.grad for name, p in model.named_parameters()}
        grads.append(model.flat.unflatten(named) if flat else named)
        passes.append(touching.ops)
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[1].items():
        assert torch.equal(grads[0][name], grad), name
    assert passes[0] == {} and passes[1], passes


class Readers(torch.nn.Module):
    """A token table the LM head is tied to, a weight two projections read, a piece of a flat parameter that is not
    16-byte aligned (after `odd`) and one no gradient reaches."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.odd = torch.nn.Parameter(torch.randn(3, generator=gen))
        self.shifted = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
        self.pad = torch.nn.Parameter(torch.randn(1, generator=gen))  # the pieces after it aligned again
        self.table = torch.nn.Parameter(torch.randn(11, 8, generator=gen))
        self.twice = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
        self.unread = torch.nn.Parameter(torch.randn(5, generator=gen))

    def forward(self, ids, labels, lookup_counts):
        rows = kernels.embed_rows(self.table, ids)
        x = kernels.project(kernels.project(rows if lookup_counts else rows.detach(), self.twice), self.twice)
        x = kernels.project(x, self.shifted) * self.odd.sum() * self.pad
        return kernels.linear_cross_entropy(x, self.table, None, labels)


@pytest.mark.parametrize("lookup_counts", [True, False], ids=["lookup-read", "lookup-unread"])
def test_a_flat_gradients_pieces_go_to_their_first_writer_and_the_rest_is_copied_in(lookup_counts, monkeypatch):
    """A view's piece of the flat gradient goes to the first backward that asks for it (a weight two projections
    read gets autograd's sum of the two copied in), none to a piece not 16-byte aligned, zeros to a view no gradient
    reached; the tied head's gradient handed to the token table's backward, or, where the loss does not read the
    lookup, added in at the end (kernels/pending.py): the gradients without flat parameters, bit for bit."""
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 11, (6,), generator=gen), torch.randint(0, 11, (6,), generator=gen)
    grads = []
    for flat in (True, False):
        module = Readers().to(KERNEL_DEVICE)
        if flat:
            module.flat = FlatParameters(module, {"all": [name for name, _ in Readers().named_parameters()]})
        module(ids.to(KERNEL_DEVICE), labels.to(KERNEL_DEVICE), lookup_counts).backward()
        named = {name: p.grad for name, p in module.named_parameters()}
        grads.append(module.flat.unflatten(named) if flat else named)
    assert grads[1]["unread"] is None and not grads[0]["unread"].any()
    sizes = [torch.Size(shape) for shape in ((3,), (8, 8), (1,), (2, 2))]  # Readers' first pieces
    slots = pending.GradientSlots(sizes, torch.float32, torch.device("cpu"))
    assert slots.slot(1, torch.float32) is None and slots.slot(3, torch.bfloat16) is None  # unaligned; a dtype
    assert slots.slot(3, torch.float32) is not None and slots.slot(3, torch.float32) is None  # once
    for name, grad in grads[1].items():
        assert name == "unread" or torch.equal(grads[0][name], grad), name


class TouchingSizes(TorchDispatchMode):
    """Counts the ops that read or write a tensor of one of `sizes` elements (a token table, a flat parameter):
    allocations, views and other metadata aside (the interpreter's own `set_`s among them)."""

    def __init__(self, sizes: set[int]):
        super().__init__()
        self.sizes, self.ops = sizes, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs, out))
        name = func.overloadpacket.__name__
        if not (_is_metadata(func) or name in ("empty", "empty_strided", "new_empty", "set_")) and any(
                isinstance(t, torch.Tensor) and t.numel() in self.sizes for t in leaves):
            self.ops[name] += 1
        return out


def test_a_parameter_read_twice_has_its_sums_made_at_once(monkeypatch):
    """A flat parameter's view that a forward reads twice has its gradients added by autograd before the views' are
    concatenated: its partial sums are summed at once, not deferred (kernels/pending.py), and the gradient is the
    one the parameter gets unflattened."""
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x):
            once = kernels.add_layer_norm(x, x, self.norm.weight, self.norm.bias)[0]
            return kernels.add_layer_norm(once, x, self.norm.weight, self.norm.bias)[0].square().sum()

    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(0)).to(KERNEL_DEVICE)
    grads = []
    for flat in (True, False):
        torch.manual_seed(0)
        module = Twice().to(KERNEL_DEVICE)
        with torch.no_grad():
            module.norm.weight.uniform_(0.5, 1.5)
        if flat:
            module.flat = FlatParameters(module, {"norm": ["norm.weight", "norm.bias"]})
        module(x).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in module.parameters()]))
    assert torch.equal(grads[0], grads[1])


def loss_and_grads(preset, extra, mode, monkeypatch):
    monkeypatch.setenv("FASTMAE_KERNELS", mode)
    model = tiny_model(preset, **extra).to(KERNEL_DEVICE)
    out = model(tiny_batch(4, seed=4).to(KERNEL_DEVICE), seed=3, step=1)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("preset, extra", VARIANTS)
def test_kernels_match_references_in_the_model(preset, extra, monkeypatch):
    ref, ref_grads = loss_and_grads(preset, extra, "torch", monkeypatch)
    got, got_grads = loss_and_grads(preset, extra, "triton", monkeypatch)
    for field, a, b in zip(ref.masked.selection._fields, ref.masked.selection, got.masked.selection):
        assert torch.equal(a, b), field
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_training_with_kernels_follows_the_references(monkeypatch):
    losses = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("FASTMAE_KERNELS", mode)
        model = tiny_model("3ml", seed=1).to(KERNEL_DEVICE)
        docs = demo_documents(model.config.vocab_size, seed=0)
        loop = LoopConfig(steps=3, warmup_steps=1, sequences_per_batch=4, seed=0)
        losses[mode] = train_on_documents(model, docs, loop)
    torch.testing.assert_close(torch.tensor(losses["triton"]), torch.tensor(losses["torch"]), rtol=1e-4, atol=1e-5)


def test_unknown_kernel_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("FASTMAE_KERNELS", "fast")
    with pytest.raises(ValueError, match="FASTMAE_KERNELS"):
        tiny_model("mlm")(tiny_batch(2))


def test_a_stack_of_layers_draws_its_dropout_keys_at_once(monkeypatch):
    """On the Triton path a stack of layers draws the keys of its norms' hashed dropout in one op
    (`ops.dropout_keys`), not one op a norm (one kernel each on CUDA): an mlm forward draws once for the stack
    whatever its depth, and once for the embedding's dropout (hashed in the gather's kernel), none in eval or under
    autocast; activation checkpointing hands the recomputation the same keys (bit-identical
    gradients, and no draw in the backward)."""
    draws = []
    randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *args, **kwargs: draws.append(args) or randint(*args, **kwargs))
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")
    model = tiny_model("mlm", dropout=0.1).to(KERNEL_DEVICE).train()
    batch = tiny_batch(2, seed=4).to(KERNEL_DEVICE)
    results = []
    for checkpointing in (False, True):
        model.activation_checkpointing = checkpointing
        model.zero_grad()
        torch.manual_seed(7)
        loss = model(batch, seed=3, step=1).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert draws == [(0, 2**32, (1,)), (0, 2**32, (4,))], (checkpointing, draws)  # the embedding; 2 x 2 norms
        draws.clear()
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    with torch.no_grad():
        model.eval()(batch, seed=3, step=1)
        with torch.autocast(KERNEL_DEVICE, dtype=torch.bfloat16):  # fine-tuning's: torch's add and norm, no keys
            model.train()(batch, seed=3, step=1)
    assert draws == []


PRE_LN_MODERNBERT = dict(ffn_gated=True, linear_bias=False, norm_bias=False, norm_position="pre",
                         first_attention_norm=False, position_embedding="rotary")
"""ModernBERT's layers (global ones: a local layer's window adds a bias to the scores, once a stream)."""


@pytest.mark.parametrize("extra", [{}, PRE_LN_MODERNBERT], ids=["post-LN", "pre-LN-modernbert"])
def test_no_layer_runs_torchs_residual_add_or_layer_norm(extra, monkeypatch):
    """On the Triton path every residual add and the LayerNorm after it are one fused op, post-LN and pre-LN alike
    (a pre-LN layer's last add is left to the next layer's attention norm, or the stack's final norm): a training
    step runs torch's add and LayerNorm as often at any depth (the embeddings', the masking's and the head's)."""
    monkeypatch.setenv("FASTMAE_KERNELS", "triton")
    counts = []
    for depth in (1, 2):
        model = tiny_model("mlm", encoder_layers=depth, **extra).to(KERNEL_DEVICE).train()
        with StepCounter() as counter:  # the ops a step asks of the device, by name
            model(tiny_batch(2, seed=4).to(KERNEL_DEVICE), seed=3, step=1).loss.backward()
        counts.append({name: counter.ops[name] for name in ("add", "native_layer_norm", "native_layer_norm_backward")})
    assert counts[0] == counts[1], counts
