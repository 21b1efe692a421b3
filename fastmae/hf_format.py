"""The Hugging Face format of a fastmae encoder, both ways: one module that `fastmae export` writes with and
`fastmae.pretrained` reads with. Post-LN encoders are RoBERTa (learned positions) or RoFormer (rotary); pre-LN ones
(rotary or learned positions) are ESM-2, whose layers compute the same function (`hugging_face_architecture`).

    config.json             RobertaConfig, RoFormerConfig or EsmConfig (+ `fastmae_model_config`)
    model.safetensors       fp32 weights under Hugging Face's names (the LM head too for `mlm`)
    tokenizer.json ...      the tokenizer as a fast tokenizer: same ids, same specials

The mapping is one table (`_name_pairs`) read both ways; fastmae's fused `qkv` projection is the row-wise
concatenation of Hugging Face's query, key and value (kept fused: one GEMM instead of three in every layer). The same
table reads encoders fastmae did not write (`foreign_model_config`, `read_foreign`): RoBERTa, BERT (its
position rows shifted behind fastmae's pad offset), ESM-2 and RoFormer, each token-type embedding's first row folded
in (fastmae has no token types).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from . import hf_modernbert
from .checkpoint import WEIGHTS, saved_model_config
from .config import ModelConfig, SpecialTokens
from .data.tokenizer import SentencePieceTokenizer
from .errors import FastmaeError
from .hf_files import config_json, read_tensors
from .positions import rotary_inverse_frequencies

CONFIG_KEY = "fastmae_model_config"  # fastmae's ModelConfig inside config.json


def hugging_face_architecture(config: ModelConfig) -> str:
    """The `transformers` architecture that computes this encoder's function: `roberta` (post-LN, learned positions),
    `roformer` (post-LN, rotary positions: RoFormer rotates interleaved pairs where fastmae rotates halves, so the
    export permutes each head's query and key features) or `esm` (ESM-2's pre-LN layers: LayerNorm after the
    embeddings, before each sub-layer and after the last layer, erf GELU, query scaled before rotate-half rotary
    positions, or learned ones offset as RoBERTa's). Raises FastmaeError naming the setting that none expresses, and
    what would export."""
    k, layers = config.insert_layer, config.encoder_layers
    if config.relative_attention_bias:
        raise FastmaeError("relative_attention_bias=true: no Hugging Face encoder adds MAE-LM's T5-style relative "
                           "bias to its attention; fine-tune this model with `fastmae finetune --model RUN_DIR`, or "
                           "train with relative_attention_bias=false to export")
    if 0 < k < layers:
        raise FastmaeError(f"insert_layer={k} (of {layers}): the insertion re-embeds positions and normalises inside "
                           "the encoder, which no Hugging Face encoder expresses; export needs k = 0 or k = "
                           "encoder_layers, `fastmae finetune --model RUN_DIR` runs this model as it is")
    if hf_modernbert.modern_settings(config):
        problems = hf_modernbert.shape_problems(config)
        if problems:
            raise FastmaeError(f"{', '.join(hf_modernbert.modern_settings(config))}: among Hugging Face encoders "
                               f"only ModernBERT computes these, and this model differs from it in "
                               f"{', '.join(problems)}; `fastmae finetune --model RUN_DIR` runs it as it is")
        return "modernbert"
    if config.norm_position == "pre":
        return "esm"
    if config.position_embedding == "learned":
        return "roberta"
    if config.rotary_base != 10000.0:
        raise FastmaeError(f"rotary_base={config.rotary_base:g} with norm_position='post': RoFormer, the post-LN "
                           "encoder with rotary positions, has base 10000 only; pre-LN models export with any base "
                           "(as ESM-2); fine-tune this one with `fastmae finetune --model RUN_DIR`")
    return "roformer"


# fastmae's per-layer modules -> each architecture's names under `{prefix}encoder.layer.{i}.`
_POST_LN_LAYER = (("attn_out", "attention.output.dense"), ("attn_norm", "attention.output.LayerNorm"),
                  ("ffn_in", "intermediate.dense"), ("ffn_out", "output.dense"), ("ffn_norm", "output.LayerNorm"))
_LAYER_NAMES = {
    "roberta": _POST_LN_LAYER,
    "bert": _POST_LN_LAYER,
    "roformer": _POST_LN_LAYER,
    "esm": (("attn_out", "attention.output.dense"), ("attn_norm", "attention.LayerNorm"),
            ("ffn_in", "intermediate.dense"), ("ffn_out", "output.dense"), ("ffn_norm", "LayerNorm")),
}
_EMBEDDING_NORM = {"roberta": "LayerNorm", "bert": "LayerNorm", "roformer": "LayerNorm", "esm": "layer_norm"}
_HEAD_NAMES = {  # fastmae's LM head -> each architecture's
    "roberta": {"head.dense": "lm_head.dense", "head.norm": "lm_head.layer_norm", "head.bias": "lm_head.bias"},
    "esm": {"head.dense": "lm_head.dense", "head.norm": "lm_head.layer_norm", "head.bias": "lm_head.bias"},
    "roformer": {"head.dense": "cls.predictions.transform.dense", "head.norm": "cls.predictions.transform.LayerNorm",
                 "head.bias": "cls.predictions.bias"},
}
_HEAD_NAMES["bert"] = _HEAD_NAMES["roformer"]
_HEADLESS_ROOTS = ("lm_head.", "cls.")


def _name_pairs(config: ModelConfig, with_head: bool, arch: str) -> list[tuple[str, str]]:
    """(fastmae name, Hugging Face name of architecture `arch`) of every 1:1 tensor; the fused qkv is handled by the
    callers."""
    embeddings = f"{arch}.embeddings"
    pairs = [("embeddings.tokens.weight", f"{embeddings}.word_embeddings.weight"),
             ("embeddings.norm.weight", f"{embeddings}.{_EMBEDDING_NORM[arch]}.weight"),
             ("embeddings.norm.bias", f"{embeddings}.{_EMBEDDING_NORM[arch]}.bias")]
    if config.position_embedding == "learned":
        pairs.append(("embeddings.positions.weight", f"{embeddings}.position_embeddings.weight"))
    for i in range(config.encoder_layers):
        pairs += [(f"encoder.{i}.{ours}.{p}", f"{arch}.encoder.layer.{i}.{theirs}.{p}")
                  for ours, theirs in _LAYER_NAMES[arch] for p in ("weight", "bias")]
    if arch == "esm":
        pairs += [(f"encoder_norm.{p}", f"esm.encoder.emb_layer_norm_after.{p}") for p in ("weight", "bias")]
    if with_head:
        head = _HEAD_NAMES[arch]
        pairs += [(f"{ours}.{p}", f"{head[ours]}.{p}") for ours in ("head.dense", "head.norm")
                  for p in ("weight", "bias")]
        pairs.append(("head.bias", head["head.bias"]))
    return pairs


def _interleaving(config: ModelConfig) -> torch.Tensor:
    """The order of a query or key projection's output features that makes RoFormer's rotation of interleaved pairs
    (features 2j, 2j + 1 of a head) fastmae's rotation of halves (features j, j + head_dim / 2)."""
    d = config.head_dim
    within = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], dim=1).reshape(-1)
    return torch.cat([head * d + within for head in range(config.num_heads)])


