"""CUDA graphs of the training forward and backward (fastmae/graphs.py): the plan, the static buffers and the replayed
autograd path, on CPU through the CPU twin (recordings run eagerly) and on CUDA captured (run by scripts/gpu_check.sh).
DeepSpeed with the twin installed: tests/test_train.py's world-of-one run."""

import dataclasses

import pytest
import torch
from conftest import CUDA_HEADS, tiny_batch, tiny_config, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from fastmae import masking
from fastmae.attention import FLASH_KERNEL_BACKENDS, check_flash_head_dim, resolve_backend
from fastmae.batch import pack_bytes
from fastmae.config import ModelConfig, RunConfig
from fastmae.errors import ConfigError
from fastmae.flat import FlatParameters
from fastmae.graphs import StepGraphs, plan_graphs, signature
from fastmae.masking import mask_batch
from fastmae.optim import decay_groups
from fastmae.padding import ShapeLadder
from fastmae.pipeline import masked_ahead

CUDA = torch.device("cuda")


def run_config(**train) -> RunConfig:
    config = RunConfig()
    config.train = dataclasses.replace(config.train, **train)
    return config


def test_the_plan_names_what_stops_graphs(monkeypatch):
    monkeypatch.setattr("fastmae.attention._HAS_FLASH_ATTN", True)  # as on a GPU machine with the `gpu` extra
    assert plan_graphs(run_config(), CUDA, "bf16").enabled
    assert plan_graphs(run_config(cuda_graphs="always"), CUDA, "bf16").enabled
    assert plan_graphs(run_config(cuda_graphs="never"), CUDA, "bf16") == (False, "train.cuda_graphs=never", None)
    cpu = plan_graphs(run_config(), torch.device("cpu"), "bf16")
    assert not cpu.enabled and "not CUDA" in cpu.reason
    doc = run_config(zero_stage=3)
    doc.data = dataclasses.replace(doc.data, packing="doc")
    reason = plan_graphs(doc, CUDA, "bf16").reason
    assert "zero_stage=3" in reason and "packing" not in reason
    doc.train = dataclasses.replace(doc.train, zero_stage=2)
    padded = plan_graphs(doc, CUDA, "bf16")  # doc packing: micro-batches padded to the ladder's shapes
    assert padded.enabled and padded.shapes is not None
    assert f"padded to {len(padded.shapes.shapes)} shapes" in padded.reason
    assert plan_graphs(run_config(), CUDA, "bf16").shapes is None
    # padded SDPA (fp32 on CUDA): a padded doc batch would attend over B_cap x L rows; in bf16 a doc batch's ragged
    # streams run torch's FlashAttention-2 varlen kernels, with or without flash-attn
    assert "attention backend padded" in plan_graphs(doc, CUDA, "fp32").reason
    monkeypatch.setattr("fastmae.attention._HAS_FLASH_ATTN", False)
    assert plan_graphs(doc, CUDA, "bf16").enabled
    assert plan_graphs(run_config(), CUDA, "bf16").enabled
    # the relative bias without attention dropout runs FlexAttention: a block mask built and a kernel compiled inside
    # the forward, neither of which a capture holds
    biased = run_config()
    biased.model = dataclasses.replace(biased.model, relative_attention_bias=True, attention_dropout=0.0)
    assert plan_graphs(biased, CUDA, "bf16") == (False, "eager: attention backend flex (a position bias, relative or "
                                                 "a local window, without attention dropout) builds a dense block "
                                                 "mask and compiles flex_attention inside the forward, which a capture "
                                                 "cannot hold", None)
    biased.model = dataclasses.replace(biased.model, attention_dropout=0.1)  # padded SDPA with its bias: captured
    assert plan_graphs(biased, CUDA, "bf16").enabled
    # local windows on the shortened stream (ModernBERT's layers in mae-lm's encoder, no attention dropout) run
    # fastmae's own kernel, which builds nothing per step: captured; in fp32 FlexAttention (the kernel takes halves)
    local = run_config()
    local.model = dataclasses.replace(local.model, global_attention_every=3, local_window=8, attention_dropout=0.0)
    assert plan_graphs(local, CUDA, "bf16").enabled
    assert "attention backend flex (a position bias" in plan_graphs(local, CUDA, "fp32").reason
    # ... on a shortened stream (mae-lm's encoder); mlm's local layers see consecutive positions: torch's
    # FlashAttention-2 kernels with their window of rows, which a capture holds (fp32: FlexAttention still)
    local.model = ModelConfig.preset("mlm", global_attention_every=3, local_window=8, attention_dropout=0.0)
    assert plan_graphs(local, CUDA, "bf16").enabled and not plan_graphs(local, CUDA, "fp32").enabled
    with pytest.raises(ConfigError, match="cuda_graphs=always, but train.activation_checkpointing"):
        plan_graphs(run_config(cuda_graphs="always", activation_checkpointing=True), CUDA, "bf16")
    with pytest.raises(ConfigError, match="train.cuda_graphs"):
        run_config(cuda_graphs="on").train.validate()


