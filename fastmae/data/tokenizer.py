"""Tokenizers, of two kinds, each carrying its special ids (`SpecialTokens`), the files it is saved as and the sha256
that ties a dataset, a run and an export to it (ARCHITECTURE.md section 6):

- a sentencepiece model fastmae trains (`tokenizer.model`; pad 0, `<s>` 1, `</s>` 2, `<unk>` 3, `<mask>` 4);
- any Hugging Face tokenizer directory (`tokenizer.json` with its `tokenizer_config.json` / `special_tokens_map.json`,
  as RoBERTa's byte-level BPE, BERT's WordPiece and ModernBERT ship them), read with the `tokenizers` library; its
  special tokens come from its own files: cls (else bos) starts a sequence, sep (else eos) ends it.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from ..config import SpecialTokens
from ..errors import FastmaeError

SENTENCEPIECE_FILE = "tokenizer.model"
HUGGING_FACE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""A Hugging Face tokenizer's files, as a dataset, run or export directory holds them (tokenizer.json required)."""
FASTMAE = SpecialTokens()


def _lines(documents: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Non-empty lines of the documents, each cut to `max_bytes` (sentencepiece skips longer ones)."""
    for doc in documents:
        for line in doc.splitlines():
            line = line.strip()
            if line:
                yield line.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


def train_sentencepiece(documents: Iterable[str], vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 0.9995, input_sentence_size: int = 2_000_000,
                        seed: int = 0, threads: int = 1) -> bytes:
    """Train a sentencepiece model on the lines of `documents` with `threads` threads; return the serialised model.

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
            shuffle_input_sentence=True, max_sentence_length=max_bytes, pad_id=FASTMAE.pad, bos_id=FASTMAE.bos,
            eos_id=FASTMAE.eos, unk_id=FASTMAE.unk, user_defined_symbols=["<mask>"], hard_vocab_limit=True,
            minloglevel=2, num_threads=threads,
        )
    except RuntimeError as err:
        if reader_errors:
            raise reader_errors[0] from None
        raise FastmaeError(f"sentencepiece training failed: {str(err).strip().splitlines()[-1]}") from None
    if reader_errors:
        raise reader_errors[0]
    return model.getvalue()


class Tokenizer:
    """What every tokenizer offers: `special` ids, `vocab_size`, `encode` / `decode`, the `files` it is saved as, and
    `sha256`, the digest of what decides its ids (`identity`). `frame` adds the specials the way fastmae's data and
    fine-tuning frame sequences."""

    pair_separators = 2
    """`eos` tokens between a pair's halves: 2 as RoBERTa (`<s> A </s></s> B </s>`), 1 as BERT."""
    vocab_size: int
    """Token ids, specials included (each kind sets it)."""

    def __init__(self, files: dict[str, bytes], source: str, special: SpecialTokens, identity: bytes):
        self.files, self.source, self.special = files, source, special
        self.sha256 = hashlib.sha256(identity).hexdigest()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without specials."""
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def frame(self, first: list[int], second: list[int] | None = None) -> list[int]:
        """`bos first eos`, or with `second` `bos first eos [eos] second eos` (`pair_separators`)."""
        framed = [self.special.bos, *first, self.special.eos]
        if second is not None:
            framed += [self.special.eos] * (self.pair_separators - 1) + [*second, self.special.eos]
        return framed

    def save(self, directory: Path) -> None:
        """Write the tokenizer's files into `directory`, each atomically, and remove another kind's files there (so
        `load_tokenizer` finds this one)."""
        from ..atomic import atomic_write_bytes

        for name in (SENTENCEPIECE_FILE, *HUGGING_FACE_FILES):
            if name not in self.files:
                (Path(directory) / name).unlink(missing_ok=True)
        for name, data in self.files.items():
            atomic_write_bytes(Path(directory) / name, data)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model checked for the special ids of the models fastmae trains."""

    def __init__(self, model_bytes: bytes, source: str = "<memory>"):
        super().__init__({SENTENCEPIECE_FILE: model_bytes}, source, FASTMAE, model_bytes)
        self.model_bytes = model_bytes
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except RuntimeError as err:
            raise FastmaeError(f"{source}: not a sentencepiece model ({err})") from None
        got = {"pad": self.sp.pad_id(), "bos": self.sp.bos_id(), "eos": self.sp.eos_id(), "unk": self.sp.unk_id(),
               "mask": self.sp.piece_to_id("<mask>")}
        wrong = {role: token_id for role, token_id in got.items() if token_id != FASTMAE.as_dict()[role]}
        if wrong:
            raise FastmaeError(f"{source}: special token ids {wrong} differ from those of the sentencepiece models "
                               f"fastmae trains ({FASTMAE.as_dict()}); use a Hugging Face tokenizer directory for "
                               "other special tokens")
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


# Each role's keys in tokenizer_config.json / special_tokens_map.json, in order of preference.
ROLE_KEYS = {"pad": ("pad_token",), "bos": ("cls_token", "bos_token"), "eos": ("sep_token", "eos_token"),
             "unk": ("unk_token",), "mask": ("mask_token",)}
