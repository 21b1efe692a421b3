"""torch's FlashAttention-2 varlen ops as fastmae's `torch_flash` backend (fastmae/flash.py): the CPU twin here and
the CUDA kernels on a GPU, against the windowed oracle (a local window as a position bias, per sequence, in fp64),
forward and backward; attention dropout redrawn in the backward from the forward's rng state; the op traced whole;
a model's local layers on consecutive positions."""

import pytest
import torch
from tolerance import assert_as_accurate

from fastmae.attention import StreamBias, VarlenMeta, varlen_attention, varlen_attention_reference
from fastmae.flash import flash_varlen
from fastmae.positions import window_by_distance

HEADS, HEAD_DIM = 3, 16
CASES = [pytest.param("cpu", dtype, id=f"cpu-{str(dtype)[6:]}") for dtype in (torch.float32, torch.bfloat16)]
if torch.cuda.is_available():  # the kernels take fp16 / bf16 only
    CASES += [pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}") for dtype in (torch.bfloat16, torch.float16)]


def consecutive_meta(lengths, device) -> VarlenMeta:
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = (torch.arange(sum(lengths)) - cu.long()[seq_ids]).to(torch.int32)
    return VarlenMeta.build(cu.to(device), max(lengths), seq_ids.to(device), positions.to(device), consecutive=True)


def qkv(rows: int, seed: int, device="cpu", dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_() for _ in range(3)]


def window_bias(meta: VarlenMeta, backend: str, window: int | None, dtype) -> StreamBias | None:
    if window is None:
        return None
    return StreamBias.build(window_by_distance(window, HEADS, meta.positions.device), meta, meta, backend, dtype,
                            window)


# lengths that are multiples of no kernel block, a one-row sequence, a rectangular stream
SHAPES = [pytest.param([7, 1, 33], id="7-1-33"), pytest.param([130, 5, 64, 200], id="130-5-64-200"),
          pytest.param([16, 16, 16], id="3x16")]


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize("lengths", SHAPES)
@pytest.mark.parametrize("window", [None, 3, 64], ids=["global", "window3", "window64"])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_flash_matches_the_windowed_oracle(device, dtype, lengths, window, seed):
    """Out, dq, dk, dv of the backend (a local layer: its window as the kernel's window of rows) against the
    per-sequence oracle with the window as a position bias, in fp64; within flash-attention's accuracy rule."""
    meta = consecutive_meta(lengths, device)
    gen = torch.Generator().manual_seed(seed + 100)
    grad_out = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=gen)

    def run(backend, run_dtype):
        q, k, v = qkv(sum(lengths), seed, device, run_dtype)
        bias = window_bias(meta, backend, window, run_dtype)
        if backend == "reference":
            out = varlen_attention_reference(q, k, v, meta, meta, bias=bias)
        else:
            out = varlen_attention(q, k, v, meta, meta, backend=backend, bias=bias)
        out.backward(grad_out.to(device, run_dtype))
        return [t.float().cpu() for t in (out, q.grad, k.grad, v.grad)]

    got, plain, exact = run("torch_flash", dtype), run("reference", dtype), run("reference", torch.float64)
    zero_scale = max(t.abs().max().item() for t in exact)
    for name, g, p, e in zip(("out", "dq", "dk", "dv"), got, plain, exact):
        assert_as_accurate(f"torch_flash {name}", g, p, e, dtype, factor=2 if name == "out" else 3,
                           zero_scale=zero_scale)


@pytest.mark.parametrize("device, dtype", CASES)
def test_dropout_is_redrawn_from_the_forward_rng_state(device, dtype):
    """The same seed draws the same mask; the backward redraws the forward's mask from the rng state the forward
    returned, whatever the generator did in between; another call draws another mask."""
    meta = consecutive_meta([40, 9, 77], device)

    def run(seed, draws_between):
        torch.manual_seed(seed)
        q, k, v = qkv(126, 0, device, dtype)
        out = flash_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, 77, 77, dropout_p=0.25, window=8)
        torch.rand(draws_between, device=device)  # the generator moves on before the backward
        out.backward(torch.ones_like(out))
        return out, q.grad, k.grad, v.grad

    first, second, other = run(5, 0), run(5, 1000), run(6, 0)
    assert torch.equal(first[0], second[0]) and not torch.equal(first[0], other[0])
    # dk, dv are summed in a fixed order; the CUDA kernel adds dq's parts atomically, in any order
    assert torch.equal(first[2], second[2]) and torch.equal(first[3], second[3])
    torch.testing.assert_close(first[1], second[1], **({} if device == "cpu" else {"rtol": 2e-2, "atol": 1e-2}))


