"""Each fastmae.kernels op against its torch reference: time, peak memory and (CUDA) achieved bandwidth.

    python benchmarks/kernels.py [--hidden 768] [--tokens 16384] [--vocab 50265] [--ops all|data|layers] [--name N]

`data`: the masking, gather, insertion and cross-entropy kernels against their torch references. `layers`: a
transformer layer's fused kernels (fastmae.ops: the projection's bias + dropout + add + LayerNorm, bias + GELU after
the projection, GeGLU, the QKV projection with the rotary of q and k) against the stock torch ops a Hugging Face layer
runs for the same math (the bias added, F.dropout, the add, F.layer_norm; F.linear with its bias and F.gelu; chunk
and F.gelu times the gate; F.linear, unbind and transformers' rotate-half): the comparison issue 55 asks each fused
kernel to win.
On CUDA `layers` also times the post-LN norm and bias + GELU (on its own, against F.gelu(a + b)) at every candidate
tiling of one kernel at a time (`norm.CANDIDATES`, `activation.BIAS_GELU_CANDIDATES`): the fastest is what to ship.

On CUDA both implementations run side by side in one process, and each is timed twice: wall time per call (what a
step pays, Python and launches included) and GPU time (the sum of its kernels' durations, from the profiler), from
which bandwidth (data-movement ops) and FLOP/s (the cross-entropy) are computed; the busiest kernels of each op are
printed. Without CUDA only the torch reference runs (the Triton interpreter is a correctness tool, not a speed), and
the table says so. Writes benchmarks/results/kernels.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import gpu_kernel_time, median_time, write_results
from fastmae.kernels import (
    activation,
    embed_rows,
    embed_rows_reference,
    insert_rows,
    insert_rows_reference,
    linear_cross_entropy,
    linear_cross_entropy_reference,
    mask_key,
    select_masked,
    select_masked_reference,
    table_gradient,
)
from fastmae.kernels.activation import _tile
from fastmae.kernels.launch import column_block

from fastmae import PackedBatch, ops
from fastmae.config import SpecialTokens
from fastmae.hardware import spec_peak_flops
from fastmae.masking import MaskCounts

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains

# Peak DRAM bandwidth (GB/s) of devices we know, for the "% of peak" column.
PEAK_BANDWIDTH = {"H100": 3350, "H200": 4800, "A100": 2039}


def peak_bandwidth(device_name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in device_name), None)


def measure(fn, device) -> tuple[float, float]:
    """(median seconds, peak MiB above the starting allocation) of fn() (forward + backward)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    seconds = median_time(fn, warmup=3, repeats=10)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    return seconds, peak


