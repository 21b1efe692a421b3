"""The `fastmae` console script: one subcommand per module, each also runnable as `python -m fastmae.<name>`."""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "prepare": ("fastmae.prepare", "tokenise text into memory-mapped shards (trains a sentencepiece tokenizer)"),
    "train": ("fastmae.train", "pretrain a masked LM (single process; use `deepspeed fastmae/train.py` for many)"),
    "plot": ("fastmae.plot", "draw loss and throughput curves of a run directory"),
    "export": ("fastmae.export", "write the encoder as a Hugging Face RoBERTa directory (model, config, tokenizer)"),
    "finetune": ("fastmae.finetune", "fine-tune on GLUE-format classification or regression data, median of seeds"),
    "analyze": ("fastmae.analyze", "effective rank of token representations per layer, with and without <mask>"),
    "study": ("fastmae.study", "train objectives under one FLOP budget, then compare loss, fine-tuning and ranks"),
}


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the console script: keep freed memory in the process (fastmae.malloc)
        from fastmae.malloc import restart_with_malloc_tunables

        restart_with_malloc_tunables()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        lines = [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
        print("usage: fastmae SUBCOMMAND [--help] ...\n\nsubcommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"fastmae: error: unknown subcommand {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
