"""A pretrained encoder, from wherever it lives: a run directory, one of its checkpoints, or a Hugging Face export.

    RUN/                         config.yaml, model.safetensors (end of run), tokenizer.model, checkpoints/stepN/
    RUN/checkpoints/stepN/       COMPLETE, model.safetensors (fp32 master weights of step N)
    RUN/eval_weights/stepN/      the same, kept at the evaluation of step N (eval.keep_weights)
    EXPORT/                      config.json (RoBERTa + fastmae_model_config), model.safetensors, tokenizer.model
`export`, `finetune` and `analyze` all start from `load_pretrained`; the weights are fp32 with fastmae's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from .checkpoint import WEIGHTS, complete_checkpoints, read_weights, saved_model_config, weights_metadata
from .config import ModelConfig
from .data.tokenizer import TOKENIZER_FILE, Tokenizer
from .errors import FastmaeError
from .hf_format import read_hugging_face
from .model import MaskedLM


@dataclass
class Pretrained:
    """config and fp32 weights (fastmae names) of a pretrained model, the tokenizer it was trained with, and where
    they came from (`weights_file`, `step`)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    weights_file: Path
    step: int

    def encoder(self) -> MaskedLM:
        """The pretrained network minus its decoder (what fine-tuning and `encode` run), with its weights loaded.

        The LM head stays (loaded when the source has it) but `encode` never reads it; the encoder predicts
        nothing, so its mask rate is 0.
        """
        config = self.config.replace(decoder_layers=0, decoder_kind="self", mask_rate=0.0)
        model = MaskedLM(config)
        expected = model.state_dict()
        missing = sorted(k for k in expected if k not in self.weights and not k.startswith("head."))
        if missing:
            raise FastmaeError(f"{self.weights_file}: missing encoder weights {missing[:4]}"
                               + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
        for name, tensor in expected.items():
            if name in self.weights and self.weights[name].shape != tensor.shape:
                raise FastmaeError(f"{self.weights_file}: {name} has shape {tuple(self.weights[name].shape)}, "
                                   f"the model config says {tuple(tensor.shape)}")
        model.load_state_dict({k: v for k, v in self.weights.items() if k in expected}, strict=False)
        return model


def load_pretrained(path: str | Path) -> Pretrained:
    """Read a run directory (its newest weights: the end-of-run file or a later checkpoint), a checkpoint
    directory, or a directory written by `fastmae export`. Errors name the path and what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise FastmaeError(f"{path}: no such directory (expected a run, checkpoint or exported directory)")
    if (path / "config.json").is_file():
        config, weights, step = read_hugging_face(path)
        weights_file = path / WEIGHTS
        tokenizer = _tokenizer(path / TOKENIZER_FILE, "the export")
    elif (path / "COMPLETE").is_file():
        weights_file = path / WEIGHTS
        if not weights_file.is_file():
            raise FastmaeError(f"{path}: checkpoint without {WEIGHTS} (written by an older fastmae); resume the "
                               "run for a step and checkpoint again")
        weights, config_dict, step = read_weights(weights_file)
        config = saved_model_config(config_dict, weights_file)
        tokenizer = _run_tokenizer(path.parent.parent)
    elif (path / "config.yaml").is_file():
        weights_file, step = _newest_weights(path)
        weights, config_dict, _ = read_weights(weights_file)
        config = saved_model_config(config_dict, weights_file)
        tokenizer = _run_tokenizer(path)
    else:
        raise FastmaeError(f"{path}: not a fastmae run directory (no config.yaml), checkpoint directory (no "
                           "COMPLETE) or exported directory (no config.json)")
    if tokenizer.vocab_size != config.vocab_size:
        raise FastmaeError(f"{tokenizer.source}: {tokenizer.vocab_size} tokens, but {weights_file} was trained with "
                           f"vocab_size {config.vocab_size}: the tokenizer is from another dataset")
    rows = weights.get("embeddings.tokens.weight")
    if rows is not None and rows.shape[0] != config.vocab_size:
        raise FastmaeError(f"{weights_file}: token embedding has {rows.shape[0]} rows, vocab_size is "
                           f"{config.vocab_size}")
    return Pretrained(config, weights, tokenizer, weights_file, step)


def _newest_weights(run_dir: Path) -> tuple[Path, int]:
    """The newest fp32 weights of a run: the end-of-run file, or a complete checkpoint of a later step."""
    candidates = [(step, 1, directory / WEIGHTS) for step, directory in complete_checkpoints(run_dir / "checkpoints")
                  if (directory / WEIGHTS).is_file()]
    if (run_dir / WEIGHTS).is_file():
        candidates.append((weights_metadata(run_dir / WEIGHTS)[1], 2, run_dir / WEIGHTS))
    if not candidates:
        raise FastmaeError(f"{run_dir}: no {WEIGHTS} and no complete checkpoint with weights: the run has not "
                           "saved any yet")
    step, _, weights_file = max(candidates)
    return weights_file, step


def _run_tokenizer(run_dir: Path) -> Tokenizer:
    """The run's copy of its tokenizer, or (runs of older fastmae) the one in the dataset its config names."""
    if (run_dir / TOKENIZER_FILE).is_file():
        return Tokenizer.load(run_dir / TOKENIZER_FILE)
    data_path = None
    if (run_dir / "config.yaml").is_file():
        data_path = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("data", {}).get("path")
    if data_path is None:
        raise FastmaeError(f"{run_dir}: no {TOKENIZER_FILE} and no data.path in config.yaml to find one")
    return _tokenizer(Path(data_path) / TOKENIZER_FILE, f"{run_dir}'s dataset")


def _tokenizer(path: Path, what: str) -> Tokenizer:
    if not path.is_file():
        raise FastmaeError(f"{path}: missing ({what} has no sentencepiece tokenizer)")
    return Tokenizer.load(path)