def _qkv_names(arch: str, i: int) -> tuple[str, list[str]]:
    return f"encoder.{i}.qkv", [f"{arch}.encoder.layer.{i}.attention.self.{p}" for p in ("query", "key", "value")]


def to_hugging_face(config: ModelConfig, weights: dict[str, torch.Tensor],
                    segment_row: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """fastmae weights -> Hugging Face names of `hugging_face_architecture`'s masked-LM model (the head only for
    k = 0, see the module doc). `segment_row` ([H]): a source's second-segment embedding less its first
    (`segment_row`), written as the second token-type row so that a BERT's pairs compute as the original's."""
    arch = hugging_face_architecture(config)
    if arch == "modernbert":
        return hf_modernbert.to_hugging_face(config, weights)
    out = {theirs: weights[ours] for ours, theirs in _name_pairs(config, config.insert_layer == 0, arch)}
    for i in range(config.encoder_layers):
        ours, theirs = _qkv_names(arch, i)
        for p in ("weight", "bias"):
            for name, part in zip(theirs, weights[f"{ours}.{p}"].chunk(3)):
                rotated = arch == "roformer" and not name.endswith("value")
                out[f"{name}.{p}"] = part[_interleaving(config)] if rotated else part
    if arch in ("roberta", "roformer"):  # row 0 is folded into the positions; a BERT tokenizer's pair segments index 1
        second = torch.zeros(config.hidden_size) if segment_row is None else segment_row.float()
        out[f"{arch}.embeddings.token_type_embeddings.weight"] = torch.stack([torch.zeros(config.hidden_size), second])
    elif segment_row is not None:
        raise FastmaeError(f"a second-segment embedding cannot be written to {arch}, which has no token-type table")
    if arch == "roformer":  # RoFormer's own table (written, so that loading leaves nothing to fill)
        from transformers.models.roformer.modeling_roformer import RoFormerSinusoidalPositionalEmbedding

        table = RoFormerSinusoidalPositionalEmbedding(config.max_seq_len + config.position_offset, config.head_dim)
        out["roformer.encoder.embed_positions.weight"] = table.create_weight()
    elif arch == "esm" and config.position_embedding == "rotary":
        # ESM's rotary buffer (written, so that loading leaves nothing to fill)
        out["esm.rotary_embeddings.inv_freq"] = rotary_inverse_frequencies(config.head_dim, config.rotary_base)
    return {name: t.float().contiguous() for name, t in out.items()}


def _canonical(name: str, arch: str) -> str:
    """A Hugging Face tensor name with its architecture's prefix, and LayerNorm's legacy `gamma` / `beta` (older BERT
    checkpoints; ESM as transformers 5 saves it) as `weight` / `bias`."""
    name = name if name.startswith((f"{arch}.", *_HEADLESS_ROOTS)) else f"{arch}.{name}"
    for legacy, current in ((".gamma", ".weight"), (".beta", ".bias")):
        if name.endswith(legacy) and "LayerNorm" in name:
            return name[:-len(legacy)] + current
    return name


def from_hugging_face(config: ModelConfig, hf: dict[str, torch.Tensor], source: Path,
                      arch: str | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face names of architecture `arch` (by default the one `to_hugging_face` writes; with or without the
    architecture's prefix) -> fastmae weights; the inverse of `to_hugging_face`. Raises FastmaeError naming the first
    missing tensor."""
    arch = arch or hugging_face_architecture(config)
    hf = {_canonical(name, arch): t for name, t in hf.items()}

    def get(name):
        if name not in hf:
            raise FastmaeError(f"{source}: missing tensor {name}")
        return hf[name]

    with_head = f"{_HEAD_NAMES[arch]['head.dense']}.weight" in hf
    weights = {ours: get(theirs) for ours, theirs in _name_pairs(config, with_head, arch)}
    order = torch.argsort(_interleaving(config))
    for i in range(config.encoder_layers):
        ours, theirs = _qkv_names(arch, i)
        for p in ("weight", "bias"):
            parts = [get(f"{name}.{p}") for name in theirs]
            if arch == "roformer":
                parts = [parts[0][order], parts[1][order], parts[2]]
            weights[f"{ours}.{p}"] = torch.cat(parts)
    return weights


def hugging_face_config(config: ModelConfig):
    """The RobertaConfig, RoFormerConfig, EsmConfig or ModernBertConfig of the exported encoder, carrying fastmae's
    own config under `fastmae_model_config`."""
    arch = hugging_face_architecture(config)
    if arch == "modernbert":
        return hf_modernbert.hugging_face_config(config, {CONFIG_KEY: dataclasses.asdict(config)})
    shared = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.encoder_layers,
        num_attention_heads=config.num_heads, intermediate_size=config.intermediate_size,
        hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.attention_dropout,
        max_position_embeddings=config.max_seq_len + config.position_offset,
        initializer_range=config.initializer_range, layer_norm_eps=config.layer_norm_eps,
        pad_token_id=config.pad_token_id, **{CONFIG_KEY: dataclasses.asdict(config)})
    head = config.insert_layer == 0
    if arch == "esm":
        from transformers import EsmConfig

        return EsmConfig(**shared, mask_token_id=config.mask_token_id, token_dropout=False,
                         emb_layer_norm_before=True, rope_theta=config.rotary_base,
                         position_embedding_type="rotary" if config.position_embedding == "rotary" else "absolute",
                         architectures=["EsmForMaskedLM" if head else "EsmModel"])
    if arch == "roformer":
        from transformers import RoFormerConfig

        return RoFormerConfig(**shared, embedding_size=config.hidden_size, hidden_act="gelu", type_vocab_size=2,
                              rotary_value=False, architectures=["RoFormerForMaskedLM" if head else "RoFormerModel"])
    from transformers import RobertaConfig

    return RobertaConfig(**shared, hidden_act="gelu", type_vocab_size=2, bos_token_id=config.bos_token_id,
                         eos_token_id=config.eos_token_id,
                         architectures=["RobertaForMaskedLM" if head else "RobertaModel"])


def hugging_face_tokenizer(tokenizer: SentencePieceTokenizer, max_seq_len: int):
    """A `PreTrainedTokenizerFast` that splits text exactly as a sentencepiece model fastmae trained does.

    sentencepiece's pipeline, stage by stage: its compiled normaliser (NFKC and whitespace rules), runs of spaces
    collapsed and the ends trimmed, a `▁` before every word, then its unigram or BPE model over each word.
    `<s> A </s>` and `<s> A </s></s> B </s>` frame sequences and pairs, as fastmae's data loader and fine-tuning do.
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE, Unigram
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.model_bytes)
    pieces = [(p.piece, p.score) for p in proto.pieces]
    special = [p.piece for p in proto.pieces if p.type != proto.SentencePiece.NORMAL]
    if proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM:
        model = Unigram(pieces, unk_id=proto.trainer_spec.unk_id, byte_fallback=False)
    elif proto.trainer_spec.model_type == proto.trainer_spec.BPE:
        vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
        model = BPE(vocab, generate_merges(vocab, pieces, skip_tokens=special),
                    unk_token=proto.trainer_spec.unk_piece, fuse_unk=True, byte_fallback=False)
    else:
        raise FastmaeError(f"{tokenizer.source}: sentencepiece model type {proto.trainer_spec.model_type} is neither "
                           "unigram nor BPE")
    rust = RustTokenizer(model)
    rust.normalizer = normalizers.Sequence([normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap),
                                            normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()])
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    rust.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    rust.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in special])
    name = tokenizer.sp.id_to_piece
    special = tokenizer.special
    bos, eos = name(special.bos), name(special.eos)
    rust.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, special.bos), (eos, special.eos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token=bos, eos_token=eos, cls_token=bos, sep_token=eos,
        unk_token=name(tokenizer.sp.unk_id()), pad_token=name(tokenizer.sp.pad_id()), mask_token="<mask>",
        model_max_length=max_seq_len, clean_up_tokenization_spaces=False)


