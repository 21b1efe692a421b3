"""Document readers: plain text, JSONL, Parquet, Hugging Face datasets saved to disk; the embedded corpus."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FastmaeError
from .builtin import builtin_documents

FORMATS = ("text", "jsonl", "parquet", "hf", "builtin")


@dataclass
class ReadStats:
    """What a read skipped, for the end-of-run report."""

    undecodable: int = 0
    empty: int = 0
    sources: list[str] = field(default_factory=list)


def _decode(raw: bytes, where: str, on_decode_error: str, stats: ReadStats) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if on_decode_error == "fail":
            raise FastmaeError(f"{where}: undecodable bytes ({err.reason} at byte {err.start}); "
                               f"use --on-decode-error skip to drop such documents") from None
        stats.undecodable += 1
        return None


def _text_documents(path: Path, text_mode: str, on_decode_error: str, stats: ReadStats) -> Iterator[str]:
    """One document per line (`line`) or per blank-line separated block (`paragraph`)."""
    block: list[str] = []
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            line = _decode(raw, f"{path}:{number}", on_decode_error, stats)
            if line is None:
                continue
            line = line.rstrip("\r\n")
            if text_mode == "line":
                if line.strip():
                    yield line
                continue
            if line.strip():
                block.append(line)
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def _jsonl_documents(path: Path, text_field: str, on_decode_error: str, stats: ReadStats) -> Iterator[str]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            line = _decode(raw, f"{path}:{number}", on_decode_error, stats)
            if line is None or not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise FastmaeError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise FastmaeError(f"{path}:{number}: no field {text_field!r} (use --field to name the text field)")
            if not isinstance(record[text_field], str):
                raise FastmaeError(f"{path}:{number}: field {text_field!r} is not a string")
            yield record[text_field]


def _parquet_documents(path: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise FastmaeError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several types for a bad file
        raise FastmaeError(f"{path}: not a readable Parquet file ({err})") from None
    if column not in parquet.schema_arrow.names:
        raise FastmaeError(f"{path}: no column {column!r} (columns: {parquet.schema_arrow.names})")
    for batch in parquet.iter_batches(columns=[column]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def _hf_documents(path: Path, column: str) -> Iterator[str]:
    try:
        from datasets import load_from_disk
    except ImportError:
        raise FastmaeError(f"{path}: reading a saved Hugging Face dataset needs `datasets` (pip install datasets)") \
            from None
    try:
        dataset = load_from_disk(str(path))
    except Exception as err:
        raise FastmaeError(f"{path}: not a dataset saved with save_to_disk ({err})") from None
    if hasattr(dataset, "keys"):  # a DatasetDict: take the train split
        if "train" not in dataset:
            raise FastmaeError(f"{path}: a DatasetDict without a 'train' split (splits: {list(dataset)})")
        dataset = dataset["train"]
    if column not in dataset.column_names:
        raise FastmaeError(f"{path}: no column {column!r} (columns: {dataset.column_names})")
    yield from (text for text in dataset[column] if text is not None)


def read_documents(inputs: list[Path], fmt: str, text_field: str = "text", text_mode: str = "line",
                   on_decode_error: str = "fail", stats: ReadStats | None = None) -> Iterator[str]:
    """Every non-empty document of `inputs`, in order. Errors name the file (and line) and the problem."""
    stats = stats if stats is not None else ReadStats()
    if fmt not in FORMATS:
        raise FastmaeError(f"--format {fmt!r}: choose one of {FORMATS}")
    if fmt == "builtin":
        for source, text in builtin_documents():
            stats.sources.append(source)
            yield text
        return
    if not inputs:
        raise FastmaeError("no --input given")
    for path in inputs:
        if not path.exists():
            raise FastmaeError(f"{path}: no such file or directory")
        stats.sources.append(str(path))
        if fmt == "text":
            docs = _text_documents(path, text_mode, on_decode_error, stats)
        elif fmt == "jsonl":
            docs = _jsonl_documents(path, text_field, on_decode_error, stats)
        elif fmt == "parquet":
            docs = _parquet_documents(path, text_field)
        else:
            docs = _hf_documents(path, text_field)
        for text in docs:
            if text.strip():
                yield text
            else:
                stats.empty += 1
