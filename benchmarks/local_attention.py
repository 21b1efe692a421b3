"""What a local attention layer costs against a global one, forward + backward, in one run: ModernBERT-base's
attention (12 heads of 64, a window of 128 positions: 64 each side) over full and shortened streams, each layer
on the backend `auto` gives it here (on CPU: padded SDPA for the global layer, the band of row blocks for the
local one, fastmae/banded.py). Also the window as a dense mask over every pair (what the local layer ran before the
band, and what SDPA computes whatever the mask). The target (issue 48): a local layer costs at most its window's
share of a global layer's pairs, plus 20%. The share is counted from the rows' positions (a shortened stream has
fewer keys within the window of each query).

On CUDA, the forms of a local layer at the throughput benchmark's micro-batch instead (`cuda_forms`; issue 55's
target: at most 0.6x a global layer, forward + backward): as fastmae runs it (`auto`: fastmae's own kernel on both
streams), fastmae's kernel (also with every block's pairs masked, to time what skipping the masks of the blocks
wholly inside the window saves; on the shortened stream also with each candidate tiling of each of its two
kernels, `local_window.CANDIDATES`), and torch's FlashAttention-2 window of rows on the full stream (`auto`'s choice
there with attention dropout); beside each of fastmae's kernel's forms, the floor its tiles set (`products_share`).
The CUDA table keeps its earlier name (`local_attention_flex`, from the FlexAttention forms it timed until f6d59b9).

    python benchmarks/local_attention.py   # CPU: local_attention.{json,md}; CUDA: local_attention_flex.{json,md}
"""

from __future__ import annotations

import argparse

import torch
from common import gpu_kernel_seconds, median_time, write_results
from fastmae.kernels import local_window

from fastmae.attention import StreamBias, VarlenMeta, resolve_backend, varlen_attention
from fastmae.positions import window_by_distance

HEADS, HEAD_DIM, HALF_WINDOW = 12, 64, 64
TARGET_MARGIN = 1.2
# what a replayed step pays for a layer's attention (the target's measure on CUDA): its kernels' time, forward +
# backward, no host gaps between launches
GPU_MS = "forward + backward GPU ms"
FORWARD_GPU_MS = "forward GPU ms"  # the forward alone under no_grad: how GPU_MS splits between the two
PRODUCTS = "tiles' products x global"  # products_share: the floor of `x global` at a global layer's speed a product


