"""BERT (transformers' `BertModel` / `BertForMaskedLM`): RoBERTa's layers with position rows counted from row 0 and
the LM head under `cls.predictions`. It claims no config of fastmae's own (those export as RoBERTa); an encoder that
came from a BERT (read here, continued from one, or exported as one) is written back as a BERT: its positions, its
token-type rows, its pooler where it had one (`Pretrained.origin`, `Pretrained.kept`)."""

from __future__ import annotations

from pathlib import Path

import torch

import fastmae.hf.classic as classic

from ..config import ModelConfig, SpecialTokens

MODEL_TYPE = "bert"
NAME = "BERT"
LAYOUT = classic.Layout(MODEL_TYPE, head=classic.BERT_HEAD, positions_after_pad=False)


def claims(config: ModelConfig) -> bool:
    """Never: fastmae's own BERT-shaped encoders export as RoBERTa; a BERT's own come back as BERT (its origin)."""
    return False


def export_refusal(config: ModelConfig) -> str | None:
    """Why an encoder from a BERT cannot be written back as one (None: it can)."""
    if not (classic.in_lineage(config) and config.norm_position == "post" and config.position_embedding == "learned"):
        return "its layers are no longer BERT's (post-LN, learned positions)"
    return None


def model_config(hf: dict, special: SpecialTokens, source: Path) -> ModelConfig:
    """The ModelConfig of a BERT config.json (`classic.model_config` says what is refused)."""
    return classic.learned_post_ln_config(LAYOUT, hf, special, source, NAME)


def read(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path):
    """(fastmae weights, segment row) of BERT's tensors, its position rows moved behind fastmae's pad offset."""
    return classic.read(LAYOUT, config, tensors, source)


def write(config: ModelConfig, weights: dict[str, torch.Tensor], segment_row: torch.Tensor | None):
    """fastmae weights under BERT's names, its position rows from position 0."""
    return classic.write(LAYOUT, config, weights, segment_row)


def hugging_face_config(config: ModelConfig, carried: dict):
    """The BertConfig of the export, carrying `carried` (fastmae's own config)."""
    from transformers import BertConfig

    fields = {**classic.config_fields(config), "max_position_embeddings": config.position_capacity}
    return BertConfig(**fields, hidden_act="gelu", type_vocab_size=2,
                      architectures=classic.masked_lm(config, "BertForMaskedLM", "BertModel"), **carried)
