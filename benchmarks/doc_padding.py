"""What padding `doc` packing to fixed shapes costs (fastmae/padding.py): over one epoch of real documents, the shapes
the micro-batches take, the share of rows that are fillers, the dummy predicted rows, and the host time of padding
against that of masking (both on the masking thread, ahead of the step). Host work only: no model runs.

    python benchmarks/doc_padding.py                 # the embedded corpus; writes benchmarks/results/doc_padding.*
    python benchmarks/doc_padding.py --data DIR      # a prepared dataset
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import dataset_or_builtin, write_results

from fastmae import ModelConfig
from fastmae.data import PackedLoader
from fastmae.masking import mask_batch
from fastmae.padding import ShapeLadder, pad

OBJECTIVES = ("mlm", "mae-lm", "3ml")


def measure(directory: Path, objective: str, tokens_per_batch: int, max_seq_len: int) -> dict:
    """One epoch of `directory`'s training split under `doc` packing, masked for `objective` and padded."""
    config = ModelConfig.preset(objective, max_seq_len=max_seq_len)
    loader = PackedLoader(directory, max_seq_len=max_seq_len, packing="doc", tokens_per_batch=tokens_per_batch)
    ladder = ShapeLadder(config, tokens_per_batch)
    steps = loader.planner.steps_per_epoch(0)
    shapes, unpadded = Counter(), 0
    rows = own_rows = dummy = predicted = 0
    mask_s = pad_s = 0.0
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        start = time.perf_counter()
        masked = mask_batch(batch, config, seed=0, step=batch.index, host=True)
        middle = time.perf_counter()
        shape = ladder.shape_for(masked)
        padded = masked if shape is None else pad(masked, shape)
        pad_s, mask_s = pad_s + time.perf_counter() - middle, mask_s + middle - start
        unpadded += shape is None
        shapes[shape] += 1
        rows, own_rows = rows + padded.batch.num_tokens, own_rows + masked.batch.num_tokens
        predicted += masked.num_predicted
        dummy += 0 if padded.filler is None else padded.filler.predicted
    return {
        "objective": objective, "tokens_per_batch": tokens_per_batch, "max_seq_len": max_seq_len,
        "micro_batches": steps, "ladder_shapes": len(ladder.shapes), "shapes_used": len(shapes),
        "most_common_share": round(shapes.most_common(1)[0][1] / steps, 3), "unpadded": unpadded,
        "filler_rows_pct": round(100 * (rows - own_rows) / rows, 2),
        "dummy_predicted_pct": round(100 * dummy / (dummy + predicted), 2),
        "mask_ms": round(1e3 * mask_s / steps, 2), "pad_ms": round(1e3 * pad_s / steps, 2),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="a prepared dataset (default: the embedded corpus, prepared here)")
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--settings", nargs="+", default=["512:16384", "512:65536", "64:512"],
                        help="MAX_SEQ_LEN:TOKENS_PER_BATCH pairs (the recipes' and the demo's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        directory = dataset_or_builtin(args.data, scratch, args.vocab_size)
        settings = [tuple(int(n) for n in pair.split(":")) for pair in args.settings]
        rows = [measure(directory, objective, tokens, length)
                for length, tokens in settings for objective in OBJECTIVES]
    columns = list(rows[0])
    data = f"the embedded corpus (builtin, vocabulary {args.vocab_size})" if args.data is None else args.data
    notes = (f"Data: {data}, `doc` packing, one epoch. Padding runs where CUDA graphs replay (`train.cuda_graphs`); "
             "filler rows are computed but neither counted nor learned from; dummy predicted rows are ignored by "
             "the loss. mask_ms and pad_ms: host time per micro-batch on the masking thread.")
    print(write_results("doc_padding", rows, columns, "Padding doc packing to fixed shapes", notes).read_text())


if __name__ == "__main__":
    main()
