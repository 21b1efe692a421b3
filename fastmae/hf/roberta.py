"""RoBERTa (transformers' `RobertaModel` / `RobertaForMaskedLM`): post-LN layers with learned positions whose rows
start after the pad id. The export of every post-LN encoder with learned positions."""

from __future__ import annotations

from pathlib import Path

import torch

import fastmae.hf.classic as classic

from ..config import ModelConfig, SpecialTokens

MODEL_TYPE = "roberta"
NAME = "RoBERTa"
LAYOUT = classic.Layout(MODEL_TYPE)


def claims(config: ModelConfig) -> bool:
    """Whether this is the architecture `config` exports as."""
    return classic.in_lineage(config) and config.norm_position == "post" and config.position_embedding == "learned"


def export_refusal(config: ModelConfig) -> str | None:
    """Why a config this architecture claims cannot be written as it (None: it can)."""
    return None


def model_config(hf: dict, special: SpecialTokens, source: Path) -> ModelConfig:
    """The ModelConfig of a RoBERTa config.json (`classic.model_config` says what is refused)."""
    return classic.learned_post_ln_config(LAYOUT, hf, special, source, NAME)


def read(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path):
    """(fastmae weights, segment row) of RoBERTa's tensors."""
    return classic.read(LAYOUT, config, tensors, source)


def write(config: ModelConfig, weights: dict[str, torch.Tensor], segment_row: torch.Tensor | None):
    """fastmae weights under RoBERTa's names."""
    return classic.write(LAYOUT, config, weights, segment_row)


def hugging_face_config(config: ModelConfig, carried: dict):
    """The RobertaConfig of the export, carrying `carried` (fastmae's own config)."""
    from transformers import RobertaConfig

    return RobertaConfig(**classic.config_fields(config), hidden_act="gelu", type_vocab_size=2,
                         bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                         architectures=classic.masked_lm(config, "RobertaForMaskedLM", "RobertaModel"), **carried)