def read_hugging_face(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], int, torch.Tensor | None]:
    """(model config, fastmae weights, step, `segment_row`) of a directory written by `fastmae export`."""
    hf_config = config_json(directory)
    if CONFIG_KEY not in hf_config:
        raise FastmaeError(f"{directory / 'config.json'}: no {CONFIG_KEY} (not written by `fastmae export`)")
    config = saved_model_config(hf_config[CONFIG_KEY], directory / "config.json")
    tensors, metadata = read_tensors(directory)
    arch = hugging_face_architecture(config)
    weights = (hf_modernbert.weights(config, tensors, directory) if arch == "modernbert"
               else from_hugging_face(config, tensors, directory / WEIGHTS))
    return (config, weights, int(metadata.get("fastmae_step", -1)),
            segment_row(tensors.get(f"{arch}.embeddings.token_type_embeddings.weight")))


def segment_row(token_types: torch.Tensor | None) -> torch.Tensor | None:
    """[H]: a token-type table's second row less its first (the first is folded into the positions), or None where
    there is no second row or it equals the first. fastmae's encoder computes no segments: `Pretrained.segment_row`
    carries it to export, and fine-tuning refuses pair tasks while a model has one."""
    if token_types is None or token_types.shape[0] < 2:
        return None
    difference = (token_types[1] - token_types[0]).float()
    return difference if difference.abs().max() > 0 else None


