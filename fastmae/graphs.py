"""CUDA graphs of the training forward and backward (`train.cuda_graphs`; ARCHITECTURE.md section 5).

With `full` packing every full-length micro-batch has the same shapes and host counts (section 2), and with `doc`
packing micro-batches are padded to one of a few shapes (fastmae/padding.py), so the model's forward and backward can
be recorded for the first shape seen twice (another takes its place once it stops coming: `RecordingPolicy`) and
replayed: two graph launches per micro-batch instead of hundreds
of kernel launches, which the host would otherwise issue one by one. As in MLPerf's BERT, only the model is captured:
DeepSpeed's gradient hooks run when autograd hands the replayed gradients to the parameters, and its optimizer step
stays eager.

    engine(masked) -> MaskedLM.__call__ (flat-parameter hook) -> StepGraphs.forward
        a recorded signature:   masked's bytes copied into the recording's static buffer (one copy), forward replayed;
                                engine.backward replays the backward and hands each parameter a copy of its gradient
        a signature seen once:  the model's own forward (eager); the second time it is recorded, then replayed
        anything else:          the model's own forward (evaluation, accuracy on logged steps, a plain PackedBatch)

Without CUDA the recordings are the CPU twin: the same static buffers, signatures and autograd path, with the recorded
forward and backward run eagerly instead of replayed (each backward's gradients copied into the first one's, as a
replay writes them into the same memory), so everything up to the capture is tested on any machine.
A replay writes its gradients into the same memory every time. They are handed on as they are, fresh aliases of that
memory, which autograd makes a parameter's `.grad` where it has none: DeepSpeed's ZeRO-1/2 hooks copy a gradient into
their own partition as it arrives and point `.grad` there, so no copy of the whole model's gradients is made a
micro-batch. A parameter whose `.grad` still is that memory when the next backward replays (plain autograd
accumulating micro-batches, an optimizer that reads `.grad` at its step) gets a copy of it first (`_detached`).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from .attention import PADDED_VIEW_BACKENDS, resolve_backend
from .batch import byte_offsets, unpack_bytes
from .config import RunConfig
from .errors import ConfigError
from .hardware import DTYPES
from .layers import local_backends
from .masking import MaskedBatch
from .padding import ShapeLadder

WARMUP_RUNS = 2  # eager forward + backward on a side stream before the capture (Triton autotuning, lazy inits)
UNPADDABLE_BACKENDS = (*PADDED_VIEW_BACKENDS, "nested")
"""Attention backends not for `doc` packing's padded batches: a padded view is [sequence capacity, max_seq_len], far
above the rows such a batch holds, and nested tensors take no zero-length sequence."""


class GraphPlan(NamedTuple):
    """Whether a run records its training steps and the reason, which the trainer logs; under `doc` packing the
    shapes its micro-batches are padded to."""

    enabled: bool
    reason: str
    shapes: ShapeLadder | None = None


def plan_graphs(config: RunConfig, device: torch.device, precision: str) -> GraphPlan:
    """Whether `config`'s training on `device` in `precision` (as resolved: fp32, bf16, fp16) runs recorded graphs
    (train.cuda_graphs: auto, always, never).

    `always` raises ConfigError naming what stops it; `auto` falls back to eager with the reason."""
    train = config.train
    if train.cuda_graphs == "never":
        return GraphPlan(False, "train.cuda_graphs=never")
    model = config.model
    backends = set()  # what the layers' attention runs on CUDA: the global layers', then the local layers' streams'
    if device.type == "cuda":
        dtype = DTYPES[precision]
        backends.add(resolve_backend(None, device, model.attention_dropout, dtype,
                                     biased=model.relative_attention_bias, rectangular=config.data.packing != "doc"))
        backends.update(local_backends(model, device, dtype, model.attention_dropout).values())
    unpaddable = sorted(backends & set(UNPADDABLE_BACKENDS))
    obstacles = [
        (device.type != "cuda", f"the device is {device.type}, not CUDA"),
        (train.zero_stage == 3, "train.zero_stage=3 gathers parameters module by module during the forward"),
        (train.activation_checkpointing, "train.activation_checkpointing recomputes layers inside the backward"),
        (train.compile, "train.compile: compiled layers guard and recompile on the host"),
        ("flex" in backends, "attention backend flex (a position bias, relative or a local window, without attention "
                            "dropout) builds a dense block mask and compiles flex_attention inside the forward, which "
                            "a capture cannot hold"),
        # padded batches lay every sequence out max_seq_len long
        (config.data.packing == "doc" and bool(unpaddable),
         f"data.packing=doc with attention backend {', '.join(unpaddable)}: padded to fixed shapes, its micro-batches "
         "would attend over sequence capacity x max_seq_len rows (a varlen kernel reads the packed rows)"),
    ]
    reasons = [reason for blocked, reason in obstacles if blocked]
    if not reasons:
        shapes = ShapeLadder.for_run(config) if config.data.packing == "doc" else None
        padded = "" if shapes is None else (f"; data.packing=doc: micro-batches padded to {len(shapes.shapes)} "
                                            "shapes, the first seen twice recorded")
        return GraphPlan(True, "forward and backward recorded for one micro-batch shape and replayed "
                               f"(train.cuda_graphs={train.cuda_graphs}{padded})", shapes)
    if train.cuda_graphs == "always":
        raise ConfigError(f"train.cuda_graphs=always, but {'; '.join(reasons)} (use auto or never)")
    return GraphPlan(False, "eager: " + "; ".join(reasons))


def signature(masked: MaskedBatch) -> tuple:
    """Everything of `masked` that the model's forward reads as a shape or a host value. Two batches with one
    signature differ only in the contents of their device tensors, so one recording serves both."""
    batch, counts = masked.batch, masked.counts
    layouts = tuple((name, meta.max_seqlen, meta.rotary is not None) for name in ("full", "visible", "masked")
                    if (meta := masked.__dict__.get(name)) is not None)
    # an unpadded batch's per-sequence counts (the loss divides by their sum on the host); a padded batch's forward
    # reads only its shape (fastmae.padding)
    per_sequence = () if masked.filler is not None else tuple(
        tuple(values.tolist()) for values in (batch.seqlens, counts.predicted, counts.removed, counts.random))
    return (batch.max_seqlen, per_sequence, masked.filler is not None, layouts, str(masked.device),
            tuple((tuple(t.shape), t.dtype) for t in masked.device_tensors()))


class Recording:
    """The model's training forward and backward for one signature, on static tensors: `buffer` holds the batch's
    bytes (as `MaskedBatch.viewing` reads them), `output` the forward's output, `grads` the parameters' gradients for
    the gradient of the loss in `grad_output`. On CUDA both passes are captured as graphs and replayed; elsewhere
    `replay_*` runs them eagerly (the CPU twin)."""

    def __init__(self, forward, masked: MaskedBatch, params: dict[str, torch.nn.Parameter], capture: bool):
        # (MaskedBatch, {name: tensor}) -> MaskedLMOutput: the model's own forward with those tensors as parameters
        self.forward = forward
        self.template = masked  # the signature's host values; its device tensors are replaced by views of `buffer`
        self.names, self.params = tuple(params), tuple(params.values())
        tensors = masked.device_tensors()
        self.buffer = torch.empty(byte_offsets(tensors)[1], dtype=torch.uint8, device=masked.device)
        self.views = unpack_bytes(self.buffer, tensors, byte_offsets(tensors)[0])
        self.graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph] | None = None
        self.capture, self.grads = capture, None
        self.param_pointers = [p.data_ptr() for p in self.params]
        self.grad_output = torch.ones((), dtype=torch.float32, device=masked.device)  # the loss is an fp32 scalar
        self.load(masked)  # real indices before any run: the warm-up and the capture gather with them
        if capture:
            self._capture()

    def load(self, masked: MaskedBatch) -> None:
        """Copy `masked`'s device tensors into the static buffer: one copy when they view one buffer laid out as it
        is (`MaskedBatch.packed`: the trainer's batches), else one per tensor."""
        if masked.buffer is not None and masked.buffer.shape == self.buffer.shape:
            self.buffer.copy_(masked.buffer)
        else:
            for static, tensor in zip(self.views, masked.device_tensors(), strict=True):
                static.copy_(tensor)

    def _run_forward(self) -> None:
        # The forward reads fresh leaves sharing the parameters' memory, made on the stream this pass runs on.
        # Autograd hands a leaf's gradient to its sink (AccumulateGrad) on the stream where the sink was made, and a
        # flat parameter's sink was made outside any capture, on the legacy default stream, and lives as long as any
        # view of it: the captured backward would wait on that stream (cudaErrorStreamCaptureImplicit).
        self.leaves = tuple(p.detach().requires_grad_() for p in self.params)
        with torch.enable_grad():
            self.output = self.forward(self.template.viewing(self.buffer), dict(zip(self.names, self.leaves)))

    def _run_backward(self) -> None:
        grads = torch.autograd.grad(self.output.loss, self.leaves, self.grad_output, allow_unused=True)
        if self.capture or self.grads is None:
            self.grads = grads
            return
        for static, grad in zip(self.grads, grads):  # the CPU twin: a replay's gradients land in the same memory
            if static is not None:
                static.copy_(grad)

    def _capture(self) -> None:
        """Warm up on a side stream, then capture the forward and the backward into one memory pool (replayed in
        that order, as `torch.cuda.make_graphed_callables` does). The caching allocator's free blocks go back to the
        device first: blocks cached for the current stream would not serve the side stream, and the warm-up would
        hold a second activation set beside them."""
        torch.cuda.empty_cache()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with _syncs_allowed(), torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._run_forward()
                self._run_backward()
        torch.cuda.current_stream().wait_stream(side)
        forward_graph, backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        # thread_local: the masking thread's pinned-memory allocations may go on while this thread captures
        with _syncs_allowed():
            with torch.cuda.graph(forward_graph, pool=pool, capture_error_mode="thread_local"):
                self._run_forward()
            with torch.cuda.graph(backward_graph, pool=pool, capture_error_mode="thread_local"):
                self._run_backward()
        self.graphs = (forward_graph, backward_graph)

    @property
    def valid(self) -> bool:
        """False once a parameter's memory has moved (a replay would read the old memory): re-record then."""
        return [p.data_ptr() for p in self.params] == self.param_pointers

    def replay_forward(self) -> None:
        if self.graphs is None:
            self._run_forward()
        else:
            self.graphs[0].replay()

    def replay_backward(self) -> None:
        """The backward for `grad_output`, its gradients in `grads`; a parameter whose `.grad` is still the last
        backward's memory gets a copy of it first (`_detached`)."""
        _detached(self.params, self.grads)
        if self.graphs is None:
            self._run_backward()
        else:
            self.graphs[1].replay()

    def __call__(self, masked: MaskedBatch):
        """The model's output for `masked` (a MaskedLMOutput), its loss differentiable through `_Replayed`;
        `encoder_states` and `head_states` are the recording's, valid until its next replay."""
        self.load(masked)
        loss = _Replayed.apply(self, *self.params)
        return self.output._replace(loss=loss, num_predicted=masked.num_predicted, masked=masked,
                                    encoder_states=self.output.encoder_states.detach(),
                                    head_states=self.output.head_states.detach())


class _Replayed(torch.autograd.Function):
    """The recording's loss as a function of the parameters: forward replays the forward, backward the backward."""

    @staticmethod
    def forward(ctx, recording: Recording, *params: torch.Tensor) -> torch.Tensor:
        ctx.recording = recording
        recording.replay_forward()
        return recording.output.loss.detach().clone()  # the static loss is overwritten by the next replay

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        recording = ctx.recording
        recording.grad_output.copy_(grad_loss)
        recording.replay_backward()
        # fresh aliases: autograd takes a gradient as a parameter's `.grad` only where nothing else holds it
        return (None, *(None if grad is None else grad.detach() for grad in recording.grads))


def _detached(params: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor | None, ...] | None) -> None:
    """Give each of `params` whose `.grad` is (a view of) the memory of its gradient in `grads` a copy of it: the
    next backward replay overwrites that memory."""
    for param, grad in zip(params, grads or ()):
        held = param.grad
        if grad is not None and held is not None and _same_memory(held, grad):
            param.grad = held.clone()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


