"""`fastmae export MODEL_DIR OUTDIR`: the encoder as a Hugging Face directory: RoBERTa or RoFormer for
post-LN encoders (learned or rotary positions), ESM-2 for pre-LN ones, ModernBERT for ModernBERT's layers, and the
architecture a Hugging Face source came from where it can be written back (a BERT as a BERT, with its pooler)
(fastmae.hf.export_architecture).

    OUTDIR/config.json             the architecture's config (+ `fastmae_model_config`, so fastmae reads it back)
    OUTDIR/model.safetensors       fp32 master weights under Hugging Face's names (the LM head too for `mlm`, where
                                   the model has one)
    OUTDIR/tokenizer.json ...      the tokenizer as a fast tokenizer: same ids, same specials (a Hugging Face
                                   tokenizer's own files; a sentencepiece model converted, and kept as tokenizer.model
                                   for fastmae's own commands)
    OUTDIR/README.md               the model card: objective, size, data, tokens, FLOPs, held-out loss, command
`transformers.AutoModel`, `AutoModelForMaskedLM` and `AutoTokenizer` load OUTDIR without `trust_remote_code`.

The format (names, config, tokenizer) lives in fastmae.hf, a module per architecture. Only the pretrained encoder is
exported. The MAE-LM / 3ML decoder is dropped, and so is their LM head, which was trained on decoder states, not
encoder states (`AutoModelForMaskedLM` then initialises a fresh head and says so).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import yaml

from . import __version__
from .checkpoint import WEIGHTS
from .data.order import StepSizes
from .data.tokenizer import SentencePieceTokenizer
from .errors import FastmaeError, run_command
from .evaluation import plateau_note
from .hf import export_architecture, hugging_face_config, to_hugging_face
from .hf.classic import writes_head
from .hf.tokenizer import hugging_face_tokenizer
from .metrics import read_metrics
from .pretrained import MODEL_HELP, Pretrained, load_pretrained


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
    tensors = to_hugging_face(config, pretrained.weights, pretrained.origin)
    with_head = writes_head(config, pretrained.weights)
    partial = outdir.with_name(f".{outdir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        from safetensors.torch import save_file

        partial.mkdir(parents=True)
        hugging_face_config(config, pretrained.origin, with_head).save_pretrained(partial)
        save_file(tensors, str(partial / WEIGHTS),
                  metadata={"format": "pt", "fastmae_source": str(pretrained.weights_file),
                            "fastmae_step": str(pretrained.step)})
        pretrained.tokenizer.save(partial)
        if isinstance(pretrained.tokenizer, SentencePieceTokenizer):
            hugging_face_tokenizer(pretrained.tokenizer, config.position_capacity).save_pretrained(partial)
        (partial / "README.md").write_text(model_card(pretrained, tensors))
        if outdir.exists():
            shutil.rmtree(outdir)
        partial.rename(outdir)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return outdir


def _run_dir(weights_file: Path) -> Path | None:
    """The run directory a weights file belongs to (the run's own, a checkpoint's or an evaluation's), if any."""
    for directory in list(weights_file.parents)[:3]:
        if (directory / "config.yaml").is_file() and (directory / "metrics.jsonl").is_file():
            return directory
    return None


def model_card(pretrained: Pretrained, tensors: dict) -> str:
    """README.md of an export: what was trained, on what, how far, by which command, and what is not in it."""
    config, step = pretrained.config, pretrained.step
    arch = export_architecture(config, pretrained.origin.name)
    encoder = sum(t.numel() for name, t in tensors.items() if not name.startswith(("lm_head.", "head.", "decoder.")))
    schedule = "" if config.mask_rate_end == -1.0 else f" -> {config.mask_rate_end:g}, {config.mask_rate_shape}"
    lines = ["---", "library_name: transformers", "tags: [fastmae, masked-language-modeling, "
             f"{config.objective}]", "---", "", f"# fastmae {config.objective} encoder", "",
             f"Pretrained with fastmae {__version__} ({config.describe()}; mask rate {config.mask_rate:g}{schedule}) "
             f"and exported as Hugging Face {arch.NAME}: {encoder:,} encoder parameters. Weights of step {step}.", ""]
    run_dir = _run_dir(pretrained.weights_file)
    if run_dir is None:
        lines += [f"Exported from `{pretrained.weights_file}`, which is not in a fastmae run directory: its training "
                  "facts are not known here.", ""]
    else:
        records = [r for r in read_metrics(run_dir) if r["step"] <= step]
        train = next((r for r in reversed(records) if r.get("kind") == "train"), None)
        evals = [r for r in records if r.get("kind") == "eval"]
        held_out = evals[-1] if evals else None
        resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
        info_file = run_dir / "run_info.json"
        info = json.loads(info_file.read_text()) if info_file.is_file() else {}
        lines += ["## Training", "", f"- data: `{resolved['data']['path']}` ({resolved['data']['packing']} packing, "
                  f"tokenizer sha256 {pretrained.tokenizer.sha256[:16]}...)"]
        if train is not None:
            lines.append(f"- {train['tokens_seen']:,} training tokens, {train['flops']:.4g} training FLOPs "
                         f"(fastmae's model count) to step {train['step']}; digest of the sequences seen "
                         f"{train.get('data_digest', '-')}")
        if held_out is not None:
            lines.append(f"- held-out masked-token loss at step {held_out['step']}: {held_out['loss']:.3f} nats "
                         f"(unigram entropy of the same tokens {held_out['unigram_entropy']:.3f}; "
                         f"accuracy {held_out['accuracy']:.3f}){plateau_note(evals)}")
        if info.get("init_from"):
            source = info["init_from"]
            start = (f"the Hugging Face {source['foreign']} encoder `{source['weights']}`" if source.get("foreign")
                     else f"`{source['weights']}` (step {source['step']} of a `{source['objective']}` run)")
            lines.append(f"- continued pretraining: started from {start}, then trained as `{config.objective}`"
                         f"{source.get('positions', '')}")
        if info.get("schedule"):
            lines.append(f"- learning rate: {info['schedule']}")
        if info.get("ranks"):
            lines.append(f"- global batch: {batch_line(resolved, info['ranks'])}")
        lines.append(f"- trained on {info.get('ranks', '?')} x {info.get('device', '?')}, "
                     f"{info.get('precision', '?')}; each rank ran `{info.get('command', 'not recorded')}` "
                     f"(fastmae {info.get('fastmae_version', '?')})")
        lines.append("")
    sentencepiece = isinstance(pretrained.tokenizer, SentencePieceTokenizer)
    lines += ["## Limitations", "",
              "- Only the encoder is exported. " + (
                  "The MAE-LM / 3ML decoder and the LM head (trained on decoder states) are not: "
                  "`AutoModelForMaskedLM` starts a new, untrained head, so use this for fine-tuning and features, "
                  "not for filling in masks." if config.insert_layer > 0 else
                  "The LM head is the one trained with it (`AutoModelForMaskedLM` predicts masked tokens)."),
              "- Small fastmae runs are for comparing objectives and checking pipelines; compare its held-out loss "
              "with the unigram entropy above before trusting it for anything else.",
              "- `AutoTokenizer` loads " + (
                  "the fast tokenizer built from `tokenizer.model` (the sentencepiece model fastmae trained with): "
                  "same ids, `<s> A </s></s> B </s>` for pairs." if sentencepiece
                  else "the tokenizer the model was trained with, its own files unchanged."), ""]
    return "\n".join(lines)


def batch_line(resolved: dict, ranks: int) -> str:
    """A run's global batch, from its resolved config.yaml and rank count, for the model card."""
    train, micro = resolved["train"], resolved["data"]["tokens_per_micro_batch"]
    sizes = StepSizes.warming_up(ranks, train["grad_accum"], micro, train.get("batch_warmup_tokens", 0),
                                 train.get("batch_warmup_from", 0))
    return sizes.batch(micro)


def _require_transformers() -> None:
    try:
        import google.protobuf  # noqa: F401  (sentencepiece's model proto)
        import transformers  # noqa: F401
    except ImportError as err:
        raise FastmaeError(f"export needs the hf extra ({err.name} is not installed): pip install 'fastmae[hf]'") \
            from None


HELP = """Write a trained encoder as a Hugging Face directory that transformers' AutoModel, AutoModelForMaskedLM and
AutoTokenizer load without trust_remote_code: RoBERTa (post-LN, learned positions), RoFormer (post-LN, rotary
positions), ESM-2 (pre-LN) or ModernBERT (ModernBERT's layers); an encoder that came from a BERT comes back as a BERT
(its positions, token-type rows and pooler), and one without an MLM head is written without one. With the fp32
weights as safetensors, the tokenizer, and a model card (README.md: objective, size, data, training tokens and
FLOPs, held-out loss, the training command). Needs the hf extra: pip install 'fastmae[hf]'."""
REFUSED = """Refused, with the reason and what would export: encoders with MAE-LM's relative position bias
(model.relative_attention_bias), the mask-later encoders with 0 < insert_layer < encoder_layers, and post-LN encoders
with rotary positions at a rotary_base other than 10000. fastmae finetune and fastmae analyze take those models from
their run directory. The MAE-LM / 3ML decoder is not exported (only the encoder is pretrained for fine-tuning)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae export", description=HELP, epilog=REFUSED)
    parser.add_argument("source", metavar="MODEL_DIR",
                        help=MODEL_HELP)
    parser.add_argument("outdir", metavar="OUTDIR", help="the Hugging Face directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTDIR if it exists")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run():
        outdir = export(args.source, args.outdir, args.overwrite)
        print(f"fastmae export: wrote {outdir} (model card: {outdir / 'README.md'}); next: load it with "
              f"transformers.AutoModel.from_pretrained({str(outdir)!r}), or fine-tune it: fastmae finetune --model "
              f"{outdir} --task sst2 --data GLUE_DIR/SST-2 --out ft/{outdir.name}", file=sys.stderr)

    return run_command("fastmae export", run)


if __name__ == "__main__":
    sys.exit(main())