FOREIGN_ARCHITECTURES = {"roberta": "RoBERTa", "bert": "BERT", "esm": "ESM", "roformer": "RoFormer"}
"""The Hugging Face encoders fastmae reads (model_type in config.json -> name). ESM: with ESM-2's layers, token_dropout
off and an embedding LayerNorm (`foreign_model_config` refuses the rest, the released ESM-2 checkpoints among them)."""


def foreign_model_config(hf: dict, special: SpecialTokens, source: Path) -> ModelConfig:
    """The ModelConfig (objective mlm) of a Hugging Face encoder fastmae did not write, from its config.json values
    `hf` and its tokenizer's special ids. Refused, naming the field and what fastmae would need: a model type other
    than RoBERTa, BERT, ESM or RoFormer, and any setting fastmae's layers do not compute."""
    arch = hf.get("model_type")
    where = source / "config.json"
    if arch not in FOREIGN_ARCHITECTURES:
        raise FastmaeError(f"{where}: model_type {arch!r}: fastmae reads "
                           f"{', '.join(FOREIGN_ARCHITECTURES.values())}, ModernBERT encoders and its own exports")

    def refuse_unless(key: str, allowed: tuple, default=None):
        if hf.get(key, default) not in allowed:
            raise FastmaeError(f"{where}: {key}={hf.get(key, default)!r}: fastmae's {FOREIGN_ARCHITECTURES[arch]} "
                               f"reader needs {' or '.join(map(repr, allowed))}")

    refuse_unless("hidden_act", ("gelu",), "gelu")
    if arch == "esm":
        refuse_unless("emb_layer_norm_before", (True,))
        refuse_unless("token_dropout", (False,))
        refuse_unless("position_embedding_type", ("rotary", "absolute"), "absolute")
    else:
        refuse_unless("position_embedding_type", ("rotary",) if arch == "roformer" else ("absolute",),
                      "rotary" if arch == "roformer" else "absolute")
    if arch == "roformer":
        refuse_unless("rotary_value", (False,), False)
        refuse_unless("embedding_size", (hf.get("hidden_size"), None))
    if hf.get("pad_token_id", special.pad) != special.pad:
        raise FastmaeError(f"{where}: pad_token_id={hf['pad_token_id']} but the tokenizer's pad token is "
                           f"{special.pad}: positions are counted from the pad id, so they must agree")
    missing = [key for key in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size",
                               "num_hidden_layers", "max_position_embeddings") if not isinstance(hf.get(key), int)]
    if missing:
        raise FastmaeError(f"{where}: no whole-number {', '.join(missing)}")
    rotary = arch == "roformer" or hf.get("position_embedding_type") == "rotary"
    offset = 0 if arch == "bert" else special.pad + 1  # where the first position's row is in the source's table
    fields = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=hf["num_attention_heads"],
                  intermediate_size=hf["intermediate_size"], encoder_layers=hf["num_hidden_layers"],
                  max_seq_len=hf["max_position_embeddings"] - offset,
                  position_embedding="rotary" if rotary else "learned",
                  rotary_base=float(hf.get("rope_theta", 10000.0)) if arch == "esm" else 10000.0,
                  norm_position="pre" if arch == "esm" else "post", layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
                  dropout=hf.get("hidden_dropout_prob", 0.1),
                  attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                  initializer_range=hf.get("initializer_range", 0.02),
                  **special.as_fields())
    try:
        return ModelConfig.preset("mlm", **fields)
    except FastmaeError as err:
        raise FastmaeError(f"{where}: {err}") from None


