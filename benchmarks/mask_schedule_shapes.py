"""How many shapes CUDA graphs record over a run whose masking rate moves (model.mask_rate_end; fastmae/schedule.py):
the run's micro-batches masked at their steps' rates on the host, padded to their rate's ladder under `doc` packing,
and their signatures fed to the graphs' recording policy (`graphs.RecordingPolicy`) as the training loop feeds it.
The CPU twin of the GPU path, host work only: no model runs.

    python benchmarks/mask_schedule_shapes.py             # the embedded corpus; writes results/mask_schedule_shapes.*
    python benchmarks/mask_schedule_shapes.py --data DIR  # a prepared dataset
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import dataset_or_builtin, write_results

from fastmae import ModelConfig
from fastmae.data import PackedLoader
from fastmae.graphs import STALE_FORWARDS, RecordingPolicy, signature
from fastmae.masking import mask_batch
from fastmae.padding import ShapeLadder
from fastmae.schedule import MaskRates

SCHEDULES = (("mlm", 0.3, 0.15), ("3ml", 0.5, 0.3), ("mlm", 0.15, 0.15))  # the last: a constant rate, for reference


def measure(directory: Path, objective: str, start: float, end: float, packing: str, steps: int,
            tokens_per_batch: int, max_seq_len: int) -> dict:
    """`steps` one-micro-batch steps of `directory`'s training split, masked by the schedule start -> end."""
    config = ModelConfig.preset(objective, max_seq_len=max_seq_len, mask_rate=start, mask_rate_end=end)
    rates = MaskRates.of(config, steps)
    loader = PackedLoader(directory, max_seq_len=max_seq_len, packing=packing, tokens_per_batch=tokens_per_batch)
    ladder = ShapeLadder(config, tokens_per_batch) if packing == "doc" else None
    policy, keys, actions = RecordingPolicy(max_recordings=1), set(), {"replay": 0, "record": 0, "eager": 0}
    batches = iter(loader)
    for step in range(steps):
        batch = next(batches)
        masked = mask_batch(batch, config, seed=0, step=batch.index, mask_rate=rates.rate(step), host=True)
        if ladder is not None:
            masked = ladder.at_rate(rates.rate(step)).pad(masked)
        key = signature(masked)
        keys.add(key)
        actions[policy.decide(key)[0]] += 1
    return {"objective": objective, "mask_rates": f"{start:g} -> {end:g}", "packing": packing, "steps": steps,
            "rates": len({rates.rate(s) for s in range(steps)}), "signatures": len(keys),
            "recorded": policy.recorded, "replayed_pct": round(100 * actions["replay"] / steps, 1),
            "eager_pct": round(100 * actions["eager"] / steps, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="a prepared dataset (default: the embedded corpus, prepared here)")
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=3000, help="one-micro-batch steps of the run")
    parser.add_argument("--setting", default="64:512", help="MAX_SEQ_LEN:TOKENS_PER_BATCH (the demo's)")
    args = parser.parse_args()
    length, tokens = (int(n) for n in args.setting.split(":"))
    with tempfile.TemporaryDirectory() as scratch:
        directory = dataset_or_builtin(args.data, scratch, args.vocab_size)
        rows = [measure(directory, objective, start, end, packing, args.steps, tokens, length)
                for objective, start, end in SCHEDULES for packing in ("full", "doc")]
    data = f"the embedded corpus (builtin, vocabulary {args.vocab_size})" if args.data is None else args.data
    notes = (f"Data: {data}; {args.steps} steps of one micro-batch of {tokens} tokens (max_seq_len {length}), the "
             "masking rate moving linearly in whole percents over them. signatures: the distinct shapes and host "
             "counts the model saw; recorded: the CUDA graphs the run records (one held at a time; a recording "
             f"unreplayed for {STALE_FORWARDS} forwards gives way to a signature seen twice, "
             "`graphs.RecordingPolicy`); "
             "replayed / eager: shares of the micro-batches. Under `full` packing, shard-end pieces of other lengths "
             "run eagerly at any rate; under `doc` packing each rate has its own ladder of padded shapes.")
    print(write_results("mask_schedule_shapes", rows, list(rows[0]), "CUDA-graph shapes under a masking-rate schedule",
                        notes).read_text())


if __name__ == "__main__":
    main()