def cases(tokens: int, hidden: int, vocab: int, device, dtype):
    """(name, bytes moved by the ideal kernel, FLOPs, reference fn, kernel fn) for each op, forward + backward."""
    gen = torch.Generator().manual_seed(0)
    seqlen = 512
    ids = torch.randint(len(FASTMAE.as_dict()), vocab, (tokens,), generator=gen, dtype=torch.int32)
    batch = PackedBatch.from_packed(ids.numpy(), [seqlen] * (tokens // seqlen)).to(device)
    counts = MaskCounts.compute(batch.num_maskable, 0.5, 1.0, 0.0)
    maskable = ~torch.isin(batch.tokens, torch.tensor(FASTMAE.unmaskable, dtype=torch.int32, device=device))
    mask_args = (batch.tokens, batch.cu_seqlens, batch.seq_ids, maskable, counts.removed.to(device),
                 counts.random.to(device), counts.predicted.to(device), int(counts.predicted.sum()),
                 int(counts.removed.sum()), mask_key(0, 0), mask_key(0, 0, stream=1), FASTMAE.mask,
                 FASTMAE.ordinary_ids(vocab).to(device), batch.max_seqlen)
    sel = select_masked_reference(*mask_args)
    n_vis, n_masked = sel.visible_index.numel(), sel.masked_index.numel()
    elt = torch.finfo(dtype).bits // 8

    # weights at the model's init scale: unscaled ones give peaked softmaxes whose denormal gradients make CPU
    # matmuls 40x slower (measured: 7 s instead of 0.25 s for the [T_m, V] x [V, H] product)
    table = (0.02 * torch.randn(vocab, hidden, device=device)).to(dtype).requires_grad_()
    pos = torch.randn(seqlen + 1, hidden, device=device, dtype=dtype, requires_grad=True)
    ln_w = torch.ones(hidden, device=device, requires_grad=True)
    ln_b = torch.zeros(hidden, device=device, requires_grad=True)
    vis_ids = sel.input_tokens.index_select(0, sel.visible_index)
    vis_pos = batch.positions.index_select(0, sel.visible_index) + 1
    grad_vis = torch.randn(n_vis, hidden, device=device, dtype=dtype)

    def embed(fn):
        return lambda: torch.autograd.backward(fn(table, vis_ids, pos, vis_pos, ln_w, ln_b), grad_vis)

    states = torch.randn(n_vis, hidden, device=device, dtype=dtype, requires_grad=True)
    fill = torch.randn(hidden, device=device, dtype=dtype, requires_grad=True)
    grad_full = torch.randn(tokens, hidden, device=device, dtype=dtype)

    def insert(fn):
        return lambda: torch.autograd.backward(
            fn(states, sel.visible_index, sel.removed_index, fill, pos, batch.positions + 1, ln_w, ln_b), grad_full)

    x = torch.randn(n_masked, hidden, device=device, dtype=dtype, requires_grad=True)
    bias = torch.zeros(vocab, device=device, dtype=dtype, requires_grad=True)

    def loss(fn):
        return lambda: fn(x, table, bias, sel.labels).backward()

    rows_bytes = 2 * 2 * n_vis * hidden * elt  # read rows + write output, and the same again backward
    yield ("mask select", tokens * 4 * 4, 0, lambda: select_masked_reference(*mask_args),
           lambda: select_masked(*mask_args))
    yield "embed gather + LN", rows_bytes, 0, embed(embed_rows_reference), embed(embed_rows)
    yield "insertion + pos + LN", 2 * 2 * tokens * hidden * elt, 0, insert(insert_rows_reference), insert(insert_rows)
    yield ("linear cross-entropy", (2 * vocab * hidden + 2 * n_masked * hidden) * elt, 6 * n_masked * vocab * hidden,
           loss(linear_cross_entropy_reference), loss(linear_cross_entropy))


def candidate_tilings(shipped: dict, candidates: dict):
    """(what a row says of it, tiling) for each candidate of each kernel (norm.CANDIDATES, activation's), the other
    kernels' tiles as shipped: the GPU's table says which to ship."""
    for kernel, tried in candidates.items():
        ship = shipped[kernel]
        for tiles in tried:
            if tiles != ship:
                yield (f"{kernel} tiles {_tiles_said(tiles)} (rows x warps; shipped {_tiles_said(ship)})",
                       {**shipped, kernel: tiles})


def _tiles_said(tiles) -> str:
    """A RowTiles in a row's name: rows x warps, and whether it prefetches its next tile."""
    return f"{tiles.rows}x{tiles.warps}" + (" prefetching" if tiles.prefetch else "")


@triton.jit
def _tile_copy_kernel(A, Y, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """bias + GELU's forward (kernels/activation.py) without its bias and its maths: the same tiles' loads and
    stores, what those tiles alone move a second (a reference row: where it reaches torch's copy, the maths bind)."""
    offsets, _, mask, _ = _tile(tl.program_id(0), n_rows, n_cols, 1, BLOCK_R, BLOCK_C)
    tl.store(Y + offsets, tl.load(A + offsets, mask=mask, other=0.0), mask=mask)


def tile_copy(source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` = `source` [rows, columns] by _tile_copy_kernel at bias + GELU's shipped forward tiles for `columns`."""
    rows, columns = source.shape
    block_c = column_block(columns)
    block_r, warps, _ = activation.bias_gelu_tiles(columns)["forward"]
    _tile_copy_kernel[activation._grid(rows, columns, block_r, block_c)](
        source, out, rows, columns, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def layer_cases(tokens: int, hidden: int, vocab: int, device, dtype, dropout: float = 0.1):
    """(name, bytes moved by the ideal fused kernel, FLOPs, stock torch fn, fastmae.ops fn) for each of a layer's fused
    ops, forward + backward, at RoBERTa's (bias + GELU, post-LN with dropout) and ModernBERT's (GeGLU, pre-LN without
    bias) shapes for `hidden`, and the token table's gradient from the embedding's rows; on CUDA also the post-LN
    norm and bias + GELU at each candidate tiling. First a copy
    of the feed-forward's rows by torch on both sides: the bandwidth a streaming kernel reaches on this device, which
    the data sheet's peak (the `% of peak BW` column) overstates; on CUDA then the same copy by a Triton kernel at
    bias + GELU's forward tiles (`tile_copy`)."""
    from fastmae.kernels import add_layer_norm, bias_gelu, layer_norm, norm

    tilings = candidate_tilings if device.type == "cuda" else lambda shipped, candidates: ()
    gen = torch.Generator(device=device).manual_seed(0)
    elt = torch.finfo(dtype).bits // 8

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype).requires_grad_()

    x, residual, grad = leaf(tokens, hidden), leaf(tokens, hidden), torch.randn(tokens, hidden, device=device,
                                                                               dtype=dtype)
    weight, bias = leaf(hidden), leaf(hidden)
    inner = 4 * hidden
    source, copied = torch.randn(tokens, inner, device=device, dtype=dtype), torch.empty(tokens, inner, device=device,
                                                                                           dtype=dtype)
    torch_copy = lambda: copied.copy_(source)  # noqa: E731 (the same reference for both rows: timed once)
    yield ("copy of the feed-forward's rows (torch on both sides: the device's streaming bandwidth)",
           2 * tokens * inner * elt, 0, torch_copy, torch_copy)
    if device.type == "cuda":  # a reference row: where it fails, said, and the fused kernels' rows still run
        try:
            copies = torch.equal(tile_copy(source, torch.empty_like(source)), source)
        except Exception as error:  # noqa: BLE001 (a compile failure on this device)
            copies = f"{type(error).__name__}: {str(error)[:200]}"
        if copies is True:
            yield ("copy of the feed-forward's rows, Triton at bias + GELU's forward tiles (its loads and stores, none "
                   "of its maths)", 2 * tokens * inner * elt, 0, torch_copy, lambda: tile_copy(source, copied))
        else:
            print(f"tile_copy left out: {copies or 'its copy differs from its source'}", flush=True)

    def post_ln(fn):
        return lambda: torch.autograd.backward(fn(), grad)

    # RoBERTa's post-LN as fastmae runs it: the projection before it without its bias, which the kernel adds and
    # whose gradient it sums (torch adds it in the GEMM and sums its gradient in a kernel of its own: here, by itself)
    post_ln_name = "projection's bias + dropout + add + LayerNorm (post-LN)"
    post_ln_bytes, x_bias = 8 * tokens * hidden * elt, leaf(hidden)
    stock_post_ln = post_ln(lambda: F.layer_norm(F.dropout(x + x_bias, dropout) + residual, (hidden,), weight, bias))
    key = torch.zeros(1, dtype=torch.int64, device=device)
    for said, tiling in [(None, None), *tilings(norm.tiles(hidden), norm.CANDIDATES)]:
        yield (post_ln_name + (f", {said}" if said else ""), post_ln_bytes, 0, stock_post_ln,
               post_ln(lambda tiling=tiling: add_layer_norm(x, residual, weight, bias, 1e-5, False, dropout, key,
                                                            tiling, x_bias)[0]))

    def pre_ln(fn):
        return lambda: torch.autograd.backward(fn(), (grad, grad))

    def stock_pre_ln():
        h = x + residual
        return F.layer_norm(h, (hidden,), weight, None), h

    yield ("add + LayerNorm, sum kept (pre-LN)", 10 * tokens * hidden * elt, 0, pre_ln(stock_pre_ln),
           pre_ln(lambda: ops.add_layer_norm(x, residual, weight, None, 1e-5, True)))
    yield ("LayerNorm without a residual (the LM head's)", 4 * tokens * hidden * elt, 0,
           post_ln(lambda: F.layer_norm(x, (hidden,), weight, bias)),
           post_ln(lambda: layer_norm(x, weight, bias)))
    w_in, b_in, grad_inner = leaf(inner, hidden, scale=0.02), leaf(inner), torch.randn(tokens, inner, device=device,
                                                                                         dtype=dtype)

    def projected(fn):
        return lambda: torch.autograd.backward(fn(), grad_inner)

    yield ("linear + bias + GELU", 0, 6 * tokens * hidden * inner,
           projected(lambda: F.gelu(F.linear(x, w_in, b_in))), projected(lambda: ops.linear_gelu(x, w_in, b_in)))
    projection = leaf(tokens, inner)  # x W^T, the bias + GELU's input: its tilings timed on their own
    stock_bias_gelu = projected(lambda: F.gelu(projection + b_in))
    yield ("bias + GELU", 5 * tokens * inner * elt, 0, stock_bias_gelu,
           projected(lambda: bias_gelu(projection, b_in)))
    for said, tiling in tilings(activation.bias_gelu_tiles(inner), activation.BIAS_GELU_CANDIDATES):
        yield (f"bias + GELU, {said}", 5 * tokens * inner * elt, 0, stock_bias_gelu,
               projected(lambda tiling=tiling: bias_gelu(projection, b_in, tiling)))
    gated = 3 * hidden // 2  # ModernBERT-base's 1,152 at 768
    a, grad_gated = leaf(tokens, 2 * gated), torch.randn(tokens, gated, device=device, dtype=dtype)

    def stock_geglu():
        value, gate = a.chunk(2, dim=-1)
        return F.gelu(value) * gate

    yield ("GeGLU", 8 * tokens * gated * elt, 0, lambda: torch.autograd.backward(stock_geglu(), grad_gated),
           lambda: torch.autograd.backward(ops.geglu(a), grad_gated))
    # ModernBERT's attention input: QKV projection without a bias, q and k rotated (transformers' rotate-half)
    heads, head_dim = hidden // 64, 64
    w_qkv, angles = leaf(3 * hidden, hidden, scale=0.02), torch.rand(tokens, head_dim // 2, device=device) * 6.3
    cos, sin = angles.cos(), angles.sin()
    grads_qkv = [torch.randn(tokens, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]

    def stock_qkv_rotary():  # what ModernBertForMaskedLM runs: transformers' own apply_rotary_pos_emb
        from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

        q, k, v = F.linear(x, w_qkv).view(tokens, 3, heads, head_dim).unbind(1)
        return (*apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)), v)

    yield ("QKV projection + rotary (no bias)", 0, 18 * tokens * hidden * hidden,
           lambda: torch.autograd.backward(stock_qkv_rotary(), grads_qkv),
           lambda: torch.autograd.backward(ops.project_qkv(x, w_qkv, None, heads, rotary=(cos, sin)), grads_qkv))
    # the embedding tables' gradients from the rows' gradients (in the training dtype, as the row ops' backward
    # writes them and a stock model's embedding receives them): the token table from an mlm micro-batch's ids, 12% of
    # them `<mask>` (15% predicted, 80% of those replaced: one long run), and RoBERTa's learned position table (514
    # rows) from sequences of 512
    ids = torch.randint(5, vocab, (tokens,), generator=gen, device=device, dtype=torch.int32)
    ids[torch.rand(tokens, generator=gen, device=device) < 0.12] = SpecialTokens().mask
    rows = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
    for said, table_ids, table_rows in (("token table's gradient (12% of the rows one id)", ids, vocab),
                                        ("position table's gradient (sequences of 512)",
                                         torch.arange(tokens, device=device) % 512 + 2, 514)):
        yield (said, tokens * hidden * elt + table_rows * hidden * elt, 0,
               lambda ids=table_ids, n=table_rows: torch.ops.aten.embedding_dense_backward(rows, ids, n, -1, False),
               lambda ids=table_ids, n=table_rows: table_gradient(rows, ids, n, dtype))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 16384 CUDA, 2048 CPU)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50265)
    parser.add_argument("--ops", choices=("all", "data", "layers"), default="all")
    parser.add_argument("--name", default="kernels", help="results name (benchmarks/results/NAME.{json,md})")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = args.tokens or (16384 if cuda else 2048)
    peak = peak_bandwidth(torch.cuda.get_device_name()) if cuda else None
    peak_flops = spec_peak_flops(device, dtype) if cuda else None
    rows = []
    chosen = []
    if args.ops in ("all", "data"):
        chosen.append(cases(tokens, args.hidden, args.vocab, device, dtype))
    if args.ops in ("all", "layers"):
        chosen.append(layer_cases(tokens, args.hidden, args.vocab, device, dtype))
    timed = {}  # each torch reference's (seconds, MiB, GPU seconds): the candidate tilings share theirs
    for name, nbytes, flops, reference, kernel in itertools.chain(*chosen):
        if reference not in timed:
            timed[reference] = (*measure(reference, device),
                                gpu_kernel_time(reference, f"{name}, torch", repeats=5, top=4) if cuda else None)
        ref_s, ref_mem, ref_gpu_s = timed[reference]
        row = {"op (fwd+bwd)": name, "torch ms": 1e3 * ref_s}
        if cuda:
            row["torch MiB"] = ref_mem
            k_s, k_mem = measure(kernel, device)
            k_gpu_s = gpu_kernel_time(kernel, f"{name}, triton", repeats=5, top=4)
            gbps = nbytes / k_gpu_s / 1e9 if nbytes else None
            row.update({"triton ms": 1e3 * k_s, "triton MiB": k_mem, "speedup": ref_s / k_s,
                        "torch GPU ms": 1e3 * ref_gpu_s, "triton GPU ms": 1e3 * k_gpu_s,
                        "triton GB/s (GPU time)": gbps, "% of peak BW": 100 * gbps / peak if peak and gbps else None,
                        "% of peak FLOP/s": 100 * flops / k_gpu_s / peak_flops if flops and peak_flops else None})
        rows.append(row)
        print(row, flush=True)
    columns = list(rows[0])
    note = (f"{tokens} tokens (sequences of 512, 50% masked), hidden {args.hidden}, vocab {args.vocab}, {dtype}; "
            "the layer ops against stock torch (F.dropout at 0.1, F.layer_norm, F.linear + F.gelu, chunk + F.gelu, "
            "F.linear + unbind + rotate-half, torch's embedding backward), "
            "intermediate width 4 x hidden (GeGLU 1.5 x hidden). "
            + ("Triton kernels and torch side by side; ms = wall time per call, GPU ms = the sum of its "
               "kernels' durations (profiler), from which GB/s and FLOP/s are computed (peaks: data sheet)."
               if cuda else
               "No CUDA device: the torch reference path alone (the CPU path); Triton timings need a GPU."))
    print(f"wrote {write_results(args.name, rows, columns, 'fastmae.kernels vs torch', note)}")


if __name__ == "__main__":
    main()
