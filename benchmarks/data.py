"""Data pipeline speed: `fastmae prepare` throughput (MB/s of text) and loader throughput (tokens/s), against the
tokens/s a CPU training step of a small model consumes, measured in the same run.

    python benchmarks/data.py            # writes benchmarks/results/data.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import write_results

from fastmae import MaskedLM, ModelConfig
from fastmae.data import PackedLoader
from fastmae.data.builtin import builtin_documents
from fastmae.prepare import prepare


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-seq-len", type=int, default=128)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