@pytest.mark.parametrize("device, dtype", CASES)
def test_a_torch_flash_step_asks_for_the_two_kernels_alone(device, dtype):
    """Forward and backward are one op each: no zero gradient made for the forward's lse and rng state (autograd
    materialises one for every output, undifferentiated ones too, unless told not to: a CUDA kernel each, every
    layer, every step), and out, dq, dk, dv come contiguous, as the CUDA kernels write them (the CPU twin too, so
    the host-overhead proxy counts no copy after them that CUDA does not make)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from host_overhead import StepCounter

    meta = consecutive_meta([40, 9], device)
    q, k, v = qkv(49, 0, device, dtype)
    grad = torch.ones(49, HEADS, HEAD_DIM, device=device, dtype=dtype)
    with StepCounter() as counter:
        out = flash_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, 40, 40, dropout_p=0.1, window=8)
        grads = torch.autograd.grad(out, (q, k, v), grad)
    assert dict(counter.ops) == {"flash_varlen_forward": 1, "flash_varlen_backward": 1}
    assert all(t.is_contiguous() for t in (out, *grads))


def test_the_twin_gradient_with_dropout_and_window_is_the_derivative():
    """gradcheck of the CPU twin in fp64 with dropout (the seed fixed per call) and a window, on a small stream
    (gradcheck's fast mode missed a wrong backward here)."""
    meta = consecutive_meta([4, 1, 6], "cpu")
    gen = torch.Generator().manual_seed(3)
    leaves = [torch.randn(11, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3)]

    def attention(q, k, v):
        torch.manual_seed(9)
        return flash_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, 6, 6, dropout_p=0.3, window=2)
    assert torch.autograd.gradcheck(attention, leaves)


def test_a_window_needs_consecutive_positions():
    """The kernels' window counts rows: on a stream that skips positions (a shortened one) or across two streams it
    would not be the window of positions, and the bias refuses to be built for them."""
    meta = consecutive_meta([5, 8], "cpu")
    skipping = meta._replace(consecutive=False)
    table = window_by_distance(2, HEADS)
    StreamBias.build(table, meta, meta, "torch_flash", torch.float32, window=2)
    for mq, mk, window in ((skipping, skipping, 2), (meta, consecutive_meta([5, 8], "cpu"), 2), (meta, meta, None)):
        with pytest.raises(ValueError, match="torch_flash' takes a position bias only as a local window"):
            StreamBias.build(table, mq, mk, "torch_flash", torch.float32, window=window)


def test_the_op_traces_whole():
    """dynamo and AOT autograd trace the custom ops (their fake functions and autograd formula) without a graph
    break: compiled, forward and backward equal eager."""
    meta = consecutive_meta([12, 3, 20], "cpu")

    def step(q, k, v):
        out = flash_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, 20, 20, window=4)
        return (out * out).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_leaves, compiled_leaves = qkv(35, 1), qkv(35, 1)
    step(*eager_leaves).backward()
    compiled(*compiled_leaves).backward()
    for a, b in zip(eager_leaves, compiled_leaves):
        torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.parametrize("preset", ["mlm", "3ml"])
def test_local_layers_on_consecutive_positions_run_the_window_of_rows(preset):
    """A model with local layers on torch_flash: mlm's encoder (consecutive positions) computes what the reference
    computes with the window as a position bias, loss and gradients; 3ml's encoder runs on a shortened stream, where
    the kernel's window of rows is not the window of positions: refused, naming why."""
    from conftest import tiny_batch, tiny_model

    batch = tiny_batch(num_sequences=6, seed=2, min_len=20, max_len=60)
    results = []
    for backend in ("reference", "torch_flash"):
        model = tiny_model(preset, seed=0, global_attention_every=2, local_window=8, position_embedding="rotary",
                           norm_position="pre", encoder_layers=4)
        model.set_attention_backend(backend)
        if preset == "3ml" and backend == "torch_flash":
            with pytest.raises(ValueError, match="torch_flash: a local window over consecutive positions only"):
                model(batch, seed=1)
            return
        out = model(batch, seed=1)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records a CUDA graph")
def test_a_recorded_graph_redraws_dropout_on_each_replay():
    """Recorded in a CUDA graph, the forward and backward with attention dropout draw a fresh mask on each replay,
    from the generator's state: reseeded, the replays repeat (a resumed run's replays continue as the run's did)."""
    meta = consecutive_meta([300, 17, 129], "cuda")
    q, k, v = qkv(446, 0, "cuda", torch.bfloat16)
    grad = torch.randn_like(q)

    def step():
        for leaf in (q, k, v):
            leaf.grad = None
        out = flash_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, 300, 300, dropout_p=0.2)
        out.backward(grad)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    def replays(seed):
        torch.cuda.manual_seed(seed)
        results = []
        for _ in range(2):
            graph.replay()
            results.append((out.clone(), k.grad.clone(), v.grad.clone()))
        return results

    first, again = replays(3), replays(3)
    assert not torch.equal(first[0][0], first[1][0])  # each replay a fresh mask
    for a, b in zip(first, again):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    no_dropout = flash_varlen(q, k, v, meta.cu_seqlens, meta.cu_seqlens, 300, 300)
    assert (first[0][0] - no_dropout).abs().max() > 0.1  # not silently without dropout
