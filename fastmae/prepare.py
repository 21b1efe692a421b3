"""`fastmae prepare`: text -> tokenizer (sentencepiece, trained here, or any Hugging Face tokenizer directory) ->
memory-mapped token shards with a validation split.

    fastmae prepare --format builtin --output data/builtin --vocab-size 8000
    fastmae prepare --input corpus/*.jsonl --format jsonl --field text --output data/web --vocab-size 50000
    fastmae prepare --input dumps/ --glob '*.jsonl.zst' --format jsonl --output data/web --tokenizer tok.model
    fastmae prepare --input notes/ --format text --output data/notes --tokenizer path/to/roberta-base

Re-running with the same inputs skips finished shards that verify (size, document index, sha256) and rebuilds the
others. Every file is written atomically; a failure exits non-zero
with a one-line error naming the file and the problem, and leaves no half-written output.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from .atomic import atomic_write_text
from .config import add_arguments, from_arguments, option
from .data.readers import FORMATS, ReadStats, expand_inputs, read_documents
from .data.shards import FORMAT_VERSION, SPLITS, finished_shard_problem, read_shard_meta, token_dtype, write_shard
from .data.tokenizer import (
    SentencePieceTokenizer,
    Tokenizer,
    has_tokenizer,
    load_tokenizer,
    tokenizer_from_files,
    train_sentencepiece,
)
from .errors import FastmaeError, run_command
from .kernels.hashing import hash32_int


def is_validation(doc_index: int, fraction: float, seed: int) -> bool:
    """Whether document `doc_index` is held out: a seeded hash, stable however the corpus is sharded."""
    return hash32_int(hash32_int(seed) ^ doc_index) < fraction * 2**32


_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(files: dict[str, bytes], source: str) -> None:
    global _WORKER_TOKENIZER
    # the pool's processes are the parallelism: a Hugging Face tokenizer's own threads would oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = tokenizer_from_files(files, source)


def _tokenize_shard(job) -> tuple[int, dict, int]:
    """Worker: tokenise one chunk of documents and write its train and valid shards."""
    index, first_doc, texts, output, valid_fraction, seed = job
    tokenizer = _WORKER_TOKENIZER
    ids = tokenizer.encode(texts)
    dtype = token_dtype(tokenizer.vocab_size)
    held_out = [is_validation(first_doc + i, valid_fraction, seed) for i in range(len(texts))]
    name = f"shard_{index:05d}"
    metas = {}
    for split in SPLITS:
        docs = [d for d, valid in zip(ids, held_out) if valid == (split == "valid")]
        metas[split] = write_shard(Path(output), split, name, docs, dtype, tokenizer.sha256)
    return index, metas, sum(len(t.encode("utf-8")) for t in texts)


def _chunks(documents: Iterator[str], size: int) -> Iterator[tuple[int, int, list[str]]]:
    first = 0
    for index in itertools.count():
        texts = list(itertools.islice(documents, size))
        if not texts:
            return
        yield index, first, texts
        first += len(texts)


@dataclass(frozen=True)
class PrepareOptions:
    """How `fastmae prepare` reads, tokenises and shards a corpus (`prepare`'s keyword options)."""

    fmt: str = option("text", "text, jsonl, parquet, hf (save_to_disk) or builtin (the embedded Python docs corpus)",
                      choices=FORMATS, flag="format")
    text_field: str = option("text", "JSONL field / Parquet or dataset column holding the text", flag="field")
    text_mode: str = option("line", "text format: one document per line, or per blank-line separated paragraph",
                            choices=("line", "paragraph"))
    glob: str = option("*", "which files of an input directory to read, at any depth (e.g. '*.jsonl.zst')")
    vocab_size: int = option(32000, "pieces of a newly trained tokenizer")
    tokenizer_path: str = option("", "use this tokenizer instead of training one: a sentencepiece model, or a Hugging "
                                 "Face tokenizer directory (tokenizer.json + tokenizer_config.json)", flag="tokenizer")
    model_type: str = option("unigram", "sentencepiece model of a newly trained tokenizer", choices=("unigram", "bpe"))
    character_coverage: float = option(0.9995, "sentencepiece character coverage")
    input_sentence_size: int = option(2_000_000, "lines sampled for tokenizer training (large corpora)")
    valid_fraction: float = option(0.01, "share of documents held out")
    docs_per_shard: int = option(20000, "documents per shard")
    workers: int = option(0, "tokenising processes and tokenizer-training threads (0: all cores)")
    on_decode_error: str = option("fail", "undecodable UTF-8: stop with an error, or skip the document and count it",
                                  choices=("fail", "skip"))
    seed: int = option(0, "seed of the validation split")


def prepare(inputs: list[Path], output: Path, progress: bool = True, **options) -> dict:
    """Run the whole preparation with `options` (PrepareOptions' fields); return the dataset metadata (also written
    to OUTPUT/meta.json). Directories among `inputs` stand for their files matching `glob` at any depth."""
    o = PrepareOptions(**options)
    if not 0.0 <= o.valid_fraction < 1.0:
        raise FastmaeError(f"--valid-fraction {o.valid_fraction}: must be in [0, 1)")
    if o.docs_per_shard <= 0:
        raise FastmaeError(f"--docs-per-shard {o.docs_per_shard}: must be positive")
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise FastmaeError(f"--output {output}: exists and is not a directory")
    if o.fmt != "builtin":
        inputs = expand_inputs([Path(p) for p in inputs], o.glob, o.fmt)
    output.mkdir(parents=True, exist_ok=True)
    workers = max(1, o.workers or os.cpu_count() or 1)
    read = lambda stats=None: read_documents(inputs, o.fmt, o.text_field, o.text_mode, o.on_decode_error, stats)  # noqa

    saved = has_tokenizer(output)
    if o.tokenizer_path:
        tokenizer = load_tokenizer(o.tokenizer_path)
    elif saved:
        tokenizer = load_tokenizer(output)  # a re-run: keep the tokenizer the finished shards were made with
    else:
        first = next(iter(read()), None)
        if first is None:
            raise FastmaeError(f"no documents in {[str(p) for p in inputs] or o.fmt}: nothing to prepare")
        started = time.perf_counter()
        tokenizer = SentencePieceTokenizer(train_sentencepiece(read(), o.vocab_size, o.model_type,
                                                               o.character_coverage, o.input_sentence_size, o.seed,
                                                               workers),
                                           "trained tokenizer")
        if progress:
            print(f"trained a {o.model_type} tokenizer of {tokenizer.vocab_size} pieces in "
                  f"{time.perf_counter() - started:.1f}s", file=sys.stderr)
    if o.tokenizer_path or not saved:
        tokenizer.save(output)

    stats = ReadStats()
    shard_metas: dict[int, dict] = {}
    tokenised = {"shards": 0, "bytes": 0}
    bar = tqdm(unit="doc", desc="tokenising", disable=not progress)
    started = time.perf_counter()

    def finish(index: int, metas: dict, nbytes: int) -> None:
        shard_metas[index] = metas
        tokenised["shards"] += 1
        tokenised["bytes"] += nbytes
        bar.update(metas["train"]["documents"] + metas["valid"]["documents"])

    context = multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer.files, tokenizer.source)) as pool:
        in_flight: collections.deque = collections.deque()  # at most 2 chunks per worker held in memory
        for index, first_doc, texts in _chunks(read(stats), o.docs_per_shard):
            name = f"shard_{index:05d}"
            problems = {split: finished_shard_problem(output, split, name, tokenizer.sha256) for split in SPLITS}
            if not any(problems.values()):  # finished by an earlier run, and intact
                shard_metas[index] = {split: read_shard_meta(output, split, name) for split in SPLITS}
                bar.update(len(texts))
                continue
            damaged = [problem for problem in problems.values() if problem and problem != "not finished"]
            if damaged and progress:
                tqdm.write(f"fastmae prepare: rebuilding {name}: {damaged[0]}", file=sys.stderr)
            job = (index, first_doc, texts, str(output), o.valid_fraction, o.seed)
            in_flight.append(pool.apply_async(_tokenize_shard, (job,)))
            if len(in_flight) >= 2 * workers:
                finish(*in_flight.popleft().get())
        while in_flight:
            finish(*in_flight.popleft().get())
    bar.close()
    seconds = time.perf_counter() - started
    if not shard_metas:
        raise FastmaeError(f"no documents in {[str(p) for p in inputs] or o.fmt}: nothing to prepare")
    names = [f"shard_{i:05d}" for i in sorted(shard_metas)]
    splits = {split: {"shards": names,
                      "tokens": sum(shard_metas[i][split]["tokens"] for i in shard_metas),
                      "documents": sum(shard_metas[i][split]["documents"] for i in shard_metas)}
              for split in SPLITS}
    if splits["train"]["tokens"] == 0:
        raise FastmaeError(f"{output}: the training split is empty (all documents held out or empty)")
    meta = {"format_version": FORMAT_VERSION, "tokenizer_sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size, "special_tokens": tokenizer.special.as_dict(),
            "dtype": token_dtype(tokenizer.vocab_size).name, "splits": splits,
            "inputs": [str(p) for p in inputs] if o.fmt != "builtin" else ["builtin"], "format": o.fmt,
            "valid_fraction": o.valid_fraction, "seed": o.seed,
            "skipped": {"undecodable": stats.undecodable, "empty": stats.empty}}
    atomic_write_text(output / "meta.json", json.dumps(meta, indent=1) + "\n")
    if progress:
        work = (f"tokenised {tokenised['shards']} shard(s) at {tokenised['bytes'] / 2**20 / seconds:.2f} MB/s"
                if tokenised["shards"] else "all shards were already finished")
        print(f"{output}: {splits['train']['tokens']:,} train / {splits['valid']['tokens']:,} valid tokens in "
              f"{len(names)} shard(s); {work}; skipped {stats.undecodable} undecodable, {stats.empty} empty "
              "document(s)", file=sys.stderr)
    return meta


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, nargs="*", default=[],
                        help="input files or directories (.gz, .bz2 and .zst text/JSONL read as a stream)")
    parser.add_argument("--output", type=Path, required=True, help="dataset directory to write")
    add_arguments(parser, PrepareOptions)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = dataclasses.asdict(from_arguments(PrepareOptions, args))
    return run_command("fastmae prepare", prepare, args.input, args.output, True, **options)


if __name__ == "__main__":
    sys.exit(main())
