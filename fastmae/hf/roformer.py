"""RoFormer (transformers' `RoFormerModel` / `RoFormerForMaskedLM`): post-LN layers with rotary positions of base
10000, rotating interleaved feature pairs (2j, 2j + 1) where fastmae rotates halves (j, j + head_dim / 2): each
head's query and key features are permuted both ways. The export of post-LN encoders with rotary positions."""

from __future__ import annotations

from pathlib import Path

import torch

import fastmae.hf.classic as classic

from ..config import ModelConfig, SpecialTokens

MODEL_TYPE = "roformer"
NAME = "RoFormer"


def interleaving(config: ModelConfig) -> torch.Tensor:
    """The order of a query or key projection's output features that makes RoFormer's rotation of interleaved pairs
    fastmae's rotation of halves."""
    d = config.head_dim
    within = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).reshape(-1)
    return torch.cat([head * d + within for head in range(config.num_heads)])


LAYOUT = classic.Layout(MODEL_TYPE, head=classic.BERT_HEAD, qk_order=interleaving)


def claims(config: ModelConfig) -> bool:
    """Whether this is the architecture `config` exports as."""
    return classic.in_lineage(config) and config.norm_position == "post" and config.position_embedding == "rotary"


def export_refusal(config: ModelConfig) -> str | None:
    """Why a config this architecture claims cannot be written as it (None: it can)."""
    if config.rotary_base == 10000.0:
        return None
    return (f"rotary_base={config.rotary_base:g} with norm_position='post': RoFormer, the post-LN encoder with rotary "
            "positions, has base 10000 only; pre-LN models export with any base (as ESM-2); fine-tune this one with "
            "`fastmae finetune --model RUN_DIR`")


def model_config(hf: dict, special: SpecialTokens, source: Path) -> ModelConfig:
    """The ModelConfig of a RoFormer config.json: rotary positions on the keys and queries only, one embedding
    width."""
    classic.require(hf, source, NAME, "position_embedding_type", ("rotary",), "rotary")
    classic.require(hf, source, NAME, "rotary_value", (False,), False)
    classic.require(hf, source, NAME, "embedding_size", (hf.get("hidden_size"), None))
    return classic.model_config(LAYOUT, hf, special, source, NAME, position_embedding="rotary",
                                rotary_base=10000.0, norm_position="post")


def read(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path):
    """(fastmae weights, segment row) of RoFormer's tensors (its token-type row 0 folded into the token rows)."""
    return classic.read(LAYOUT, config, tensors, source)


def write(config: ModelConfig, weights: dict[str, torch.Tensor], segment_row: torch.Tensor | None):
    """fastmae weights under RoFormer's names, with its own sinusoid table (so that loading leaves nothing to
    fill)."""
    from transformers.models.roformer.modeling_roformer import RoFormerSinusoidalPositionalEmbedding

    out = classic.write(LAYOUT, config, weights, segment_row)
    table = RoFormerSinusoidalPositionalEmbedding(config.position_capacity + config.position_offset, config.head_dim)
    out["roformer.encoder.embed_positions.weight"] = table.create_weight()
    return out


def hugging_face_config(config: ModelConfig, carried: dict):
    """The RoFormerConfig of the export, carrying `carried` (fastmae's own config)."""
    from transformers import RoFormerConfig

    return RoFormerConfig(**classic.config_fields(config), embedding_size=config.hidden_size, hidden_act="gelu",
                          type_vocab_size=2, rotary_value=False,
                          architectures=classic.masked_lm(config, "RoFormerForMaskedLM", "RoFormerModel"), **carried)