def read_foreign(directory: Path, special: SpecialTokens
                 ) -> tuple[ModelConfig, dict[str, torch.Tensor], str, torch.Tensor | None]:
    """(model config, fastmae weights, architecture name, `segment_row`) of a Hugging Face RoBERTa, BERT, ESM or
    RoFormer directory (masked-LM or base model), `special` its tokenizer's ids. The first row of a token-type table
    is folded into the position rows (learned positions: exact) or into the token rows (RoFormer: the same hidden
    states; the tied LM head's logits then move by one constant per row, so its probabilities are the same); a
    second row that differs from it is returned apart."""
    hf = config_json(directory)
    config = foreign_model_config(hf, special, directory)
    arch = hf["model_type"]
    tensors, _ = read_tensors(directory)
    tensors = {_canonical(name, arch): t for name, t in tensors.items()}
    weights = from_hugging_face(config, tensors, directory / WEIGHTS, arch)
    types = tensors.get(f"{arch}.embeddings.token_type_embeddings.weight")
    folded = torch.zeros(config.hidden_size) if types is None else types[0].float()
    if config.position_embedding == "learned":
        rows = weights["embeddings.positions.weight"]
        shift = config.max_seq_len + config.position_offset - rows.shape[0]  # BERT counts positions from row 0
        weights["embeddings.positions.weight"] = torch.cat([rows.new_zeros(shift, rows.shape[1]), rows]) + folded
    else:
        weights["embeddings.tokens.weight"] = weights["embeddings.tokens.weight"] + folded
    return (config, {name: t.float().contiguous() for name, t in weights.items()}, FOREIGN_ARCHITECTURES[arch],
            segment_row(types))
