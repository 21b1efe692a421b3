"""ESM-2's layers (transformers' `EsmModel` / `EsmForMaskedLM`): pre-LN, a LayerNorm after the embeddings, before each
sub-layer and after the last layer, erf GELU, the query scaled before rotate-half rotary positions of any base (or
learned positions offset as RoBERTa's). The export of fastmae's pre-LN encoders of the BERT lineage. Read with
token_dropout off and the embedding LayerNorm on; the released ESM-2 checkpoints have neither, and are refused."""

from __future__ import annotations

from pathlib import Path

import torch

import fastmae.hf.classic as classic

from ..config import ModelConfig, SpecialTokens
from ..positions import rotary_inverse_frequencies

MODEL_TYPE = "esm"
NAME = "ESM-2"
LAYOUT = classic.Layout(MODEL_TYPE, layer=(("attn_out", "attention.output.dense"), ("attn_norm", "attention.LayerNorm"),
                                           ("ffn_in", "intermediate.dense"), ("ffn_out", "output.dense"),
                                           ("ffn_norm", "LayerNorm")),
                        embedding_norm="layer_norm", final_norm="emb_layer_norm_after", token_types=False)


def claims(config: ModelConfig) -> bool:
    """Whether this is the architecture `config` exports as."""
    return classic.in_lineage(config) and config.norm_position == "pre"


def export_refusal(config: ModelConfig) -> str | None:
    """Why a config this architecture claims cannot be written as it (None: it can)."""
    return None


def model_config(hf: dict, special: SpecialTokens, source: Path) -> ModelConfig:
    """The ModelConfig of an ESM config.json (ESM-2's layers, token_dropout off, the embedding LayerNorm on)."""
    classic.require(hf, source, NAME, "emb_layer_norm_before", (True,))
    classic.require(hf, source, NAME, "token_dropout", (False,))
    classic.require(hf, source, NAME, "position_embedding_type", ("rotary", "absolute"), "absolute")
    rotary = hf.get("position_embedding_type") == "rotary"
    return classic.model_config(LAYOUT, hf, special, source, NAME,
                                position_embedding="rotary" if rotary else "learned",
                                rotary_base=float(hf.get("rope_theta", 10000.0)), norm_position="pre")


def read(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path):
    """(fastmae weights, no segment row) of ESM's tensors."""
    return classic.read(LAYOUT, config, tensors, source)


def write(config: ModelConfig, weights: dict[str, torch.Tensor], segment_row: torch.Tensor | None):
    """fastmae weights under ESM's names, with its rotary buffer (so that loading leaves nothing to fill)."""
    out = classic.write(LAYOUT, config, weights, segment_row)
    if config.position_embedding == "rotary":
        out["esm.rotary_embeddings.inv_freq"] = rotary_inverse_frequencies(config.head_dim, config.rotary_base)
    return out


def hugging_face_config(config: ModelConfig, carried: dict):
    """The EsmConfig of the export, carrying `carried` (fastmae's own config)."""
    from transformers import EsmConfig

    return EsmConfig(**classic.config_fields(config), mask_token_id=config.mask_token_id, token_dropout=False,
                     emb_layer_norm_before=True, rope_theta=config.rotary_base,
                     position_embedding_type="rotary" if config.position_embedding == "rotary" else "absolute",
                     architectures=classic.masked_lm(config, "EsmForMaskedLM", "EsmModel"), **carried)
