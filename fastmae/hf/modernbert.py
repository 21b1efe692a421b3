"""ModernBERT (Warner et al. 2024; transformers' `ModernBertModel` / `ModernBertForMaskedLM`) both ways: its
config.json as a `ModelConfig` and back, its weights under fastmae's names and back (ARCHITECTURE.md section 7). The
export of every encoder with a setting outside the BERT lineage's (`classic.SETTINGS`).

The architecture, as transformers 5 computes it: token embedding -> LayerNorm -> dropout, no position embedding;
pre-LN layers, layer 0 without an attention norm, a final LayerNorm; fused Wqkv, GeGLU `Wi` [2I, H] (input, then
gate) and `Wo`; no biases in projections or norms by default; layer i global when i % global_attn_every_n_layers == 0,
else attending to the tokens within local_attention / 2 of its position, with a rotary base per kind; the MLM head
dense -> GELU -> LayerNorm, then the decoder tied to the token embedding, with a bias. Config keys are read both ways:
transformers 5's `layer_types` and `rope_parameters`, and the flat `global_attn_every_n_layers`,
`global_rope_theta` and `local_rope_theta` of the 2024-25 hub configs. What fastmae's layers do not compute is refused
naming the field and value.
"""

from __future__ import annotations

from pathlib import Path

import torch

import fastmae.hf.classic as classic

from ..config import ModelConfig, SpecialTokens
from ..errors import FastmaeError

MODEL_TYPE = "modernbert"
NAME = "ModernBERT"
KINDS = ("full_attention", "sliding_attention")  # transformers' layer_types: fastmae's global and local


def model_config(hf: dict, special: SpecialTokens, source: Path) -> ModelConfig:
    """The ModelConfig (objective mlm) of a ModernBERT config.json `hf` with its tokenizer's special ids."""
    where = source / "config.json"

    def refuse(key: str, why: str):
        raise FastmaeError(f"{where}: {key}={hf.get(key)!r}: {why}")

    missing = [key for key in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                               "num_hidden_layers") if not isinstance(hf.get(key), int)]
    if missing:
        raise FastmaeError(f"{where}: no whole-number {', '.join(missing)}")
    if hf.get("hidden_activation", "gelu") != "gelu":
        refuse("hidden_activation", "fastmae's ModernBERT layers compute the erf GELU ('gelu') only")
    if not hf.get("tie_word_embeddings", True):
        refuse("tie_word_embeddings", "fastmae ties the MLM decoder to the token embedding")
    biases = {key: bool(hf.get(key, False)) for key in ("attention_bias", "mlp_bias", "classifier_bias")}
    if len(set(biases.values())) > 1:
        refuse("attention_bias", f"fastmae has one switch for the projections' biases, and {biases} differ")
    window = hf.get("local_attention", 128)
    if not isinstance(window, int) or window < 2 or window % 2:
        refuse("local_attention", "fastmae's local layers take an even window of at least 2 tokens")
    if hf.get("pad_token_id", special.pad) != special.pad:
        refuse("pad_token_id", f"the tokenizer's pad token is {special.pad}")
    every, global_base, local_base = _attention_pattern(hf, refuse)
    fields = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
                  intermediate_size=hf["intermediate_size"], encoder_layers=hf["num_hidden_layers"],
                  max_seq_len=hf.get("max_position_embeddings", 8192), position_embedding="rotary",
                  rotary_base=global_base, local_rotary_base=local_base, global_attention_every=every,
                  local_window=window, norm_position="pre", first_attention_norm=False, ffn_gated=True,
                  linear_bias=biases["attention_bias"], norm_bias=bool(hf.get("norm_bias", False)),
                  layer_norm_eps=hf.get("norm_eps", 1e-5), dropout=hf.get("mlp_dropout", 0.0),
                  attention_dropout=hf.get("attention_dropout", 0.0),
                  initializer_range=hf.get("initializer_range", 0.02), **special.as_fields())
    try:
        return ModelConfig.preset("mlm", **fields)
    except FastmaeError as err:
        raise FastmaeError(f"{where}: {err}") from None


def _attention_pattern(hf: dict, refuse) -> tuple[int, float, float]:
    """(global_attention_every, global rotary base, local rotary base) from either form of the config."""
    layers = hf["num_hidden_layers"]
    every = hf.get("global_attn_every_n_layers", 3)
    if not isinstance(every, int) or every < 1:
        refuse("global_attn_every_n_layers", "must be a whole number >= 1")
    kinds = hf.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - set(KINDS):
            refuse("layer_types", f"expected {layers} entries of {sorted(KINDS)}")
        expected = ["full_attention" if i % every == 0 else "sliding_attention" for i in range(layers)]
        if kinds != expected:
            refuse("layer_types", f"fastmae's layers alternate as global_attn_every_n_layers={every} gives: "
                                  f"{expected}")
    bases = {"full_attention": hf.get("global_rope_theta", 160000.0),
             "sliding_attention": hf.get("local_rope_theta", 10000.0)}
    for kind, values in (hf.get("rope_parameters") or {}).items():
        if kind not in KINDS or not isinstance(values, dict):
            refuse("rope_parameters", f"expected one entry per kind of {sorted(KINDS)}")
        if values.get("rope_type", "default") != "default":
            refuse("rope_parameters", f"{kind}'s rope_type {values.get('rope_type')!r}: fastmae computes 'default'")
        bases[kind] = values.get("rope_theta", bases[kind])
    return every, float(bases["full_attention"]), float(bases["sliding_attention"])


