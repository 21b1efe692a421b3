"""Memory-mapped token shards with a document index, and the dataset directory's metadata.

    DIR/meta.json                  tokenizer sha256, vocab size, special token ids, dtype, per split: shard names,
                                   token/document counts
    DIR/tokenizer.model            the tokenizer: a sentencepiece model, or a Hugging Face tokenizer's files
                                   (tokenizer.json, tokenizer_config.json, special_tokens_map.json)
    DIR/SPLIT/NAME.tokens          uint16 (vocab < 65536) or uint32 token ids of all documents, concatenated
    DIR/SPLIT/NAME.docs.npy        int64 [documents + 1] offsets of the documents in NAME.tokens
    DIR/SPLIT/NAME.json            counts, dtype and sha256 of NAME.tokens; written last, so it marks a finished shard
Every file is written atomically (fastmae.atomic).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes, atomic_write_text
from ..config import SpecialTokens
from ..errors import FastmaeError

FORMAT_VERSION = 1
SPLITS = ("train", "valid")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def shard_files(directory: Path, split: str, name: str) -> tuple[Path, Path, Path]:
    base = Path(directory) / split / name
    return base.with_suffix(".tokens"), base.with_suffix(".docs.npy"), base.with_suffix(".json")


def write_shard(directory: Path, split: str, name: str, documents: list[list[int]], dtype: np.dtype,
                tokenizer_sha256: str) -> dict:
    """Write one shard of tokenised documents; return its metadata (also written, last, as NAME.json)."""
    tokens_path, docs_path, meta_path = shard_files(directory, split, name)
    lengths = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    offsets = np.zeros(len(documents) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((t for d in documents for t in d), dtype=dtype, count=int(offsets[-1]))
    data = flat.tobytes()
    atomic_write_bytes(tokens_path, data)
    buffer = io.BytesIO()
    np.save(buffer, offsets)
    atomic_write_bytes(docs_path, buffer.getvalue())
    meta = {"tokens": int(offsets[-1]), "documents": len(documents), "dtype": dtype.name,
            "sha256": hashlib.sha256(data).hexdigest(), "tokenizer_sha256": tokenizer_sha256,
            "max_id": int(flat.max()) if flat.size else -1}
    atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    return meta


def read_shard_meta(directory: Path, split: str, name: str) -> dict | None:
    """The metadata of a finished shard, or None if the shard was never finished."""
    meta_path = shard_files(directory, split, name)[2]
    if not meta_path.is_file():
        return None
    try:
        return json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FastmaeError(f"{meta_path}: corrupt shard metadata (not JSON)") from None


MAX_OPEN_SHARDS = 64
"""Token maps kept open at once: each holds a file descriptor, so a dataset of thousands of shards re-maps the
least recently used ones on demand instead of running out of descriptors (document offsets are read into memory)."""


@functools.lru_cache(maxsize=MAX_OPEN_SHARDS)
def _token_map(path: Path, dtype: str, count: int, version: tuple[int, int]) -> np.ndarray:
    """The map of one shard's tokens; `version` (inode, mtime) keeps a rewritten file from being served stale."""
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class Shard:
    """One shard: its tokens (memory-mapped on use) and document offsets [D + 1] (int64, in memory)."""

    path: Path
    dtype: str
    num_tokens: int
    offsets: np.ndarray
    version: tuple[int, int]  # (inode, mtime_ns) of the tokens file when it was checked

    @property
    def tokens(self) -> np.ndarray:
        """[num_tokens] uint16/uint32 ids, memory-mapped; at most MAX_OPEN_SHARDS maps stay open (LRU). Raises
        FastmaeError naming the file when it has vanished or changed since it was checked (`check_unchanged`)."""
        self.check_unchanged()
        return _token_map(self.path, self.dtype, self.num_tokens, self.version)

    def check_unchanged(self) -> None:
        """Raise FastmaeError naming the tokens file if it has gone, or been rewritten, truncated or replaced since
        `open_shard` checked it: a map still open would serve the old bytes or, past a truncation, kill the
        process with SIGBUS; a run stops instead, and resumes bit-identically once the file is restored."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            raise FastmaeError(f"{self.path}: vanished during the run; restore it and resume (the newest checkpoint "
                               "was written before it went)") from None
        expected = self.num_tokens * np.dtype(self.dtype).itemsize
        if (stat.st_ino, stat.st_mtime_ns) != self.version or stat.st_size != expected:
            raise FastmaeError(f"{self.path}: changed during the run ({stat.st_size} bytes, expected {expected}; "
                               "rewritten or replaced since start-up): corrupt or from another dataset; restore it "
                               "and resume, or re-run fastmae prepare and start afresh")

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def open_shard(directory: Path, split: str, name: str, verify_checksum: bool = False) -> Shard:
    """Check a shard against its metadata and read its document offsets (no file stays open); errors name the file
    and the problem."""
    tokens_path, docs_path, _ = shard_files(directory, split, name)
    meta = read_shard_meta(directory, split, name)
    if meta is None:
        raise FastmaeError(f"{tokens_path.with_suffix('.json')}: missing (the shard was never finished)")
    for path in (tokens_path, docs_path):
        if not path.is_file():
            raise FastmaeError(f"{path}: missing")
    dtype = np.dtype(meta["dtype"])
    expected = meta["tokens"] * dtype.itemsize
    stat = tokens_path.stat()
    actual = stat.st_size
    if actual != expected:
        raise FastmaeError(f"{tokens_path}: {actual} bytes, expected {expected} ({meta['tokens']} x {dtype.name}): "
                           "truncated or corrupt")
    try:
        offsets = np.load(docs_path)
    except (ValueError, OSError, EOFError) as err:
        raise FastmaeError(f"{docs_path}: corrupt document index ({err})") from None
    if (offsets.ndim != 1 or len(offsets) != meta["documents"] + 1 or offsets[0] != 0
            or offsets[-1] != meta["tokens"] or (len(offsets) > 1 and (np.diff(offsets) < 0).any())):
        raise FastmaeError(f"{docs_path}: document offsets do not match {meta['documents']} documents of "
                           f"{meta['tokens']} tokens")
    if verify_checksum and file_sha256(tokens_path) != meta["sha256"]:
        raise FastmaeError(f"{tokens_path}: sha256 differs from {tokens_path.with_suffix('.json').name}: corrupt")
    return Shard(tokens_path, dtype.name, int(meta["tokens"]), offsets, (stat.st_ino, stat.st_mtime_ns))


def finished_shard_problem(directory: Path, split: str, name: str, tokenizer_sha256: str) -> str | None:
    """Why the shard NAME of `split` cannot be kept as finished (missing, another tokenizer, wrong size, corrupt
    index, sha256 mismatch), or None when it is intact. Reads the whole tokens file (a streamed sha256)."""
    meta = read_shard_meta(directory, split, name)
    if meta is None:
        return "not finished"
    if meta.get("tokenizer_sha256") != tokenizer_sha256:
        return "tokenised with another tokenizer"
    try:
        open_shard(directory, split, name, verify_checksum=True)
    except FastmaeError as err:
        return str(err)
    return None


class ShardSet:
    """A prepared dataset directory: its metadata and the shards of one split."""

    def __init__(self, directory: str | Path, split: str = "train", verify_checksum: bool = False):
        self.directory = Path(directory)
        meta_path = self.directory / "meta.json"
        if not meta_path.is_file():
            raise FastmaeError(f"{meta_path}: missing; run `fastmae prepare --output {self.directory}` first")
        try:
            self.meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise FastmaeError(f"{meta_path}: corrupt (not JSON)") from None
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise FastmaeError(f"{meta_path}: format_version {self.meta.get('format_version')!r}, this fastmae "
                               f"reads {FORMAT_VERSION}")
        if split not in self.meta["splits"]:
            raise FastmaeError(f"{meta_path}: no split {split!r} (splits: {sorted(self.meta['splits'])})")
        self.split = split
        self.shards = [open_shard(self.directory, split, name, verify_checksum)
                       for name in self.meta["splits"][split]["shards"]]
        for shard, name in zip(self.shards, self.meta["splits"][split]["shards"]):
            meta = read_shard_meta(self.directory, split, name)
            if meta["tokenizer_sha256"] != self.tokenizer_sha256:
                raise FastmaeError(f"{shard.path}: tokenised with another tokenizer (sha256 "
                                   f"{meta['tokenizer_sha256'][:12]}..., dataset {self.tokenizer_sha256[:12]}...)")
            # the largest id, recorded by prepare (shards written before it recorded one: read when verifying)
            max_id = meta.get("max_id")
            if max_id is None and verify_checksum and shard.num_tokens:
                max_id = int(shard.tokens.max())
            if max_id is not None and max_id >= self.vocab_size:
                raise FastmaeError(f"{shard.path}: token id {max_id} is outside the vocabulary of {self.vocab_size} "
                                   f"(max_id in {shard_files(self.directory, split, name)[2].name}): corrupt or "
                                   "from another dataset")

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @functools.cached_property
    def special_tokens(self) -> SpecialTokens:
        """The special ids of the dataset's tokenizer (datasets from before they were recorded: fastmae's own)."""
        return SpecialTokens(**self.meta.get("special_tokens", {}))

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta["tokenizer_sha256"]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    def check_tokenizer(self, tokenizer_sha256: str, source: str) -> None:
        """Raise if the tokenizer at `source` is not the one these shards were made with."""
        if tokenizer_sha256 != self.tokenizer_sha256:
            raise FastmaeError(f"{source}: tokenizer sha256 {tokenizer_sha256[:12]}... does not match the shards in "
                               f"{self.directory} ({self.tokenizer_sha256[:12]}...)")

    def check_vocab(self, vocab_size: int, what: str = "model vocab_size") -> None:
        """Raise if a model of `vocab_size` cannot embed these shards' ids."""
        if vocab_size != self.vocab_size:
            raise FastmaeError(f"{what}={vocab_size} but {self.directory} was tokenised with vocab size "
                               f"{self.vocab_size}")