STALE_FORWARDS = 16
"""A recording not replayed for this many training forwards gives way to a signature that has come due (seen
twice): under a masking-rate schedule the counts of full-length micro-batches move to a new signature at each rate,
which the old recording never serves again; a ladder rung in use (`doc` packing) keeps its recording."""


class RecordingPolicy:
    """Which signature holds a recording: one seen the second time is recorded while fewer than `max_recordings`
    are held, or in place of the recording unused longest once that one has gone STALE_FORWARDS forwards unreplayed.
    Host bookkeeping only, so `benchmarks/mask_schedule_shapes.py` counts what a run records without a model."""

    def __init__(self, max_recordings: int):
        self.max_recordings = max_recordings
        self.seen: set[tuple] = set()
        self.last_used: dict[tuple, int] = {}  # recorded signatures -> the forward that last used them
        self.forwards = self.recorded = 0

    def decide(self, key: tuple) -> tuple[str, tuple | None]:
        """(`replay`, `record` or `eager`, the signature whose recording gives way or None) for a training forward
        of signature `key`."""
        self.forwards += 1
        action, dropped = "eager", None
        if key in self.last_used:
            action = "replay"
        elif key in self.seen:
            if len(self.last_used) >= self.max_recordings:
                oldest = min(self.last_used, key=self.last_used.get)
                if self.forwards - self.last_used[oldest] > STALE_FORWARDS:
                    dropped = oldest
                    del self.last_used[oldest]
            if len(self.last_used) < self.max_recordings:
                action = "record"
                self.recorded += 1
        self.seen.add(key)
        if action != "eager":
            self.last_used[key] = self.forwards
        return action, dropped

    def forget(self, key: tuple) -> None:
        """Drop `key`'s recording (it went invalid): it is recorded again when next due."""
        self.last_used.pop(key, None)


