"""Document readers: plain text, JSONL, Parquet, Hugging Face datasets saved to disk; the embedded corpus.

Text and JSONL files may be compressed (`.gz`, `.bz2`, `.zst`/`.zstd`, by suffix): they are decompressed as a stream,
never whole. Directories given as inputs stand for their files at any depth that match a glob (`expand_inputs`).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import zstandard

from ..errors import FastmaeError
from .builtin import builtin_documents

FORMATS = ("text", "jsonl", "parquet", "hf", "builtin")
COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".zst": "zstd", ".zstd": "zstd"}


def expand_inputs(inputs: list[Path], pattern: str = "*", fmt: str = "text") -> list[Path]:
    """The files to read: a file as given; a directory (but a saved Hugging Face dataset, `hf`) as its files at any
    depth whose names match `pattern`, sorted, hidden ones (a part starting with '.') left out."""
    files = []
    for path in inputs:
        if not path.exists():
            raise FastmaeError(f"{path}: no such file or directory")
        if not path.is_dir() or fmt == "hf":
            files.append(path)
            continue
        found = sorted(p for p in path.rglob(pattern)
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
        if not found:
            raise FastmaeError(f"{path}: a directory with no file matching --glob {pattern!r}")
        files += found
    return files


class _ZstdStream(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame; a file that ends inside a frame is an error (zstandard's
    own stream reader would stop there silently)."""

    def __init__(self, path: Path):
        self._file = path.open("rb")
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        self._pending, self._offset = b"", 0

    def readable(self) -> bool:
        return True

    def _refill(self) -> bool:
        """Decompress more input into `_pending`; False at the end of the file."""
        while self._offset >= len(self._pending):
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame")
                return False
            out = []
            while chunk:
                out.append(self._frame.decompress(chunk))
                self._in_frame = not self._frame.eof
                chunk = b""
                if self._frame.eof:  # the next frame starts in what is left over
                    chunk = self._frame.unused_data
                    self._frame = self._decompressor.decompressobj()
            self._pending, self._offset = b"".join(out), 0
        return True

    def readinto(self, buffer) -> int:
        if not self._refill():
            return 0
        count = min(len(buffer), len(self._pending) - self._offset)
        buffer[:count] = self._pending[self._offset:self._offset + count]
        self._offset += count
        return count

    def close(self) -> None:
        self._file.close()
        super().close()


@contextlib.contextmanager
def open_input(path: Path) -> Iterator[BinaryIO]:
    """`path` opened for reading bytes, decompressed by its suffix; a corrupt or truncated archive raises a
    FastmaeError naming the file."""
    kind = COMPRESSIONS.get(path.suffix.lower())
    if kind == "gzip":
        handle = gzip.open(path, "rb")
    elif kind == "bzip2":
        handle = bz2.open(path, "rb")
    elif kind == "zstd":
        handle = io.BufferedReader(_ZstdStream(path))
    else:
        handle = path.open("rb")
    try:
        yield handle
    except (EOFError, OSError, zstandard.ZstdError) as err:
        raise FastmaeError(f"{path}: corrupt or truncated {kind or 'file'} ({err})") from None
    finally:
        handle.close()


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
    with open_input(path) as handle:
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
    with open_input(path) as handle:
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
    """Every non-empty document of `inputs` (files; see `expand_inputs`), in order. Errors name the file (and line)
    and the problem."""
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