# Where those files name no token for a role (roberta-base's and bert-base-uncased's hub configs name none): the
# role's conventional spellings among tokenizer.json's special added tokens, as transformers' tokenizer classes
# default them.
CONVENTIONAL = {"pad": ("<pad>", "[PAD]"), "bos": ("<s>", "[CLS]", "<cls>"), "eos": ("</s>", "[SEP]", "<eos>"),
                "unk": ("<unk>", "[UNK]"), "mask": ("<mask>", "[MASK]")}


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (tokenizer.json), its special tokens named by its tokenizer_config.json or
    special_tokens_map.json, else (`CONVENTIONAL`) by tokenizer.json's special tokens. Refused, naming what is
    missing: no tokenizer.json, a role neither names, a named token absent from the vocabulary, roles sharing an
    id."""

    def __init__(self, files: dict[str, bytes], source: str):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise FastmaeError(f"{source}: reading a Hugging Face tokenizer needs the `tokenizers` package: "
                               "pip install 'fastmae[hf]'") from None
        if "tokenizer.json" not in files:
            raise FastmaeError(f"{source}: no tokenizer.json (fastmae reads fast tokenizers: save one with "
                               "transformers.AutoTokenizer.from_pretrained(...).save_pretrained(DIR))")
        try:
            self.rust = RustTokenizer.from_str(files["tokenizer.json"].decode("utf-8"))
            named = {}
            for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config's names win
                named.update({k: v for k, v in (json.loads(files[name]) if name in files else {}).items() if v})
        except Exception as err:  # noqa: BLE001 (tokenizers raises plain Exception)
            raise FastmaeError(f"{source}: unreadable Hugging Face tokenizer ({type(err).__name__}: {err})") from None
        self.rust.no_truncation()
        self.rust.no_padding()
        ids = {}
        special = {token.content for token in self.rust.get_added_tokens_decoder().values() if token.special}
        for role, keys in ROLE_KEYS.items():
            key = next((k for k in keys if named.get(k)), None)
            if key is not None:
                token = named[key]["content"] if isinstance(named[key], dict) else named[key]
            else:
                token = next((t for t in CONVENTIONAL[role] if t in special), None)
                key = "special token"
            if token is None:
                raise FastmaeError(f"{source}: no {' or '.join(keys)} in tokenizer_config.json or "
                                   f"special_tokens_map.json, and none of {' '.join(CONVENTIONAL[role])} among "
                                   f"tokenizer.json's special tokens: fastmae needs the {role} token")
            ids[role] = self.rust.token_to_id(token)
            if ids[role] is None:
                raise FastmaeError(f"{source}: {key} {token!r} is not in tokenizer.json's vocabulary")
        if len(set(ids.values())) < len(ids):
            raise FastmaeError(f"{source}: special tokens {ids} share ids: fastmae needs five different ones (pad, "
                               "cls/bos, sep/eos, unk, mask)")
        # what decides the ids: the tokenizer's pipeline and vocabulary (not its truncation or padding settings, which
        # a re-save may change) and the special ids
        pipeline = {k: v for k, v in json.loads(files["tokenizer.json"]).items() if k not in ("truncation", "padding")}
        identity = json.dumps([pipeline, ids], sort_keys=True).encode()
        super().__init__(files, source, SpecialTokens(**ids), identity)
        self.vocab_size = self.rust.get_vocab_size(with_added_tokens=True)
        self.pair_separators = max(1, self.rust.num_special_tokens_to_add(is_pair=True) - 2)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.rust.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.rust.decode(list(ids))


def tokenizer_from_files(files: dict[str, bytes], source: str) -> Tokenizer:
    """The tokenizer saved as `files` ({name: bytes}): sentencepiece when tokenizer.model is among them, else a
    Hugging Face tokenizer."""
    if SENTENCEPIECE_FILE in files:
        return SentencePieceTokenizer(files[SENTENCEPIECE_FILE], source)
    return HuggingFaceTokenizer(files, source)


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` holds a tokenizer `load_tokenizer` would read (tokenizer.model or tokenizer.json)."""
    return (directory / SENTENCEPIECE_FILE).is_file() or (directory / "tokenizer.json").is_file()


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at `path`: a sentencepiece model file, a Hugging Face tokenizer.json, or a directory holding
    either (a dataset, run, export or Hugging Face model directory). A directory's tokenizer.model is read first when
    it has fastmae's special ids (a fastmae export holds both); else its tokenizer.json. Errors name the path and
    what was looked for."""
    path = Path(path)
    if path.is_file():
        if path.name == "tokenizer.json":
            path = path.parent
        else:
            return SentencePieceTokenizer(path.read_bytes(), str(path))
    if not path.is_dir():
        raise FastmaeError(f"{path}: tokenizer not found (expected a sentencepiece model, a tokenizer.json or a "
                           "directory holding one)")
    has_json = (path / "tokenizer.json").is_file()
    if (path / SENTENCEPIECE_FILE).is_file():
        try:
            return SentencePieceTokenizer((path / SENTENCEPIECE_FILE).read_bytes(), str(path / SENTENCEPIECE_FILE))
        except FastmaeError:
            if not has_json:
                raise
    if not has_json:
        raise FastmaeError(f"{path}: no tokenizer ({SENTENCEPIECE_FILE} or tokenizer.json) in this directory")
    files = {name: (path / name).read_bytes() for name in HUGGING_FACE_FILES if (path / name).is_file()}
    return HuggingFaceTokenizer(files, str(path))