def same_shaped(config, count: int, seed: int = 0, device="cpu") -> list:
    """`count` micro-batches of one signature (equal lengths, different tokens), masked as the trainer masks them
    (on the host, layouts included) and moved to `device` in one copy each."""
    batches = [dataclasses.replace(tiny_batch(num_sequences=4, seed=seed + i, min_len=30, max_len=30), index=i)
               for i in range(count)]
    return [m.to(device) for m in masked_ahead(iter(batches), config, seed=seed)]


def doc_shaped(config, count: int, seed: int = 0, device="cpu") -> tuple[list, list]:
    """`count` micro-batches of `doc` packing (documents of different lengths), masked as the trainer masks them, and
    the same padded to one shape of the ladder (fastmae/padding.py), moved to `device` in one copy each."""
    batches = [dataclasses.replace(tiny_batch(num_sequences=7, seed=seed + i, min_len=5, max_len=40), index=i)
               for i in range(count)]
    unpadded = [m.to(device) for m in masked_ahead(iter(batches), config, seed=seed)]
    padded = [m.to(device) for m in masked_ahead(iter(batches), config, seed=seed, shapes=ShapeLadder(config, 384))]
    return padded, unpadded


@pytest.mark.parametrize("preset, extra", [("3ml", {}), ("mlm", {}),
                                           ("mae-lm", {"decoder_kind": "cross", "position_embedding": "rotary"})])
def test_a_batch_read_back_from_its_bytes_is_the_batch(preset, extra):
    masked = same_shaped(tiny_model(preset, **extra).config, 1)[0]
    copy_ = masked.viewing(pack_bytes(masked.device_tensors())[0])
    assert copy_.buffer is not None and signature(copy_) == signature(masked)
    for got, expected in zip(copy_.resident_tensors(), masked.resident_tensors(), strict=True):
        assert torch.equal(got, expected)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def flat_model(preset: str, seed: int, device="cpu", dtype=torch.float32, dropout=0.1, **extra):
    model = tiny_model(preset, seed=seed, dropout=dropout, **extra).train().to(device, dtype)
    model.flat = FlatParameters(model, decay_groups(model))
    return model


def accumulate(model, micro_batches: list) -> list[float]:
    """Forward and backward of each micro-batch (gradients accumulating, as DeepSpeed's engine does); the losses."""
    losses = []
    for masked in micro_batches:
        out = model(masked)
        (out.loss * out.num_predicted).backward()
        losses.append(out.loss.detach())
    return losses


@pytest.mark.parametrize("preset, extra", [("3ml", {}), ("mlm", {"norm_position": "pre"}),
                                           ("mae-lm", {"decoder_kind": "cross", "position_embedding": "rotary"})])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_cpu_twin_replays_what_the_model_computes(preset, extra, seed):
    # the recordings' static buffers and autograd path, run eagerly: losses and accumulated gradients bit for bit the
    # model's own (dropout on: the twin draws what the model draws), the buffer reused, gradients handed on as the
    # recording's memory, which the twin's backward, as a replay, writes again: a parameter still holding it gets a
    # copy first (the second step's first micro-batch replays into parameters without gradients, the second into
    # parameters holding the first's)
    eager, replayed = flat_model(preset, seed, **extra), flat_model(preset, seed, **extra)
    graphs = StepGraphs(replayed, capture=False)
    micro_batches = same_shaped(eager.config, 4, seed=seed)
    expected, got = [], []
    for model, losses in ((eager, expected), (replayed, got)):
        torch.manual_seed(seed)
        for step in (micro_batches[:2], micro_batches[2:]):
            model.zero_grad(set_to_none=True)
            losses += accumulate(model, step)
    assert (graphs.eager_batches, graphs.replayed_batches, len(graphs.recordings)) == (1, 3, 1)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    recording = next(iter(graphs.recordings.values()))
    for (name, a), b in zip(replayed.named_parameters(), eager.parameters()):
        assert torch.equal(a.grad, b.grad), name
        assert not any(a.grad.data_ptr() == g.data_ptr() for g in recording.grads)
    # the recorded passes read leaves of their own on the parameters' memory: a parameter's gradient sink, made on
    # CUDA's legacy stream outside any capture, would make the captured backward wait on that stream
    assert [leaf.data_ptr() for leaf in recording.leaves] == [p.data_ptr() for p in recording.params]
    assert not any(leaf is p for leaf, p in zip(recording.leaves, recording.params))
    assert all(leaf.grad_fn is None and leaf.requires_grad for leaf in recording.leaves)


