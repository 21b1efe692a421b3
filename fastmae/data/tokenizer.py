"""The sentencepiece tokenizer with fastmae's fixed special ids (pad 0, <s> 1, </s> 2, <unk> 3, <mask> 4)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from ..config import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID
from ..errors import FastmaeError

TOKENIZER_FILE = "tokenizer.model"  # its name in a dataset, run and export directory


def _lines(documents: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Non-empty lines of the documents, each cut to `max_bytes` (sentencepiece skips longer ones)."""
    for doc in documents:
        for line in doc.splitlines():
            line = line.strip()
            if line:
                yield line.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def train_sentencepiece(documents: Iterable[str], vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 0.9995, input_sentence_size: int = 2_000_000,
                        seed: int = 0) -> bytes:
    """Train a sentencepiece model on the lines of `documents`; return the serialised model.

    input_sentence_size caps the lines sentencepiece samples (uniformly, with `seed`) from a large corpus.
    """
    if model_type not in ("unigram", "bpe"):
        raise FastmaeError(f"--model-type {model_type!r}: choose 'unigram' or 'bpe'")
    model = io.BytesIO()
    max_bytes = 4096
    reader_errors: list[FastmaeError] = []

    def guarded(docs):  # sentencepiece would swallow a reader's error into its own; keep ours
        try:
            yield from docs
        except FastmaeError as err:
            reader_errors.append(err)

    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(guarded(documents), max_bytes), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage, input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True, max_sentence_length=max_bytes, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            unk_id=UNK_ID, user_defined_symbols=["<mask>"], hard_vocab_limit=True, minloglevel=2, num_threads=1,
        )
    except RuntimeError as err:
        if reader_errors:
            raise reader_errors[0] from None
        raise FastmaeError(f"sentencepiece training failed: {str(err).strip().splitlines()[-1]}") from None
    if reader_errors:
        raise reader_errors[0]
    return model.getvalue()


class Tokenizer:
    """A sentencepiece model checked for fastmae's special ids, with the sha256 of its bytes."""

    def __init__(self, model_bytes: bytes, source: str = "<memory>"):
        self.source = source
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self.model_bytes = model_bytes
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError as err:
            raise FastmaeError(f"{source}: not a sentencepiece model ({err})") from None
        expected = {"pad": (self.sp.pad_id(), PAD_ID), "<s>": (self.sp.bos_id(), BOS_ID),
                    "</s>": (self.sp.eos_id(), EOS_ID), "<unk>": (self.sp.unk_id(), UNK_ID),
                    "<mask>": (self.sp.piece_to_id("<mask>"), MASK_ID)}
        wrong = {name: got for name, (got, want) in expected.items() if got != want}
        if wrong:
            raise FastmaeError(f"{source}: special token ids {wrong} differ from fastmae's fixed ids "
                               "(pad 0, <s> 1, </s> 2, <unk> 3, <mask> 4)")

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FastmaeError(f"{path}: tokenizer model not found")
        return cls(path.read_bytes(), str(path))

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without specials."""
        return self.sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)