class StepGraphs:
    """Installs itself as `model.forward` (and `model.graphs`): training forwards of a recorded signature replay
    their recording, every other call runs the model's own forward. A signature is recorded the second time it is
    seen (the first run is eager, so lazy initialisation happens outside any recording), at most `max_recordings` of
    them (each holds its own activation memory). Logged steps replay too, their accuracy counted from the replayed
    rows. Training forwards that run eagerly (other signatures) are counted in `eager_batches`, replays in
    `replayed_batches`."""

    def __init__(self, model: torch.nn.Module, capture: bool, max_recordings: int = 1):
        self.model = model
        self.eager_forward = model.forward
        self.capture = capture
        self.policy = RecordingPolicy(max_recordings)
        self.recordings: dict[tuple, Recording] = {}
        self.replayed_batches = self.eager_batches = 0
        self._eager = _EagerForward(model, self.eager_forward)
        model.forward = self.forward
        model.graphs = self

    def forward(self, batch, seed: int = 0, step: int = 0, rank: int = 0, compute_accuracy: bool = False):
        training = self.model.training and torch.is_grad_enabled()
        recording = self._recording(batch) if training else None
        if recording is None:
            self.eager_batches += training
            return self.eager_forward(batch, seed, step, rank, compute_accuracy)
        self.replayed_batches += 1
        out = recording(batch)
        # a logged step's accuracy: counted from the replayed rows (an eager forward would hold a second activation
        # set beside the recording's)
        return out._replace(num_correct=self.model.correct_predictions(out)) if compute_accuracy else out

    def summary(self) -> str:
        """What the run's recordings did, for its log."""
        return (f"cuda graphs: {self.replayed_batches} micro-batches replayed, {self.eager_batches} run eagerly "
                f"({self.policy.recorded} shape(s) recorded, {len(self.recordings)} held at the end)")

    def _bound_forward(self, batch: MaskedBatch, params: dict[str, torch.Tensor]):
        """The model's own forward with `params` (by name) standing in for its parameters, flat parameters rebound
        to them first (as its forward hook does before every call)."""
        return torch.func.functional_call(self._eager, {f"model.{name}": p for name, p in params.items()}, (batch,))

    def _recording(self, batch) -> Recording | None:
        """The recording that serves this training forward, recorded now if its time has come; None: run eagerly.
        Only packed batches (the trainer's) are recorded: one masked on the device (`train_step` given PackedBatches)
        would build its layouts inside the capture."""
        if not isinstance(batch, MaskedBatch) or not batch.is_packed():
            return None
        key = signature(batch)
        recording = self.recordings.get(key)
        if recording is not None and not recording.valid:
            del self.recordings[key]
            self.policy.forget(key)
        action, dropped = self.policy.decide(key)
        if dropped is not None:
            del self.recordings[dropped]  # its graphs and static tensors go with it
        if action == "record":
            params = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
            self.recordings[key] = Recording(self._bound_forward, batch, params, self.capture)
        return self.recordings.get(key) if action != "eager" else None


class _EagerForward(torch.nn.Module):
    """The model's own training forward (not the one StepGraphs puts in its place), as a module holding the model,
    for `torch.func.functional_call` to run with other tensors as the model's parameters."""

    def __init__(self, model: torch.nn.Module, eager_forward):
        super().__init__()
        self.model, self.eager_forward = model, eager_forward

    def forward(self, batch: MaskedBatch):
        self.model._bind_parameters()
        return self.eager_forward(batch)


@contextlib.contextmanager
def _syncs_allowed():
    """Recording synchronizes the device (capture begins and ends with one): allowed even where the training loop
    forbids syncs (FASTMAE_SYNC_DEBUG)."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