@pytest.mark.parametrize("preset, extra", [("3ml", {}), ("mlm", {"norm_position": "pre"}),
                                           ("mae-lm", {"decoder_kind": "cross", "position_embedding": "rotary"})])
def test_the_cpu_twin_replays_doc_batches_padded_to_one_shape(preset, extra):
    # one recording serves documents of other lengths and other mask counts: the loss of each is its own (the
    # recording counts its predicted rows on the device), as the model computes it unpadded; dropout off (the
    # fillers' rows would draw masks of their own)
    eager, replayed = flat_model(preset, 0, dropout=0.0, **extra), flat_model(preset, 0, dropout=0.0, **extra)
    graphs = StepGraphs(replayed, capture=False)
    padded, unpadded = doc_shaped(eager.config, 4)
    assert len({signature(m) for m in padded}) == 1 and len({m.num_predicted for m in padded}) == 4
    expected, got = accumulate(eager, unpadded), accumulate(replayed, padded)
    assert (graphs.eager_batches, graphs.replayed_batches, len(graphs.recordings)) == (1, 3, 1)
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-6, atol=0)
    for (name, a), b in zip(replayed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6 * float(b.grad.abs().max()), msg=name)


def test_only_training_forwards_of_a_recorded_shape_replay_logged_steps_included():
    model = flat_model("3ml", seed=0)
    graphs = StepGraphs(model, capture=False)
    first, second, third = same_shaped(model.config, 3)
    labels = third.selection.labels
    favoured = int(labels.mode().values)  # a head that always predicts one of the labels: a count that can be wrong
    with torch.no_grad():
        model.head.bias[favoured] = 1e4
    model(first), model(second)
    recording = next(iter(graphs.recordings.values()))
    buffer = recording.buffer.data_ptr()
    shorter = dataclasses.replace(tiny_batch(4, seed=9, min_len=20, max_len=20), index=0)  # another signature
    model(next(masked_ahead(iter([shorter]), model.config, seed=0)))
    # a logged step replays too (an eager forward would hold a second activation set): its accuracy is counted from
    # the replayed rows
    logged = model(third, compute_accuracy=True)
    assert int(logged.num_correct) == int((labels == favoured).sum()) > 0
    with torch.no_grad():
        model(third)
    model.eval()(third)
    assert (graphs.replayed_batches, graphs.eager_batches) == (2, 2)
    model.train()(third)
    assert graphs.replayed_batches == 3 and recording.buffer.data_ptr() == buffer


def test_loading_a_moved_batch_is_one_copy_and_no_allocation():
    model = flat_model("3ml", seed=0)
    graphs = StepGraphs(model, capture=False)
    micro_batches = same_shaped(model.config, 3)
    model(micro_batches[0]), model(micro_batches[1])
    recording = next(iter(graphs.recordings.values()))
    moved = micro_batches[2].viewing(pack_bytes(micro_batches[2].device_tensors())[0])  # as `MaskedBatch.to` leaves it
    with Ops() as ops:
        recording.load(moved)
    assert ops.names == ["copy_.default"]
    for static, tensor in zip(recording.views, moved.device_tensors()):
        assert torch.equal(static, tensor)


def test_only_packed_batches_are_recorded_and_a_recording_builds_no_layout(monkeypatch):
    """A batch masked on its device (`train_step` given PackedBatches: the API's path) builds its stream layouts
    lazily, inside the forward, with host copies a CUDA capture cannot hold: it runs eagerly, however often its shape
    is seen. The trainer's packed batches are recorded, and no layout is built while their recording runs."""
    model = flat_model("3ml", 0, dropout=0.0)
    graphs = StepGraphs(model, capture=False)
    batches = [dataclasses.replace(tiny_batch(num_sequences=4, seed=i, min_len=30, max_len=30), index=i)
               for i in range(3)]
    accumulate(model, [mask_batch(b, model.config, seed=0, step=b.index) for b in batches])
    assert not graphs.recordings and graphs.eager_batches == 3
    packed, built, real = same_shaped(model.config, 3), [], masking.stream_meta
    monkeypatch.setattr(masking, "stream_meta", lambda *args, **kwargs: built.append(args) or real(*args, **kwargs))
    accumulate(model, packed)
    assert len(graphs.recordings) == 1 and graphs.replayed_batches == 2 and not built


