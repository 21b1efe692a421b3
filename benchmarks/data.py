"""Data pipeline speed: `fastmae prepare` throughput (MB/s of text) and loader throughput (tokens/s), against the
tokens/s a CPU training step of a small model consumes, measured in the same run; and epoch planning at corpus scale
(a synthetic index of 100 M sequences, RoBERTa's ~40 B tokens with room to spare): time and peak memory of one rank.

    python benchmarks/data.py                  # writes benchmarks/results/data.{json,md} and data_scale.{json,md}
    python benchmarks/data.py --only-scale     # just the planning at scale
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import write_results

from fastmae import MaskedLM, ModelConfig
from fastmae.data import PackedLoader
from fastmae.data.builtin import builtin_documents
from fastmae.data.order import StepPlanner
from fastmae.data.sequences import SequenceIndex
from fastmae.prepare import prepare


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--only-scale", action="store_true", help="only plan epochs at corpus scale")
    parser.add_argument("--sequences", type=int, default=100_000_000, help="sequences of the synthetic index")
    args = parser.parse_args()
    scale(args.sequences)
    if args.only_scale:
        return
    text_mb = sum(len(text.encode("utf-8")) for _, text in builtin_documents()) / 2**20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ds"
        start = time.perf_counter()
        prepare([], out, fmt="builtin", vocab_size=args.vocab_size, progress=False)
        prepare_s = time.perf_counter() - start
        rows.append({"stage": "prepare (train tokenizer + tokenise + write)", "rate": text_mb / prepare_s,
                     "unit": "MB/s of text", "detail": f"{text_mb:.2f} MB in {prepare_s:.1f} s"})
        # tokenising alone, from a plain JSONL file (the builtin reader parses stdlib sources, which is slow)
        corpus = Path(tmp) / "corpus.jsonl"
        with corpus.open("w") as handle:
            for _ in range(5):
                handle.writelines(json.dumps({"text": text}) + "\n" for _, text in builtin_documents())
        corpus_mb = corpus.stat().st_size / 2**20
        start = time.perf_counter()
        prepare([corpus], Path(tmp) / "again", fmt="jsonl", tokenizer_path=out / "tokenizer.model", progress=False)
        tokenise_s = time.perf_counter() - start
        rows.append({"stage": "prepare JSONL with a given tokenizer (read + tokenise + write)",
                     "rate": corpus_mb / tokenise_s, "unit": "MB/s of text",
                     "detail": f"{corpus_mb:.2f} MB in {tokenise_s:.1f} s, {os.cpu_count()} workers"})
        for packing in ("full", "doc"):
            loader = PackedLoader(out, max_seq_len=args.max_seq_len, packing=packing,
                                  tokens_per_batch=args.tokens_per_batch)
            it = iter(loader)
            tokens, start = 0, time.perf_counter()
            for _ in range(300):
                tokens += next(it).num_tokens
            rate = tokens / (time.perf_counter() - start)
            rows.append({"stage": f"loader ({packing} packing)", "rate": rate, "unit": "tokens/s",
                         "detail": f"{tokens} tokens"})
        # what the model eats: a small encoder's training step on CPU, same batches
        torch.manual_seed(0)
        config = ModelConfig.preset("3ml", vocab_size=args.vocab_size, hidden_size=256, num_heads=4,
                                    encoder_layers=4, max_seq_len=args.max_seq_len)
        model = MaskedLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        it = iter(PackedLoader(out, max_seq_len=args.max_seq_len, tokens_per_batch=args.tokens_per_batch))
        tokens, start = 0, None
        for step in range(6):
            if step == 1:
                start = time.perf_counter()  # the first step warms up
                tokens = 0
            batch = next(it)
            model(batch, seed=0, step=step).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tokens += batch.num_tokens
        model_rate = tokens / (time.perf_counter() - start)
        rows.append({"stage": "model step (3ml, 4 x 256, CPU)", "rate": model_rate, "unit": "tokens/s",
                     "detail": "forward + backward + AdamW"})
    for row in rows[2:4]:
        row["x model"] = row["rate"] / model_rate
    for row in rows:
        row.setdefault("x model", "")
    note = ("The loader must deliver at least 10x the tokens/s the model consumes; `x model` is that ratio. "
            "Corpus: the embedded Python documentation (builtin).")
    path = write_results("data", rows, ["stage", "rate", "unit", "x model", "detail"], "Data pipeline throughput",
                         note)
    print(path.read_text())


SCALE_SHARDS = 1000
SCALE_MAX_SEQ_LEN = 512
SCALE_MICRO_BATCH = 16 * 512  # tokens per micro-batch
SCALE_STEP = 512  # micro-batches per step: RoBERTa's 8K sequences of 512 (64 GPUs x grad_accum 8)
SCALE_STEPS_TIMED = 200


def synthetic_documents(sequences: int, packing: str, seed: int = 0):
    """Per shard, document lengths (log-normal, ~665 tokens mean, 1 to 20,000) making about `sequences` sequences of
    SCALE_MAX_SEQ_LEN under `packing`. Generated shard by shard: nothing of the corpus but the index is held."""
    rng = np.random.default_rng(seed)
    body = SCALE_MAX_SEQ_LEN - 2
    mean = np.exp(6.5)  # of log-normal(mu=6, sigma=1); the clipping hardly moves it
    per_document = (mean + 1) / body if packing == "full" else 1.75  # sequences a document makes, on average
    documents = int(sequences / per_document / SCALE_SHARDS)
    for _ in range(SCALE_SHARDS):
        yield np.clip(rng.lognormal(6.0, 1.0, documents), 1, 20_000).astype(np.int64)


def _plan_at_scale(sequences: int, packing: str, queue) -> None:
    """In a fresh process (its peak memory is the rank's): build the index, then plan steps as a rank does."""
    start = time.perf_counter()
    index = SequenceIndex(synthetic_documents(sequences, packing), SCALE_MAX_SEQ_LEN, packing)
    build_s = time.perf_counter() - start
    planner = StepPlanner(index.lengths, seed=0, tokens_per_batch=SCALE_MICRO_BATCH,
                          micro_batches_per_step=SCALE_STEP)
    n = len(index)
    start = time.perf_counter()
    bounds = planner.plan_step(0, 0)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    position = n // 2
    bounds = planner.plan_step(3, position)  # a resume: epoch 3, half-way through
    ids = planner.order(3)[np.arange(bounds[0], bounds[-1])]
    index.stream_spans(ids)  # where the step's sequences are (what reading them starts with)
    resume_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(SCALE_STEPS_TIMED):
        bounds = planner.plan_step(0, position)
        position = int(bounds[-1])
    per_step_s = (time.perf_counter() - start) / SCALE_STEPS_TIMED
    start = time.perf_counter()
    steps = planner.steps_per_epoch(1)
    epoch_s = time.perf_counter() - start
    index_bytes = index.lengths.nbytes + index.coarse.nbytes + index.shard_starts.nbytes
    queue.put({"packing": packing, "sequences": n, "tokens": int(index.lengths.sum(dtype=np.int64)),
               "build_s": build_s, "first_step_s": first_s, "resume_s": resume_s, "per_step_ms": per_step_s * 1e3,
               "epoch_s": epoch_s, "steps_per_epoch": steps, "index_mb": index_bytes / 2**20,
               "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})


def scale(sequences: int) -> None:
    """Plan epochs over synthetic indexes of `sequences` sequences, `full` and `doc` packed, each in its own process;
    write benchmarks/results/data_scale.{json,md}."""
    context = multiprocessing.get_context("spawn")
    rows = []
    for packing in ("full", "doc"):
        queue = context.Queue()
        child = context.Process(target=_plan_at_scale, args=(sequences, packing, queue))
        child.start()
        rows.append(queue.get())
        child.join()
        print(rows[-1], flush=True)
    note = (f"One rank's work on a synthetic index ({SCALE_SHARDS} shards, log-normal documents, max_seq_len "
            f"{SCALE_MAX_SEQ_LEN}); steps of {SCALE_STEP} micro-batches of {SCALE_MICRO_BATCH} tokens (RoBERTa's 8K "
            "sequences). `first step`: planning an epoch's first step (all that starting an epoch costs; the order is "
            "never materialised). `resume`: the step at the middle of epoch 3 and where its sequences lie. "
            "`per step`: planning one more step, as training does. `whole epoch`: planning every step of an epoch in "
            "a row (a loop over micro-batches; training spreads it over the epoch). `peak RSS`: the process's peak, "
            "Python and numpy included.")
    columns = ["packing", "sequences", "tokens", "build_s", "first_step_s", "resume_s", "per_step_ms", "epoch_s",
               "steps_per_epoch", "index_mb", "peak_rss_mb"]
    path = write_results("data_scale", rows, columns, "Epoch planning at corpus scale", note)
    print(path.read_text())


if __name__ == "__main__":
    main()
