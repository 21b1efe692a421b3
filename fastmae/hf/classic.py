"""What the BERT lineage's encoders share (RoBERTa, BERT, RoFormer, ESM-2): the names of fastmae's per-layer modules
under `{prefix}.encoder.layer.{i}.`, the embeddings and the LM head, the config fields they have in common, and the
token-type table fastmae folds away. Each architecture's own module (roberta.py, bert.py, roformer.py, esm.py) is a
`Layout` of its names plus what only it reads, writes or refuses.

fastmae's fused `qkv` projection is the row-wise concatenation of Hugging Face's query, key and value (kept fused:
one GEMM instead of three in every layer). fastmae has no token types: a token-type table's first row is folded into
the position rows (learned positions: exact) or into the token rows (rotary: the same hidden states; the tied LM
head's logits then move by one constant per row, so its probabilities are the same); a second row that differs from
it travels apart as the `segment_row`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig, SpecialTokens
from ..errors import FastmaeError

SETTINGS = {"ffn_gated": False, "linear_bias": True, "norm_bias": True, "first_attention_norm": True,
            "global_attention_every": 1}
"""The layer settings of every encoder of the lineage: a config that differs in one computes as none of them."""

POST_LN_LAYER = (("attn_out", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
                 ("ffn_in", "intermediate.dense"), ("ffn_out", "output.dense"), ("ffn_norm", "output.LayerNorm"))
LM_HEAD = {"head.dense": "lm_head.dense", "head.norm": "lm_head.layer_norm", "head.bias": "lm_head.bias"}
BERT_HEAD = {"head.dense": "cls.predictions.transform.dense", "head.norm": "cls.predictions.transform.LayerNorm",
             "head.bias": "cls.predictions.bias"}
_HEADLESS_ROOTS = ("lm_head.", "cls.")


@dataclass(frozen=True)
class Layout:
    """One architecture's names: `prefix` (its model_type), `layer` (fastmae module -> name under
    `encoder.layer.{i}.`), the embedding norm, the LM head's names, ESM's final norm, whether it has a token-type
    table, whether its position rows start after the pad id (RoBERTa's offset) or at 0 (BERT), and `qk_order` (the
    order of a query or key projection's output features, where its rotary positions pair features otherwise)."""

    prefix: str
    layer: tuple[tuple[str, str], ...] = POST_LN_LAYER
    embedding_norm: str = "LayerNorm"
    head: dict[str, str] = field(default_factory=lambda: LM_HEAD)
    final_norm: str | None = None
    token_types: bool = True
    positions_after_pad: bool = True
    qk_order: Callable[[ModelConfig], torch.Tensor] | None = None


def in_lineage(config: ModelConfig) -> bool:
    """Whether `config`'s layers are the lineage's (`SETTINGS`)."""
    return all(getattr(config, key) == value for key, value in SETTINGS.items())


def name_pairs(layout: Layout, config: ModelConfig, with_head: bool) -> list[tuple[str, str]]:
    """(fastmae name, Hugging Face name) of every 1:1 tensor; the fused qkv is `read`'s and `write`'s."""
    embeddings = f"{layout.prefix}.embeddings"
    pairs = [("embeddings.tokens.weight", f"{embeddings}.word_embeddings.weight")]
    pairs += [(f"embeddings.norm.{p}", f"{embeddings}.{layout.embedding_norm}.{p}") for p in ("weight", "bias")]
    if config.position_embedding == "learned":
        pairs.append(("embeddings.positions.weight", f"{embeddings}.position_embeddings.weight"))
    for i in range(config.encoder_layers):
        pairs += [(f"encoder.{i}.{ours}.{p}", f"{layout.prefix}.encoder.layer.{i}.{theirs}.{p}")
                  for ours, theirs in layout.layer for p in ("weight", "bias")]
    if layout.final_norm:
        pairs += [(f"encoder_norm.{p}", f"{layout.prefix}.encoder.{layout.final_norm}.{p}") for p in ("weight", "bias")]
    if with_head:
        pairs += [(f"{ours}.{p}", f"{layout.head[ours]}.{p}") for ours in ("head.dense", "head.norm")
                  for p in ("weight", "bias")]
        pairs.append(("head.bias", layout.head["head.bias"]))
    return pairs


def writes_head(config: ModelConfig, weights: dict[str, torch.Tensor]) -> bool:
    """Whether an export writes the LM head: k = 0 (the head trained on the encoder's states) and the weights hold
    one (a headless source, `BertModel` say, has none)."""
    return config.insert_layer == 0 and "head.dense.weight" in weights


def kept_tensors(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A source's tensors that fastmae's network does not compute but an export writes back as they were (a BERT's
    pooler, which sentence classifiers read), under `prefix`."""
    canonical = {_canonical(name, prefix): t for name, t in tensors.items()}
    return {name: t.float().contiguous() for name, t in canonical.items() if name.startswith(f"{prefix}.pooler.")}


def _qkv_names(layout: Layout, i: int) -> list[str]:
    return [f"{layout.prefix}.encoder.layer.{i}.attention.self.{p}" for p in ("query", "key", "value")]


def write(layout: Layout, config: ModelConfig, weights: dict[str, torch.Tensor],
          segment_row: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """fastmae weights -> the architecture's names (the LM head only for k = 0 and where the weights have one: a
    decoder's head is not the encoder's, a headless source has none). The token-type table is written as zeros and
    `segment_row`, so that a BERT's pairs compute as the original's; an architecture without the table refuses a segment
    row."""
    out = {theirs: weights[ours] for ours, theirs in name_pairs(layout, config, writes_head(config, weights))}
    if config.position_embedding == "learned" and not layout.positions_after_pad:  # BERT: rows from position 0
        positions = f"{layout.prefix}.embeddings.position_embeddings.weight"
        out[positions] = out[positions][config.position_offset:]
    for i in range(config.encoder_layers):
        for p in ("weight", "bias"):
            for name, part in zip(_qkv_names(layout, i), weights[f"encoder.{i}.qkv.{p}"].chunk(3)):
                reorder = layout.qk_order is not None and not name.endswith("value")
                out[f"{name}.{p}"] = part[layout.qk_order(config)] if reorder else part
    if layout.token_types:
        second = torch.zeros(config.hidden_size) if segment_row is None else segment_row.float()
        out[f"{layout.prefix}.embeddings.token_type_embeddings.weight"] = torch.stack(
            [torch.zeros(config.hidden_size), second])
    elif segment_row is not None:
        raise FastmaeError(f"a second-segment embedding cannot be written to {layout.prefix}, which has no token-type "
                           "table")
    return out


def _canonical(name: str, prefix: str) -> str:
    """A Hugging Face tensor name with its architecture's prefix, and LayerNorm's legacy `gamma` / `beta` (older BERT
    checkpoints; ESM as transformers 5 saves it) as `weight` / `bias`."""
    name = name if name.startswith((f"{prefix}.", *_HEADLESS_ROOTS)) else f"{prefix}.{name}"
    for legacy, current in ((".gamma", ".weight"), (".beta", ".bias")):
        if name.endswith(legacy) and "LayerNorm" in name:
            return name[:-len(legacy)] + current
    return name


def read(layout: Layout, config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path
         ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(fastmae weights, `segment_row`) of the architecture's tensors (with or without its prefix; masked-LM or base
    model), the inverse of `write`. A token-type table's first row is folded in (module doc); BERT's position rows,
    counted from row 0, move behind fastmae's pad offset. Raises FastmaeError naming the first missing tensor."""
    tensors = {_canonical(name, layout.prefix): t for name, t in tensors.items()}

    def get(name):
        if name not in tensors:
            raise FastmaeError(f"{source}: missing tensor {name}")
        return tensors[name]

    with_head = f"{layout.head['head.dense']}.weight" in tensors
    weights = {ours: get(theirs) for ours, theirs in name_pairs(layout, config, with_head)}
    for i in range(config.encoder_layers):
        for p in ("weight", "bias"):
            query, key, value = (get(f"{name}.{p}") for name in _qkv_names(layout, i))
            if layout.qk_order is not None:
                order = torch.argsort(layout.qk_order(config))
                query, key = query[order], key[order]
            weights[f"encoder.{i}.qkv.{p}"] = torch.cat([query, key, value])
    types = tensors.get(f"{layout.prefix}.embeddings.token_type_embeddings.weight")
    folded = torch.zeros(config.hidden_size) if types is None else types[0].float()
    if config.position_embedding == "learned":
        rows = weights["embeddings.positions.weight"]
        shift = config.position_capacity + config.position_offset - rows.shape[0]
        weights["embeddings.positions.weight"] = torch.cat([rows.new_zeros(shift, rows.shape[1]), rows]) + folded
    else:
        weights["embeddings.tokens.weight"] = weights["embeddings.tokens.weight"] + folded
    return weights, segment_row(types)


def segment_row(token_types: torch.Tensor | None) -> torch.Tensor | None:
    """[H]: a token-type table's second row less its first (the first is folded into the positions), or None where
    there is no second row or it equals the first. fastmae's encoder computes no segments: `Pretrained.segment_row`
    carries it to export, and fine-tuning refuses pair tasks while a model has one."""
    if token_types is None or token_types.shape[0] < 2:
        return None
    difference = (token_types[1] - token_types[0]).float()
    return difference if difference.abs().max() > 0 else None


def require(hf: dict, source: Path, name: str, key: str, allowed: tuple, default=None) -> None:
    """Refuse a config.json whose `key` (absent: `default`) is not one of `allowed`, naming the file, key and value."""
    if hf.get(key, default) not in allowed:
        raise FastmaeError(f"{source / 'config.json'}: {key}={hf.get(key, default)!r}: fastmae's {name} reader "
                           f"needs {' or '.join(map(repr, allowed))}")


def model_config(layout: Layout, hf: dict, special: SpecialTokens, source: Path, name: str,
                 **fields) -> ModelConfig:
    """The ModelConfig (objective mlm) of a lineage encoder's config.json `hf`, with its tokenizer's `special` ids
    and the architecture's own `fields` (positions, norm placement). Refuses another activation, a pad id the
    tokenizer does not have, and missing sizes, naming the file and field."""
    where = source / "config.json"
    require(hf, source, name, "hidden_act", ("gelu",), "gelu")
    if hf.get("pad_token_id", special.pad) != special.pad:
        raise FastmaeError(f"{where}: pad_token_id={hf['pad_token_id']} but the tokenizer's pad token is "
                           f"{special.pad}: positions are counted from the pad id, so they must agree")
    missing = [key for key in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                               "num_hidden_layers", "max_position_embeddings") if not isinstance(hf.get(key), int)]
    if missing:
        raise FastmaeError(f"{where}: no whole-number {', '.join(missing)}")
    offset = special.pad + 1 if layout.positions_after_pad else 0  # the first position's row in the source's table
    try:
        return ModelConfig.preset(
            "mlm", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], encoder_layers=hf["num_hidden_layers"],
            max_seq_len=hf["max_position_embeddings"] - offset, layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            dropout=hf.get("hidden_dropout_prob", 0.1), attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            initializer_range=hf.get("initializer_range", 0.02), **special.as_fields(), **fields)
    except FastmaeError as err:
        raise FastmaeError(f"{where}: {err}") from None



def learned_post_ln_config(layout: Layout, hf: dict, special: SpecialTokens, source: Path, name: str) -> ModelConfig:
    """`model_config` of RoBERTa's and BERT's layers: post-LN, learned absolute positions (another kind refused)."""
    require(hf, source, name, "position_embedding_type", ("absolute",), "absolute")
    return model_config(layout, hf, special, source, name, position_embedding="learned", norm_position="post")

def config_fields(config: ModelConfig) -> dict:
    """The config.json fields every lineage architecture's config class takes, from fastmae's config."""
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.encoder_layers,
                num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
                hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.attention_dropout,
                max_position_embeddings=config.position_capacity + config.position_offset,
                initializer_range=config.initializer_range, layer_norm_eps=config.layer_norm_eps,
                pad_token_id=config.pad_token_id)


def masked_lm(config: ModelConfig, masked_lm_class: str, base_class: str) -> list[str]:
    """config.json's `architectures`: the masked-LM class where the export has the head trained with the encoder
    (k = 0), else the base model."""
    return [masked_lm_class if config.insert_layer == 0 else base_class]
