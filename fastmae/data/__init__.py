"""Data pipeline (ARCHITECTURE.md section 6): readers, sentencepiece tokenizer, memory-mapped shards, packed loader."""

from .loader import PackedLoader
from .shards import ShardSet
from .tokenizer import Tokenizer

__all__ = ["PackedLoader", "ShardSet", "Tokenizer"]