def make_stream(lengths: list[int], spread: int, dtype, device: str, seed: int = 0):
    """q, k, v [T, HEADS, HEAD_DIM] and the layout of sequences of `lengths` rows whose positions are a sorted
    random subset of range(spread * length) (spread 1: consecutive), and the window's share of the pairs."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.sort(torch.randperm(spread * n, generator=gen)[:n])[0] for n in lengths])
    positions[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = 0  # <s> stays
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    meta = VarlenMeta.build(cu.to(device), max(lengths), seq_ids.to(device), positions.int().to(device),
                            consecutive=spread == 1)
    within = sum(int(((p[:, None] - p[None, :]).abs() <= HALF_WINDOW).sum())
                 for p in positions.split(lengths))
    share = within / sum(n * n for n in lengths)
    qkv = [torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_()
           for _ in range(3)]
    return qkv, meta, share


def forward_backward(run, inputs: tuple[torch.Tensor, ...], grads: dict):
    """One forward and backward of a layer's attention: `run()`'s output against a fixed gradient (one per output
    shape, in `grads`), the gradients of `inputs` returned, not accumulated into `.grad`: the layer's own work, none
    of a loss's or an optimizer's."""
    out = run()
    grad = grads.get(out.shape)
    if grad is None:
        grad = grads[out.shape] = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return torch.autograd.grad(out, inputs, grad)


# Tensor-core products a visit of a block of the other side: the forward's (q k^T, p v), the backward's (q k^T,
# p^T do, do v^T, ds^T q, ds k; its dq term computed for every visit, stored for the span's queries only), the
# backward's for a block of keys outside a program's span that reaches its queries (q k^T, do v^T, ds k); and a global
# layer's forward and backward a pair (FlashAttention's: 2 forward, 5 backward)
KERNEL_PRODUCTS = {"forward": 2, "backward": 5}
OUTSIDE_PRODUCTS = 3
GLOBAL_PRODUCTS = 7


def _reached_blocks(positions: torch.Tensor, first: int, held: int, block: int, window: int) -> tuple[int, int]:
    """(first row, end row) of the blocks of `block` rows that rows first .. first + held - 1 of a sequence of
    increasing `positions` reach: from the block holding the first row whose position their windows reach to the end
    of the block holding the last (local_blocks._reached_rows)."""
    held_positions = positions[first:first + held]
    reached = ((positions >= held_positions.min() - window) & (positions <= held_positions.max() + window))
    rows = reached.nonzero().flatten()
    return int(rows[0]) // block * block, (int(rows[-1]) // block + 1) * block


def visited_blocks(positions: torch.Tensor, held: int, block: int, window: int) -> int:
    """Blocks of `block` rows that fastmae's local-window kernels visit for one sequence of increasing `positions`,
    summed over its blocks of `held` rows (a program's in the forward, a step of a span's loop in the backward)."""
    visits = 0
    for first in range(0, len(positions), held):
        lo, hi = _reached_blocks(positions, first, held, block, window)
        visits += (hi - lo) // block
    return visits


def outside_visits(positions: torch.Tensor, tiles, window: int) -> int:
    """Visits of the backward's loops over the blocks of keys outside a program's span (`tiles.span` rows) whose
    window reaches its queries: those within `window` rows before and after it, each over the span's blocks of
    queries it reaches (none where a span holds the whole sequence)."""
    held, block, rows, visits = tiles.outer, tiles.inner, len(positions), 0
    for span_start in range(0, rows, tiles.span):
        span_end = min(span_start + tiles.span, rows)
        before = range(max(span_start - window, 0) // held * held, span_start, held)
        for first in (*before, *range(span_end, min(span_end + window, rows), held)):
            lo, hi = _reached_blocks(positions, first, held, block, window)
            visits += max(0, -(-(min(hi, span_end) - max(lo, span_start)) // block))
    return visits


def products_share(sequences: list[torch.Tensor], window: int, tiling: dict) -> float:
    """The tensor-core work of fastmae's local-window kernels with `tiling` (local_window.Tiles per kernel), forward
    and backward, over a global layer's on the same sequences (their positions): every lane of every tile visited,
    masked or not, against GLOBAL_PRODUCTS a pair. What the kernels could cost against a global layer at the same
    speed a product: the floor of `x global` (a CPU-countable proxy of it)."""
    local = 0
    for kernel, products in KERNEL_PRODUCTS.items():
        held, block = tiling[kernel].outer, tiling[kernel].inner
        local += products * held * block * sum(visited_blocks(p, held, block, window) for p in sequences)
    backward = tiling["backward"]
    local += (OUTSIDE_PRODUCTS * backward.outer * backward.inner
              * sum(outside_visits(p, backward, window) for p in sequences))
    return local / (GLOBAL_PRODUCTS * sum(len(p) ** 2 for p in sequences))


def _tiles_said(kernel: str, tiles) -> str:
    """A kernel's Tiles in a form's name: blocks, warps, stages, and the backward's span."""
    return (f"{tiles.outer}x{tiles.inner} on {tiles.warps} warps, {tiles.stages} stages"
            + f", spans of {tiles.span}" * (kernel == "backward"))


def kernel_tilings(q, k, v, meta: VarlenMeta) -> dict:
    """fastmae's kernel with one kernel's tiles swapped for each of its candidates (local_window.CANDIDATES), the
    others as shipped: form name -> (its tiling, the call)."""
    shipped = local_window.tiles(HEAD_DIM)
    forms = {}
    for kernel, candidates in local_window.CANDIDATES.items():
        for tiles in candidates:
            tiling = {**shipped, kernel: tiles}
            name = (f"fastmae's kernel, {kernel} {_tiles_said(kernel, tiles)} (shipped "
                    f"{_tiles_said(kernel, shipped[kernel])})")
            forms[name] = tiling, (lambda tiling=tiling: local_window.local_attention(
                q, k, v, meta.cu_seqlens, meta.positions, meta.max_seqlen, HALF_WINDOW, tiling=tiling))
    return forms


