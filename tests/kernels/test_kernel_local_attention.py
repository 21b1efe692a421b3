"""Local attention by original position (Triton) against its torch reference, forward and backward: shortened
streams (positions skip, as 3ml's and mae-lm's encoder sees them) and full ones, windows narrower than a block, wider
than one and wider than a sequence, sequence lengths no block divides, several seeds and dtypes. Blocks of 16 rows
under the interpreter (a sequence spans several), the shipped ones (`local_window.tiles`) on a GPU."""

import pytest
import torch
from conftest import KERNEL_DEVICE
from fastmae.kernels import local_attention, local_attention_reference, local_window
from tolerance import assert_as_accurate

DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if torch.cuda.is_available() else [])
LENGTHS = [37, 5, 33, 1]  # 1: a sequence of one row; 37, 33: lengths no block divides
# window (positions either side), rows skipping positions. wide-full: with blocks of 16 rows, a window of 30 leaves
# the blocks beside a held one one position short of needing no mask (kernels mask only the blocks they must)
STREAMS = {"narrow-shortened": (3, True), "wide-shortened": (20, True), "whole-shortened": (200, True),
           "wide-full": (30, False)}
if torch.cuda.is_available():  # every combination, compiled
    CASES = [(name, dtype, seed) for name in STREAMS for dtype in DTYPES for seed in (0, 1)]
else:  # under the interpreter (seconds a case): each stream, dtype and seed at least once
    CASES = [("narrow-shortened", torch.float32, 0), ("narrow-shortened", torch.bfloat16, 1),
             ("wide-shortened", torch.float32, 1), ("whole-shortened", torch.bfloat16, 0),
             ("wide-full", torch.float32, 0)]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """16-row blocks where the interpreter runs the kernel: the sequences above span up to four of them, and the
    backward's programs 32 rows, so that the keys of one program's span reach the queries of another's."""
    if KERNEL_DEVICE == "cpu":
        from fastmae.kernels import local_window

        small = local_window.Tiles(16, 16, 4, span=32)  # the backward's programs: two spans of the longer sequences
        monkeypatch.setattr(local_window, "tiles", lambda head_dim: dict.fromkeys(local_window.KERNELS, small))


def stream(lengths, shortened: bool, seed: int):
    """(cu_seqlens, positions): each sequence's original positions, increasing; shortened: about every other one
    kept, at random."""
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if shortened:
        positions = [torch.sort(torch.randperm(2 * n, generator=gen)[:n]).values for n in lengths]
    else:
        positions = [torch.arange(n) for n in lengths]
    return cu, torch.cat(positions).int()


