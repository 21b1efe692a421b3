"""A small generated corpus with learnable structure, for the tests that need a model to learn something.

Each document is a walk on a sparse random Markov chain over the ordinary token ids: every token has a few likely
successors, so a masked token is predictable from its neighbours (the loss can fall from ln V towards ~ln(branching)).
"""

from __future__ import annotations

import numpy as np

from fastmae.config import ROLES, SpecialTokens

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains


def markov_documents(num_documents: int, vocab_size: int, min_len: int = 8, max_len: int = 64,
                     branching: int = 2, seed: int = 0) -> list[list[int]]:
    """`num_documents` token-id lists `<s> w1 .. wn </s>` with n uniform in [min_len, max_len], drawn with `seed`.

    Successors of each ordinary token are `branching` fixed random ordinary tokens, chosen uniformly.
    """
    if vocab_size <= len(ROLES) + branching:
        raise ValueError(f"markov_documents: vocab_size {vocab_size} is too small for branching {branching}")
    rng = np.random.default_rng(seed)
    ordinary = np.arange(len(ROLES), vocab_size)
    successors = rng.choice(ordinary, size=(vocab_size, branching))
    docs = []
    for length in rng.integers(min_len, max_len + 1, size=num_documents):
        choices = rng.integers(0, branching, size=length)
        walk = np.empty(length, dtype=np.int64)
        walk[0] = rng.choice(ordinary)
        for i in range(1, length):  # a host-side generator, not a training step
            walk[i] = successors[walk[i - 1], choices[i]]
        docs.append([FASTMAE.bos, *walk.tolist(), FASTMAE.eos])
    return docs


def prepare_word_dataset(root, words: list[str], num_docs: int, max_words: int, vocab_size: int,
                         valid_fraction: float, seed: int = 0):
    """Prepare a dataset of `num_docs` documents of 3..max_words random `words` under `root`; return its directory."""
    from fastmae.prepare import prepare

    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(words, size=rng.integers(3, max_words))) for _ in range(num_docs)]
    (root / "corpus.txt").write_text("\n".join(docs) + "\n")
    prepare([root / "corpus.txt"], root / "ds", vocab_size=vocab_size, valid_fraction=valid_fraction, progress=False)
    return root / "ds"


def word_tokenizer_bytes(words: list[str], vocab_size: int, model_type: str = "unigram", seed: int = 0) -> bytes:
    """A sentencepiece model trained on random sentences of `words`."""
    from fastmae.data.tokenizer import train_sentencepiece

    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(words, size=12)) for _ in range(400)]
    return train_sentencepiece(docs, vocab_size, model_type=model_type)


def vocab_of(tokenizer_bytes: bytes) -> int:
    """The vocabulary size of a sentencepiece model's bytes."""
    from fastmae.data.tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(tokenizer_bytes).vocab_size


def write_run_dir(run_dir, model, tokenizer_bytes: bytes, step: int = 1):
    """A run directory as the trainer leaves it (config.yaml, tokenizer.model, model.safetensors) for `model`."""
    import dataclasses

    from fastmae.checkpoint import write_weights

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("data: {path: elsewhere}\n")
    (run_dir / "tokenizer.model").write_bytes(tokenizer_bytes)
    write_weights(run_dir / "model.safetensors", model.state_dict(), dataclasses.asdict(model.config), step)
    return run_dir


def keyword_split(path, words: list[str], n: int, seed: int, header: str = "sentence\tlabel"):
    """An SST-2 layout file of `n` sentences of `words`: label 1 when the sentence says "cat" (which `words` holds)."""
    rng = np.random.default_rng(seed)
    others = [w for w in words if w != "cat"]
    rows = [header]
    for _ in range(n):
        label = int(rng.integers(2))
        sentence = list(rng.choice(others, size=int(rng.integers(3, 9)))) + (["cat"] if label else [])
        rng.shuffle(sentence)
        rows.append(f"{' '.join(sentence)}\t{label}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


def write_glue(root, words: list[str], n_train: int, n_dev: int, seed: int = 0):
    """A GLUE directory of generated tasks in the benchmark's own layouts (CoLA without a header, MRPC's columns,
    STS-B's scores, MNLI with matched and mismatched dev sets, RTE's pairs, SST-2): each label says whether "cat" is
    in the (first) sentence, STS-B's score is 5 x that, MNLI's three classes also use "dog"; returns `root`."""
    rng = np.random.default_rng(seed)
    others = [w for w in words if w not in ("cat", "dog")]

    def sentence(*keys):
        body = list(rng.choice(others, size=int(rng.integers(3, 8)))) + list(keys)
        rng.shuffle(body)
        return " ".join(body)

    def rows(n, make):
        return [make(int(rng.integers(3))) for _ in range(n)]

    layouts = {
        "CoLA": ("", lambda c: f"src\t{c % 2}\t\t{sentence(*['cat'] * (c % 2))}"),
        "SST-2": ("sentence\tlabel", lambda c: f"{sentence(*['cat'] * (c % 2))}\t{c % 2}"),
        "MRPC": ("Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
                 lambda c: f"{c % 2}\t1\t2\t{sentence(*['cat'] * (c % 2))}\t{sentence()}"),
        "STS-B": ("index\tgenre\tsentence1\tsentence2\tscore",
                  lambda c: f"0\tnews\t{sentence(*['cat'] * (c % 2))}\t{sentence()}\t{5.0 * (c % 2):.3f}"),
        "RTE": ("index\tsentence1\tsentence2\tlabel", lambda c: f"0\t{sentence(*['cat'] * (c % 2))}\t{sentence()}\t"
                                                             f"{('not_entailment', 'entailment')[c % 2]}"),
        "MNLI": ("index\tsentence1\tsentence2\tgold_label",
                 lambda c: f"0\t{sentence(*(['cat'], ['dog'], [])[c])}\t{sentence()}\t"
                           f"{('entailment', 'contradiction', 'neutral')[c]}"),
    }
    for name, (header, make) in layouts.items():
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        devs = ("dev_matched.tsv", "dev_mismatched.tsv") if name == "MNLI" else ("dev.tsv",)
        for file, n in (("train.tsv", n_train), *((d, n_dev) for d in devs)):
            lines = ([header] if header else []) + rows(n, make)
            (directory / file).write_text("\n".join(lines) + "\n")
    return root