def cuda_forms(table: torch.Tensor, repeats: int) -> list[dict]:
    """CUDA: a local layer at the throughput benchmark's micro-batch (128 sequences): as fastmae runs it (`auto`),
    fastmae's kernel (also with every block masked, and on the shortened stream with each candidate tiling), torch's
    FlashAttention-2 window on the full stream; forward alone and with the backward; the global layer beside them (as
    fastmae runs it), and each form's cost against it. (FlexAttention's forms, timed at aaab8be, 86facbd and f6d59b9
    in the committed tables, slower than fastmae's kernel each time, are no longer run: their compiles took much of
    the `modernbert` phase's minutes.)"""
    dtype, rows = torch.bfloat16, []
    for name, lengths, spread in (("128x512 full", [512] * 128, 1), ("128x256 visible", [256] * 128, 2)):
        (q, k, v), meta, share = make_stream(lengths, spread, dtype, "cuda")
        local = resolve_backend(None, torch.device("cuda"), 0.0, dtype, biased=True, window_rows=meta.consecutive,
                                window=True)
        auto_bias = StreamBias.build(table, meta, meta, local, dtype, window=HALF_WINDOW)
        own_bias = StreamBias.build(table, meta, meta, "triton_window", dtype, window=HALF_WINDOW)
        shipped = local_window.tiles(HEAD_DIM)
        tilings = {"fastmae's kernel (triton_window)": shipped, "fastmae's kernel, every block masked": shipped,
                   **({f"local as fastmae runs it ({local})": shipped} if local == "triton_window" else {})}
        forms = {
            f"global ({resolve_backend(None, torch.device('cuda'), 0.0, dtype)})": (
                lambda: varlen_attention(q, k, v, meta)),
            f"local as fastmae runs it ({local})": lambda: varlen_attention(q, k, v, meta, bias=auto_bias),
            "fastmae's kernel (triton_window)": lambda: varlen_attention(q, k, v, meta, backend="triton_window",
                                                                          bias=own_bias),
            # the same with every block's pairs masked, also those wholly inside the window: what skipping them saves
            "fastmae's kernel, every block masked": lambda: local_window.local_attention(
                q, k, v, meta.cu_seqlens, meta.positions, meta.max_seqlen, HALF_WINDOW, mask_every_block=True),
        }
        if meta.consecutive:  # torch's FlashAttention-2 window of rows, what `auto` gives a layer with dropout here
            flash_bias = StreamBias.build(table, meta, meta, "torch_flash", dtype, window=HALF_WINDOW)
            forms["torch's FlashAttention-2 window (torch_flash)"] = (
                lambda: varlen_attention(q, k, v, meta, backend="torch_flash", bias=flash_bias))
        else:  # the stream fastmae's kernel ran on first: each candidate tiling
            candidates = kernel_tilings(q, k, v, meta)
            forms.update({form: call for form, (_, call) in candidates.items()})
            tilings.update({form: tiling for form, (tiling, _) in candidates.items()})
        global_ms, grads = None, {}  # GPU time of this stream's global layer, forward + backward
        sequences = meta.positions.cpu().split(lengths)
        for form, run in forms.items():
            row = {"shape": name, "tokens": sum(lengths), "dtype": "bfloat16", "form": form,
                   "window's share of pairs": share}
            if form in tilings:
                row[PRODUCTS] = products_share(sequences, HALF_WINDOW, tilings[form])
            step = (lambda run=run: forward_backward(run, (q, k, v), grads))
            try:
                with torch.no_grad():
                    row["forward ms"] = 1e3 * median_time(run, warmup=2, repeats=repeats)
                    row[FORWARD_GPU_MS] = 1e3 * gpu_kernel_seconds(run, repeats)
                row["forward + backward ms"] = 1e3 * median_time(step, warmup=2, repeats=repeats)
                row[GPU_MS] = 1e3 * gpu_kernel_seconds(step, repeats)
            except Exception as error:  # a form torch refuses on this GPU: said in its row, the others still run
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            if form.startswith("global"):
                global_ms = row.get(GPU_MS)
            if GPU_MS in row and global_ms:
                row["x global"] = row[GPU_MS] / global_ms
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = (torch.float32, torch.bfloat16) if device == "cpu" else (torch.bfloat16,)
    shapes = [  # (name, lengths, spread)
        ("8x512 full", [512] * 8, 1),
        ("8x256 visible (3ml: 50% removed)", [256] * 8, 2),
        ("16 docs 40..490", [40 + 30 * i for i in range(16)], 1),
    ]
    table = window_by_distance(HALF_WINDOW, HEADS, device)
    if device == "cuda":
        cuda_rows = cuda_forms(table, args.repeats)
        columns = ["shape", "tokens", "dtype", "form", "forward ms", "forward + backward ms", FORWARD_GPU_MS, GPU_MS,
                   "x global", PRODUCTS, "window's share of pairs", "error"]
        cuda_rows = [{column: row.get(column, "") for column in columns} for row in cuda_rows]
        path = write_results("local_attention_flex", cuda_rows, columns,
                             "The forms of a local layer at 128 sequences a micro-batch, and a global layer",
                             f"Median of {args.repeats} after 2 warm-ups (wall time); forward under no_grad; forward "
                             "+ backward: the attention's output against a fixed gradient, the gradients of q, k and v "
                             "returned (no loss, no accumulation into .grad); GPU ms: the profiler's kernel time of "
                             f"each, the mean of {args.repeats}; x global: GPU ms against the global layer's on the "
                             "same stream (target: at most 0.6); tiles' products x global: fastmae's kernels' "
                             "tensor-core products, every lane of every tile they visit, against a global layer's "
                             f"{GLOBAL_PRODUCTS} a pair (forward and backward): x global where each product ran at "
                             "the global layer's speed.")
        print(f"wrote {path}")
        return
    rows = []
    for name, lengths, spread in shapes:
        for dtype in dtypes:
            (q, k, v), meta, share = make_stream(lengths, spread, dtype, device)
            local = resolve_backend(None, torch.device(device), 0.0, dtype, biased=True, window=True)
            forms = {  # column -> (backend, bias)
                "global": (None, None),
                "local": (local, StreamBias.build(table, meta, meta, local, dtype, window=HALF_WINDOW)),
                "window as a dense mask": ("padded", StreamBias.build(table, meta, meta, "padded", dtype)),
            }
            row = {"shape": name, "tokens": sum(lengths), "dtype": str(dtype).replace("torch.", ""),
                   "local backend": local + (" (bands)" if forms["local"][1].band is not None else "")}
            grads = {}
            for column, (backend, bias) in forms.items():
                def step(backend=backend, bias=bias):
                    return forward_backward(lambda: varlen_attention(q, k, v, meta, backend=backend, bias=bias),
                                            (q, k, v), grads)
                row[f"{column} ms"] = 1e3 * median_time(step, warmup=1, repeats=args.repeats)
            row["window's share of pairs"] = share
            row[f"CUDA's kernel: {PRODUCTS}"] = products_share(meta.positions.cpu().split(lengths), HALF_WINDOW,
                                                                 local_window.tiles(HEAD_DIM))
            row["local / global"] = row["local ms"] / row["global ms"]
            row["target: share x 1.2"] = share * TARGET_MARGIN
            row["met"] = "yes" if row["local / global"] <= row["target: share x 1.2"] else "no"
            rows.append(row)
            print(row, flush=True)
    notes = (f"Median of {args.repeats} after 1 warm-up, each form in turn on the same tensors. A local layer sees the "
             f"keys within {HALF_WINDOW} original positions of each query; the target is the window's share of a "
             f"global layer's pairs x {TARGET_MARGIN}. CUDA's kernel: {PRODUCTS}: the tensor-core products of "
             "fastmae's local-window kernels (triton_window, CUDA's choice; shipped tiles), every lane of every tile "
             f"they visit, against a global layer's {GLOBAL_PRODUCTS} a pair, forward and backward (counted, not "
             "timed): what a local layer would cost against a global one on CUDA if each product ran at the global "
             "layer's speed.")
    path = write_results("local_attention", rows, list(rows[0]),
                         f"A local attention layer against a global one on {device}: forward + backward", notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