def assert_matches_the_reference(q, k, v, grad, cu, positions, max_seqlen, window, dtype, label="local_attention",
                                 **options):
    """local_attention (with `options`) in `dtype` against the reference in `dtype` and in fp64: the output and the
    gradients of q, k and v under `grad`, at the tolerances of tolerance.assert_as_accurate."""
    def run(fn, run_dtype, **kwargs):
        leaves = [t.to(KERNEL_DEVICE, run_dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, cu.to(KERNEL_DEVICE), positions.to(KERNEL_DEVICE), max_seqlen, window, **kwargs)
        return [out, *torch.autograd.grad(out, leaves, grad.to(KERNEL_DEVICE, run_dtype))]

    got, plain = run(local_attention, dtype, **options), run(local_attention_reference, dtype)
    exact = run(local_attention_reference, torch.float64)
    for name, g, p, e in zip(["out", "dq", "dk", "dv"], got, plain, exact):
        assert g.dtype == dtype
        assert_as_accurate(f"{label} {name}", g.cpu(), p.cpu(), e.cpu(), dtype, factor=2 if name == "out" else 3,
                           zero_scale=1.0)


@pytest.mark.parametrize("stream_name, dtype, seed", CASES, ids=[f"{n}-{str(d)[6:]}-{s}" for n, d, s in CASES])
def test_local_attention_matches_the_reference_forward_and_backward(stream_name, dtype, seed):
    window, shortened = STREAMS[stream_name]
    cu, positions = stream(LENGTHS, shortened, seed)
    gen = torch.Generator().manual_seed(seed + 10)
    rows, heads, head_dim = int(cu[-1]), 2, 16 if seed == 0 else 32
    q, k, v, grad = (torch.randn(rows, heads, head_dim, generator=gen) for _ in range(4))
    if seed == 1:  # q as a strided view, as the model's split of one projection gives it
        q = torch.cat([q, torch.randn(rows, heads, head_dim, generator=gen)], dim=1)[:, :heads]
    assert_matches_the_reference(q, k, v, grad, cu, positions, max(LENGTHS), window, dtype)


@pytest.mark.parametrize("window", [3, 200])
def test_the_backward_sums_dq_across_its_spans(window):
    """A sequence longer than the backward's span: the keys of one program's span give dq terms to the queries of
    the next (and the one before), which that program adds in its own loops. Also a sequence whose last block of keys
    is cut short by its end in a span of several blocks: with a window wider than the sequence every other block is
    wholly inside it, unmasked, and the rows past the end must still give dq nothing."""
    block, span = (16, 48) if KERNEL_DEVICE == "cpu" else (64, 128)
    lengths = [37, 100] if KERNEL_DEVICE == "cpu" else [150, 300]
    tiling = {"forward": local_window.Tiles(block, block, 4),
              "backward": local_window.Tiles(block, 16, 4, span=span)}
    cu, positions = stream(lengths, True, 4)
    gen = torch.Generator().manual_seed(5)
    q, k, v, grad = (torch.randn(int(cu[-1]), 2, 16, generator=gen) for _ in range(4))
    dtype = torch.float32 if KERNEL_DEVICE == "cpu" else torch.bfloat16
    assert_matches_the_reference(q, k, v, grad, cu, positions, max(lengths), window, dtype, tiling=tiling)


def test_the_window_counts_positions_not_rows():
    """On a shortened stream a window of rows keeps pairs a window of positions drops: the kernel must not."""
    cu, positions = stream([40], True, 0)
    q, k, v = (torch.randn(40, 1, 16, generator=torch.Generator().manual_seed(i)).to(KERNEL_DEVICE) for i in range(3))
    cu, positions = cu.to(KERNEL_DEVICE), positions.to(KERNEL_DEVICE)
    by_position = local_attention(q, k, v, cu, positions, 40, 3)
    by_row = local_attention_reference(q, k, v, cu, torch.arange(40, dtype=torch.int32, device=KERNEL_DEVICE), 40, 3)
    assert (by_position - by_row).abs().max() > 0.1
    assert torch.allclose(by_position, local_attention_reference(q, k, v, cu, positions, 40, 3), atol=1e-5)
    # the benchmark's form with every block masked computes the same (a window of 20 leaves blocks wholly inside it)
    wide = local_attention(q, k, v, cu, positions, 40, 20)
    assert torch.allclose(local_attention(q, k, v, cu, positions, 40, 20, mask_every_block=True), wide, atol=1e-6)


def test_local_attention_names_what_it_cannot_take():
    q = torch.randn(4, 1, 12, device=KERNEL_DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=KERNEL_DEVICE)
    positions = torch.arange(4, dtype=torch.int32, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        local_attention(q, q, q, cu, positions, 4, 2)
    q = torch.randn(4, 1, 16, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="int32"):
        local_attention(q, q, q, cu, positions.long(), 4, 2)
    uneven = {"forward": local_window.Tiles(16, 16, 4), "backward": local_window.Tiles(32, 16, 4, span=48)}
    with pytest.raises(ValueError, match="span must be a multiple of both its blocks"):
        local_attention(q, q, q, cu, positions, 4, 2, tiling=uneven)


def count_products(monkeypatch) -> list:
    """The tensor-core products (tl.dot) the interpreter runs from here on, one entry each."""
    from triton.runtime import interpreter

    products = []
    create_dot = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, *args: products.append(1) or create_dot(self, *args))
    return products


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="counts the interpreter's tensor-core products")
def test_blocks_outside_every_window_are_skipped(monkeypatch):
    """The kernels multiply only the blocks of the other side that some row's window reaches: one sequence of 256
    consecutive positions, a window of 3, blocks of 16 rows, so each block reaches itself and its neighbours (46 of
    the 256 block pairs); each visit costs the forward 2 products and the backward 5, FlashAttention's (its span
    holds the whole sequence: no dq term computed twice)."""
    products = count_products(monkeypatch)
    rows, blocks = 256, 256 // 16
    cu = torch.tensor([0, rows], dtype=torch.int32)
    q, k, v = (torch.randn(rows, 1, 16, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(3))
    tiling = {"forward": local_window.Tiles(16, 16, 4), "backward": local_window.Tiles(16, 16, 4, span=rows)}
    local_attention(q, k, v, cu, torch.arange(rows, dtype=torch.int32), rows, 3, tiling=tiling).sum().backward()
    reached = 3 * blocks - 2  # the first and the last block have one neighbour
    assert len(products) == (2 + 5) * reached


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="counts the interpreter's tensor-core products")
def test_the_benchmarks_count_of_visited_blocks_is_the_kernels(monkeypatch):
    """benchmarks/local_attention's visited_blocks and outside_visits, the CPU-countable floor of a local layer's
    cost against a global one, count the blocks each kernel visits: on a shortened stream whose lengths no block
    divides, another tiling for each kernel and backward spans shorter than a sequence (the keys of one span reaching
    the queries of the next), the interpreter's products are each loop's products a visit times its visits."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from local_attention import KERNEL_PRODUCTS, OUTSIDE_PRODUCTS, outside_visits, visited_blocks

    products = count_products(monkeypatch)
    lengths, window = [150, 37], 20
    cu, positions = stream(lengths, True, 2)
    tiling = {"forward": local_window.Tiles(32, 16, 4), "backward": local_window.Tiles(16, 32, 4, span=64)}
    q, k, v = (torch.randn(int(cu[-1]), 1, 16, generator=torch.Generator().manual_seed(i)).requires_grad_()
               for i in range(3))
    local_attention(q, k, v, cu, positions, max(lengths), window, tiling=tiling).sum().backward()
    sequences = positions.split(lengths)
    outside = sum(outside_visits(p, tiling["backward"], window) for p in sequences)
    expected = sum(KERNEL_PRODUCTS[kernel] * visited_blocks(p, tiles.outer, tiles.inner, window)
                   for kernel, tiles in tiling.items() for p in sequences) + OUTSIDE_PRODUCTS * outside
    assert outside > 0 and len(products) == expected, (len(products), expected, outside)


TILINGS = [(kernel, tiles) for kernel, candidates in local_window.CANDIDATES.items() for tiles in candidates]
if KERNEL_DEVICE == "cpu":  # under the interpreter: each kernel's largest blocks
    TILINGS = [max(((k, t) for k, t in TILINGS if k == kernel), key=lambda kt: kt[1].outer * kt[1].inner)
               for kernel in local_window.KERNELS]


@pytest.mark.parametrize("kernel, tiles", TILINGS, ids=[f"{k}-{t.outer}x{t.inner}-{t.warps}-{t.stages}"
                                                         for k, t in TILINGS])
def test_every_tiling_the_gpu_benchmark_times_computes_the_reference(kernel, tiles):
    """benchmarks/local_attention.py times each candidate tiling (local_window.CANDIDATES) on CUDA, where fastmae may
    ship the fastest: each computes what the reference does, forward and backward, on a shortened stream whose
    lengths no block divides, at the heads of 64 the candidates are for."""
    cu, positions = stream([150, 37], True, 0)
    gen = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(int(cu[-1]), 1, 64, generator=gen) for _ in range(4))
    tiling = {**local_window.tiles(64), kernel: tiles}
    dtype = torch.bfloat16 if KERNEL_DEVICE == "cuda" else torch.float32
    assert_matches_the_reference(q, k, v, grad, cu, positions, 150, 20, dtype,
                                 label=f"local_attention ({kernel} {tiles})", tiling=tiling)


@pytest.mark.skipif(KERNEL_DEVICE != "cpu", reason="counts the interpreter's loads")
def test_a_program_looks_only_at_the_blocks_its_window_can_reach(monkeypatch):
    """Positions increase within a sequence, so a program scans only the blocks within `window` rows of its own for
    the range its window reaches: the forward's loads grow with the sequence's rows, not with their square."""
    from triton.runtime import interpreter

    loads = []
    for name in ("create_load", "create_masked_load"):  # k and v's rows, the positions
        original = getattr(interpreter.InterpreterBuilder, name)
        monkeypatch.setattr(interpreter.InterpreterBuilder, name,
                            lambda self, *args, _original=original: loads.append(1) or _original(self, *args))

    def forward_loads(rows: int) -> int:
        loads.clear()
        q = torch.randn(rows, 1, 16, generator=torch.Generator().manual_seed(rows))
        local_attention(q, q, q, torch.tensor([0, rows], dtype=torch.int32), torch.arange(rows, dtype=torch.int32),
                        rows, 3)
        return len(loads)

    short, long = forward_loads(256), forward_loads(1024)
    assert long <= 4.2 * short, (short, long)
