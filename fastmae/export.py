"""`fastmae export RUN_DIR_OR_CHECKPOINT OUTDIR`: the encoder as a Hugging Face directory: RoBERTa for post-LN encoders
with learned positions, ESM-2 for pre-LN ones (fastmae.hf_format.hugging_face_architecture).

    OUTDIR/config.json             RobertaConfig or EsmConfig (+ `fastmae_model_config`, so fastmae reads it back)
    OUTDIR/model.safetensors       fp32 master weights under Hugging Face's names (the LM head too for `mlm`)
    OUTDIR/tokenizer.json ...      the sentencepiece tokenizer as a fast tokenizer: same ids, same specials
    OUTDIR/tokenizer.model         the sentencepiece model itself (fastmae's own commands tokenise with it)
`transformers.AutoModel`, `AutoModelForMaskedLM` and `AutoTokenizer` load OUTDIR without `trust_remote_code`.

The format (names, config, tokenizer) lives in fastmae.hf_format. Only the pretrained encoder is exported. The
MAE-LM / 3ML decoder is dropped, and so is their LM head, which was trained on decoder states, not encoder states
(`AutoModelForMaskedLM` then initialises a fresh head and says so).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from .checkpoint import WEIGHTS
from .data.tokenizer import TOKENIZER_FILE
from .errors import FastmaeError, run_command
from .hf_format import hugging_face_config, hugging_face_tokenizer, to_hugging_face
from .pretrained import load_pretrained


def export(source: str | Path, outdir: str | Path, overwrite: bool = False) -> Path:
    """Write the Hugging Face directory of the model at `source` (see `fastmae.pretrained.load_pretrained`).

    Everything is written into a hidden sibling directory first and renamed to `outdir` at the end.
    """
    _require_transformers()
    outdir = Path(outdir)
    if outdir.exists() and (not outdir.is_dir() or any(outdir.iterdir())) and not overwrite:
        raise FastmaeError(f"{outdir}: exists and is not empty (pass --overwrite to replace it)")
    pretrained = load_pretrained(source)
    config = pretrained.config
    tensors = to_hugging_face(config, pretrained.weights)
    partial = outdir.with_name(f".{outdir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        from safetensors.torch import save_file

        partial.mkdir(parents=True)
        hugging_face_config(config).save_pretrained(partial)
        save_file(tensors, str(partial / WEIGHTS),
                  metadata={"format": "pt", "fastmae_source": str(pretrained.weights_file),
                            "fastmae_step": str(pretrained.step)})
        hugging_face_tokenizer(pretrained.tokenizer, config.max_seq_len).save_pretrained(partial)
        (partial / TOKENIZER_FILE).write_bytes(pretrained.tokenizer.model_bytes)
        if outdir.exists():
            shutil.rmtree(outdir)
        partial.rename(outdir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return outdir


def _require_transformers() -> None:
    try:
        import google.protobuf  # noqa: F401  (sentencepiece's model proto)
        import transformers  # noqa: F401
    except ImportError as err:
        raise FastmaeError(f"export needs the hf extra ({err.name} is not installed): pip install 'fastmae[hf]'") \
            from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae export", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", metavar="RUN_DIR_OR_CHECKPOINT",
                        help="a run directory (its newest weights) or one of its checkpoints/stepN directories")
    parser.add_argument("outdir", metavar="OUTDIR", help="the Hugging Face directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTDIR if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run():
        outdir = export(args.source, args.outdir, args.overwrite)
        print(f"fastmae export: wrote {outdir} (load it with transformers.AutoModel.from_pretrained)", file=sys.stderr)

    return run_command("fastmae export", run)


if __name__ == "__main__":
    sys.exit(main())