CAPTURED = [("3ml", {}), ("mlm", {"norm_position": "pre"}),
            ("mae-lm", {"decoder_kind": "cross", "position_embedding": "rotary"})]


def test_the_cuda_tests_models_fit_the_flash_kernels(monkeypatch):
    """The models the CUDA tests build (captures here, fine-tuning's bf16 case) have a head dimension the CUDA flash
    kernels take, whichever backend resolves on a GPU machine, with flash-attn installed or not."""
    configs = [tiny_config(preset, **CUDA_HEADS, **extra) for preset, extra in CAPTURED]
    configs.append(tiny_config("mae-lm", **CUDA_HEADS, attention_dropout=0.1))  # tests/test_finetune.py's run_dir
    with pytest.raises(ValueError, match="multiple of 8"):  # what TINY's heads would meet
        check_flash_head_dim(tiny_config().hidden_size // tiny_config().num_heads, "torch_varlen")
    for has_flash in (True, False):
        monkeypatch.setattr("fastmae.attention._HAS_FLASH_ATTN", has_flash)
        for config in configs:
            for dtype in (torch.float32, torch.bfloat16):
                backend = resolve_backend(None, CUDA, config.attention_dropout, dtype)
                if backend in FLASH_KERNEL_BACKENDS:
                    check_flash_head_dim(config.hidden_size // config.num_heads, backend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset, extra", CAPTURED)
def test_captured_graphs_compute_what_the_model_computes(preset, extra, dtype):
    # dropout off: a replay draws its dropout masks from the graph's own generator offsets
    eager, captured = (flat_model(preset, 0, CUDA, dtype, dropout=0.0, **CUDA_HEADS, **extra) for _ in range(2))
    graphs = StepGraphs(captured, capture=True)
    micro_batches = same_shaped(eager.config, 5, device=CUDA)
    expected, got = accumulate(eager, micro_batches), accumulate(captured, micro_batches)
    assert graphs.replayed_batches == 4 and next(iter(graphs.recordings.values())).graphs is not None
    tolerance = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), **tolerance)
    for (name, a), b in zip(captured.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad.float(), b.grad.float(), **tolerance, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["3ml", "mlm"])
def test_captured_graphs_replay_doc_batches_padded_to_one_shape(preset, dtype):
    # zero-length filler sequences in the varlen kernels (bf16: flash-attn or torch's varlen_attn; fp32: padded
    # SDPA), the device-side count of the predicted rows
    eager, captured = (flat_model(preset, 0, CUDA, dtype, dropout=0.0, **CUDA_HEADS) for _ in range(2))
    graphs = StepGraphs(captured, capture=True)
    padded, unpadded = doc_shaped(eager.config, 5, device=CUDA)
    expected, got = accumulate(eager, unpadded), accumulate(captured, padded)
    assert graphs.replayed_batches == 4 and next(iter(graphs.recordings.values())).graphs is not None
    loose = dtype == torch.bfloat16
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=2e-2 if loose else 1e-5,
                               atol=2e-2 if loose else 1e-6)
    for (name, a), b in zip(captured.named_parameters(), eager.parameters()):
        scale = float(b.grad.float().abs().max())
        torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2e-2 if loose else 1e-4,
                                   atol=(2e-2 if loose else 1e-5) * scale, msg=name)


def test_a_recording_gives_way_when_its_signature_stops_coming():
    """graphs.RecordingPolicy, one recording held: a signature is recorded the second time it is seen; under a
    masking-rate schedule the next rate's signature takes the recording once the old one has gone STALE_FORWARDS
    forwards unreplayed; a rare signature beside one replaying all the time never takes it (doc packing's rarer
    rungs). benchmarks/mask_schedule_shapes.py counts what whole runs record this way."""
    from fastmae.graphs import STALE_FORWARDS, RecordingPolicy

    policy, first, second, rare = RecordingPolicy(max_recordings=1), ("rate 0.30",), ("rate 0.29",), ("rung 2",)
    assert [policy.decide(first)[0] for _ in range(3)] == ["eager", "record", "replay"]
    actions = [policy.decide(second) for _ in range(STALE_FORWARDS + 1)]
    assert actions[:-1] == [("eager", None)] * STALE_FORWARDS and actions[-1] == ("record", first)
    for i in range(40):
        assert policy.decide(second) == ("replay", None)
        if i % 4 == 0:
            assert policy.decide(rare) == ("eager", None)
    assert policy.recorded == 2
