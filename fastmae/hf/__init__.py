"""The Hugging Face format of an encoder, both ways: one module per architecture behind one registry
(`ARCHITECTURES`), which `fastmae export` writes with and `fastmae.pretrained` reads with.

    config.json             the architecture's config (+ `fastmae_model_config` in fastmae's exports)
    model.safetensors       fp32 weights under the architecture's names (or shards, or pytorch_model.bin: files.py)
    tokenizer.json ...      the tokenizer as a fast tokenizer: same ids, same specials (tokenizer.py)

An architecture's module (roberta.py, bert.py, roformer.py, esm.py, modernbert.py) holds its name table, its config
both ways and what it refuses, as these names:

    MODEL_TYPE, NAME                       config.json's model_type; how logs and model cards name it
    model_config(hf, special, source)      its config.json values -> fastmae's ModelConfig (objective mlm), refusing
                                           what fastmae's layers do not compute, naming the field and value
    read(config, tensors, source)          its tensors -> (fastmae weights, second-segment row or None)
    claims(config)                         whether fastmae exports `config` as this architecture (at most one does)
    export_refusal(config)                 why a claimed config cannot be written as it after all (None: it can)
    write(config, weights, segment_row)    fastmae weights -> its tensors (the LM head only for k = 0, where the
                                           weights have one)
    hugging_face_config(config, carried)   its PretrainedConfig, with `carried` (fastmae's config) inside

An architecture that claims nothing (BERT) writes only what came from it (`Origin`: a BERT comes back a BERT). Adding
one (EuroBERT, say) is a module with these names and its line in `ARCHITECTURES`; the BERT lineage's modules share
`classic.py`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

# each architecture by its full name (a module of this package; `from . import` reads as the package itself)
import fastmae.hf.bert as bert
import fastmae.hf.esm as esm
import fastmae.hf.modernbert as modernbert
import fastmae.hf.roberta as roberta
import fastmae.hf.roformer as roformer

from ..checkpoint import WEIGHTS, saved_model_config
from ..config import ModelConfig, SpecialTokens
from ..errors import FastmaeError
from .classic import kept_tensors
from .files import config_json, read_tensors

CONFIG_KEY = "fastmae_model_config"  # fastmae's ModelConfig inside config.json
ARCHITECTURES = (roberta, bert, roformer, esm, modernbert)
BY_MODEL_TYPE = {module.MODEL_TYPE: module for module in ARCHITECTURES}


BY_NAME = {module.NAME: module for module in ARCHITECTURES}


def export_architecture(config: ModelConfig, origin: str = ""):
    """The architecture module whose `transformers` model computes this encoder's function: the one it came from
    (`origin`, an architecture's NAME: a BERT comes back as a BERT) where that one can write it, else the one that
    claims it. Raises FastmaeError naming the setting that none expresses, and what would run it instead."""
    k, layers = config.insert_layer, config.encoder_layers
    if config.relative_attention_bias:
        raise FastmaeError("relative_attention_bias=true: no Hugging Face encoder adds MAE-LM's T5-style relative "
                           "bias to its attention; fine-tune this model with `fastmae finetune --model RUN_DIR`, or "
                           "train with relative_attention_bias=false to export")
    if 0 < k < layers:
        raise FastmaeError(f"insert_layer={k} (of {layers}): the insertion re-embeds positions and normalises inside "
                           "the encoder, which no Hugging Face encoder expresses; export needs k = 0 or k = "
                           "encoder_layers, `fastmae finetune --model RUN_DIR` runs this model as it is")
    own = BY_NAME.get(origin)
    if own is not None and hasattr(own, "write") and own.export_refusal(config) is None:
        return own
    claimed = [module for module in ARCHITECTURES if module.claims(config)]
    if len(claimed) != 1:
        raise FastmaeError(f"{len(claimed)} Hugging Face architectures claim this model "
                           f"({', '.join(m.NAME for m in claimed) or 'none'}); each config has one export")
    refusal = claimed[0].export_refusal(config)
    if refusal:
        raise FastmaeError(refusal)
    return claimed[0]


@dataclasses.dataclass
class Origin:
    """What an encoder's Hugging Face source had beside what fastmae's network computes, which its export writes
    back: the architecture (`name`, its NAME), the second segment's embedding less the first's (`segment_row`, [H],
    or None) and tensors kept as they were under the architecture's names (`kept`: a BERT's pooler)."""

    name: str = ""
    segment_row: torch.Tensor | None = None
    kept: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def to_hugging_face(config: ModelConfig, weights: dict[str, torch.Tensor],
                    origin: Origin | None = None) -> dict[str, torch.Tensor]:
    """fastmae weights -> the fp32 tensors of `export_architecture(config, origin.name)` under its names, with the
    origin's segment row (where the architecture has a token-type table) and its kept tensors."""
    origin = origin or Origin()
    module = export_architecture(config, origin.name)
    tensors = {**module.write(config, weights, origin.segment_row),
               **(origin.kept if module.NAME == origin.name else {})}
    return {name: t.float().contiguous() for name, t in tensors.items()}


def hugging_face_config(config: ModelConfig, origin: Origin | None = None, with_head: bool = True):
    """The exported encoder's PretrainedConfig, carrying fastmae's own config under `fastmae_model_config`; its
    `architectures` the base model where the export has no LM head."""
    hf = export_architecture(config, (origin or Origin()).name).hugging_face_config(
        config, {CONFIG_KEY: dataclasses.asdict(config)})
    if not with_head:
        hf.architectures = [name.replace("ForMaskedLM", "Model") for name in hf.architectures]
    return hf


def read_export(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], int, Origin]:
    """(model config, fastmae weights, step, origin) of a directory written by `fastmae export` (read as the
    architecture its config.json names)."""
    hf_config = config_json(directory)
    if CONFIG_KEY not in hf_config:
        raise FastmaeError(f"{directory / 'config.json'}: no {CONFIG_KEY} (not written by `fastmae export`)")
    config = saved_model_config(hf_config[CONFIG_KEY], directory / "config.json")
    tensors, metadata = read_tensors(directory)
    module = BY_MODEL_TYPE.get(hf_config.get("model_type")) or export_architecture(config)
    weights, segment_row = module.read(config, tensors, directory / WEIGHTS)
    origin = Origin(module.NAME, segment_row, kept_tensors(tensors, module.MODEL_TYPE))
    return config, weights, int(metadata.get("fastmae_step", -1)), origin


def read_foreign(directory: Path, special: SpecialTokens) -> tuple[ModelConfig, dict[str, torch.Tensor], Origin]:
    """(model config, fastmae weights, origin) of a Hugging Face encoder fastmae did not write (masked-LM or base
    model), `special` its tokenizer's ids. Refuses a model_type without a module here."""
    hf = config_json(directory)
    module = BY_MODEL_TYPE.get(hf.get("model_type"))
    if module is None:
        raise FastmaeError(f"{directory / 'config.json'}: model_type {hf.get('model_type')!r}: fastmae reads "
                           f"{', '.join(m.NAME for m in ARCHITECTURES)} encoders and its own exports")
    config = module.model_config(hf, special, directory)
    tensors, _ = read_tensors(directory)
    weights, segment_row = module.read(config, tensors, directory / WEIGHTS)
    origin = Origin(module.NAME, segment_row, kept_tensors(tensors, module.MODEL_TYPE))
    return config, {name: t.float().contiguous() for name, t in weights.items()}, origin
