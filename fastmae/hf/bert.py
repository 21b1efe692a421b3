"""BERT (transformers' `BertModel` / `BertForMaskedLM`), read only: RoBERTa's layers with position rows counted from
row 0 and the LM head under `cls.predictions`. fastmae writes such an encoder back as RoBERTa, which computes the
same function (its pair segments included: `classic.write`)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig, SpecialTokens
from . import classic

MODEL_TYPE = "bert"
NAME = "BERT"
LAYOUT = classic.Layout(MODEL_TYPE, head=classic.BERT_HEAD, positions_after_pad=False)


def claims(config: ModelConfig) -> bool:
    """Never: fastmae exports BERT-shaped encoders as RoBERTa."""
    return False


def model_config(hf: dict, special: SpecialTokens, source: Path) -> ModelConfig:
    """The ModelConfig of a BERT config.json (`classic.model_config` says what is refused)."""
    return classic.learned_post_ln_config(LAYOUT, hf, special, source, NAME)


def read(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path):
    """(fastmae weights, segment row) of BERT's tensors, its position rows moved behind fastmae's pad offset."""
    return classic.read(LAYOUT, config, tensors, source)
