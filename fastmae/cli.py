"""The `fastmae` console script: one subcommand per module, each also runnable as `python -m fastmae.<name>`."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "prepare": ("fastmae.prepare", "tokenise text into memory-mapped shards (trains a sentencepiece tokenizer, or "
                                   "takes yours: a sentencepiece model or a Hugging Face tokenizer directory)"),
    "train": ("fastmae.train", "pretrain a masked LM (single process; use `deepspeed fastmae/train.py` for many)"),
    "plot": ("fastmae.plot", "draw loss and throughput curves of a run directory"),
    "export": ("fastmae.export", "write the encoder as a Hugging Face RoBERTa, RoFormer, ESM-2 or ModernBERT "
                                 "directory (a BERT's as a BERT) with its tokenizer and a model card (needs the hf "
                                 "extra)"),
    "finetune": ("fastmae.finetune", "fine-tune on GLUE-format classification or regression data, median of seeds"),
    "glue": ("fastmae.glue", "fine-tune every GLUE task found, the papers' grid or ModernBERT's settings, several "
                             "models side by side"),
    "analyze": ("fastmae.analyze", "effective rank of token representations per layer, with and without <mask>, and "
                                   "the neighbour probe: did the encoder learn context"),
    "study": ("fastmae.study", "train objectives under one FLOP budget, then compare loss, fine-tuning and ranks"),
}


def usage() -> str:
    """`fastmae --help`: what each subcommand does."""
    lines = [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return ("usage: fastmae [--version] SUBCOMMAND [--help] ...\n\n"
            "Pretrain masked-LM encoders (RoBERTa's MLM, MAE-LM, 3ML), then export, fine-tune and analyze them.\n\n"
            "subcommands:\n" + "\n".join(lines) +
            "\n\nMany ranks or nodes: deepspeed fastmae/train.py --config configs/NAME.yaml [key=value ...]")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the console script: keep freed memory in the process (fastmae.malloc)
        from fastmae.malloc import restart_with_malloc_tunables

        restart_with_malloc_tunables()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-V", "--version"):
        from fastmae import __version__

        print(f"fastmae {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(usage())
        print(f"fastmae: error: unknown subcommand {argv[0]!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