def _name_pairs(config: ModelConfig, with_head: bool) -> list[tuple[str, str]]:
    """(fastmae name, ModernBERT name) of every tensor, both ways: the encoder's under ModernBertModel's names (the
    masked-LM model prefixes them with `model.`), and with the head its dense layer, norm and decoder bias (the
    decoder's weight is the token embedding, tied)."""
    names = [("embeddings.tokens.weight", "embeddings.tok_embeddings.weight"),
             ("embeddings.norm.weight", "embeddings.norm.weight"), ("encoder_norm.weight", "final_norm.weight")]
    for i in range(config.encoder_layers):
        ours, theirs = f"encoder.{i}", f"layers.{i}"
        names += [(f"{ours}.qkv.weight", f"{theirs}.attn.Wqkv.weight"),
                  (f"{ours}.attn_out.weight", f"{theirs}.attn.Wo.weight"),
                  (f"{ours}.ffn_norm.weight", f"{theirs}.mlp_norm.weight"),
                  (f"{ours}.ffn_in.weight", f"{theirs}.mlp.Wi.weight"),
                  (f"{ours}.ffn_out.weight", f"{theirs}.mlp.Wo.weight")]
        if i > 0:
            names.append((f"{ours}.attn_norm.weight", f"{theirs}.attn_norm.weight"))
    if with_head:
        names += [("head.dense.weight", "head.dense.weight"), ("head.norm.weight", "head.norm.weight")]
    biased = [(ours, theirs) for ours, theirs in names if not ours.startswith("embeddings.tokens")
              and (config.norm_bias if "norm" in ours else config.linear_bias)]
    names += [(ours.replace(".weight", ".bias"), theirs.replace(".weight", ".bias")) for ours, theirs in biased]
    return names + ([("head.bias", "decoder.bias")] if with_head else [])


def read(config: ModelConfig, tensors: dict[str, torch.Tensor], source: Path
         ) -> tuple[dict[str, torch.Tensor], None]:
    """(fastmae weights, no segment row) of ModernBERT's tensors (with or without the `model.` prefix; the MLM head
    where present). A missing decoder bias is zeros. Raises FastmaeError naming the first missing tensor."""
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
    with_head = "head.dense.weight" in tensors
    out = {"head.bias": torch.zeros(config.vocab_size)} if with_head else {}
    for ours, theirs in _name_pairs(config, with_head):
        if theirs in tensors:
            out[ours] = tensors[theirs]
        elif theirs != "decoder.bias":
            raise FastmaeError(f"{source}: no tensor {theirs} (nor model.{theirs}) in a ModernBERT checkpoint")
    return out, None


def write(config: ModelConfig, weights: dict[str, torch.Tensor], segment_row: torch.Tensor | None
          ) -> dict[str, torch.Tensor]:
    """fastmae weights -> ModernBertForMaskedLM's names (k = 0: the head trained with the encoder), or
    ModernBertModel's (k = L: the decoder's head is not the encoder's). ModernBERT has no token types: a segment row
    is refused."""
    if segment_row is not None:
        raise FastmaeError("a second-segment embedding cannot be written to ModernBERT, which has no token-type table")
    with_head = classic.writes_head(config, weights)
    prefix = "model." if with_head else ""
    return {(theirs if theirs.startswith(("head.", "decoder.")) else prefix + theirs): weights[ours].contiguous()
            for ours, theirs in _name_pairs(config, with_head)}


def modern_settings(config: ModelConfig) -> list[str]:
    """The settings of `config` outside the BERT lineage's, which among Hugging Face encoders only ModernBERT
    computes."""
    return [f"{key}={getattr(config, key)!r}" for key, value in classic.SETTINGS.items()
            if getattr(config, key) != value]


def claims(config: ModelConfig) -> bool:
    """Whether this is the architecture `config` exports as."""
    return bool(modern_settings(config))


def export_refusal(config: ModelConfig) -> str | None:
    """Why a config this architecture claims cannot be written as it (None: it can)."""
    problems = shape_problems(config)
    if not problems:
        return None
    return (f"{', '.join(modern_settings(config))}: among Hugging Face encoders only ModernBERT computes these, and "
            f"this model differs from it in {', '.join(problems)}; `fastmae finetune --model RUN_DIR` runs it as it "
            "is")


def shape_problems(config: ModelConfig) -> list[str]:
    """What keeps `config` from computing as transformers' ModernBERT (empty when it does)."""
    wanted = {"norm_position": "pre", "position_embedding": "rotary", "ffn_gated": True,
              "first_attention_norm": False}
    return [f"{key}={getattr(config, key)!r} (ModernBERT: {value!r})" for key, value in wanted.items()
            if getattr(config, key) != value]


def hugging_face_config(config: ModelConfig, carried: dict):
    """The ModernBertConfig of the export (transformers 5 writes both key forms), carrying `carried` (fastmae's own
    config)."""
    from transformers import ModernBertConfig

    bias, dropout = config.linear_bias, config.dropout
    return ModernBertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.encoder_layers, num_attention_heads=config.num_heads, hidden_activation="gelu",
        max_position_embeddings=config.position_capacity, initializer_range=config.initializer_range,
        norm_eps=config.layer_norm_eps, norm_bias=config.norm_bias, attention_bias=bias, mlp_bias=bias,
        classifier_bias=bias, global_attn_every_n_layers=config.global_attention_every,
        local_attention=config.local_window or 128, global_rope_theta=config.rotary_base,
        local_rope_theta=config.local_rotary_base, embedding_dropout=dropout, mlp_dropout=dropout,
        attention_dropout=config.attention_dropout, pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, cls_token_id=config.bos_token_id,
        sep_token_id=config.eos_token_id, decoder_bias=True, tie_word_embeddings=True,
        architectures=classic.masked_lm(config, "ModernBertForMaskedLM", "ModernBertModel"), **carried)
