"""A pretrained encoder, from wherever it lives: a run directory, one of its checkpoints, a fastmae export, or a
Hugging Face encoder fastmae did not write.

    RUN/                         config.yaml, model.safetensors (end of run), its tokenizer's files, checkpoints/stepN/
    RUN/checkpoints/stepN/       COMPLETE, model.safetensors (fp32 master weights of step N)
    RUN/eval_weights/stepN/      the same, kept at the evaluation of step N (eval.keep_weights)
    EXPORT/                      config.json (+ fastmae_model_config), model.safetensors, tokenizer files
    HF_MODEL/                    config.json (RoBERTa, BERT, RoFormer, ESM-2, ModernBERT), weights, tokenizer
`export`, `finetune`, `analyze`, `glue` and `train.init_from` all start from `load_pretrained`; the weights are fp32
with fastmae's names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from .atomic import atomic_path
from .checkpoint import WEIGHTS, complete_checkpoints, read_weights, saved_model_config, weights_metadata
from .config import ModelConfig, RunConfig, SpecialTokens
from .data.tokenizer import Tokenizer, has_tokenizer, load_tokenizer
from .errors import FastmaeError
from .hf import CONFIG_KEY, Origin, read_export, read_foreign
from .hf.files import config_json
from .model import MaskedLM


@dataclass
class Pretrained:
    """config and fp32 weights (fastmae names) of a pretrained model, the tokenizer it was trained with, and where
    they came from (`weights_file`, `step`, and `foreign`: the Hugging Face architecture of an encoder fastmae did
    not train, else empty)."""

    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    weights_file: Path
    step: int
    foreign: str = ""
    # what a Hugging Face source had beside what fastmae computes (a BERT's architecture, token-type rows and pooler),
    # carried through continued runs and exports so that export writes it back; empty for fastmae's own models
    origin: Origin = dataclasses.field(default_factory=Origin)

    @property
    def segment_row(self) -> torch.Tensor | None:
        """[H]: the source's second-segment embedding less its first, which fastmae's encoder does not compute:
        export writes it back, fine-tuning refuses pair tasks (`refuse_pairs`); None for the rest."""
        return self.origin.segment_row

    def describe(self) -> str:
        """The source in words, as the training log names it."""
        if self.foreign:
            return f"the Hugging Face {self.foreign} encoder {self.weights_file}"
        return f"{self.weights_file} (step {self.step}, {self.config.objective})"

    def provenance(self, continued_as: ModelConfig) -> dict:
        """Where these weights came from, as run_info.json and the model card name it, and the positions a run
        continued from them as `continued_as` changed (`positions_note`)."""
        return {"weights": str(self.weights_file), "step": self.step, "objective": self.config.objective,
                "foreign": self.foreign, "positions": positions_note(continued_as, self.config)}

    def refuse_pairs(self, task: str, pair: bool) -> None:
        """A FastmaeError where fine-tuning this model on a pair task would drop the segment embedding it was trained
        with (`segment_row`): the comparison with the original would handicap it."""
        if pair and self.segment_row is not None:
            raise FastmaeError(
                f"{self.weights_file}: {task} is a pair task, and this {self.foreign or 'model'} adds a second-segment "
                "(token-type) embedding to a pair's second sentence, which fastmae's encoder does not compute: "
                "fine-tuned here it would run without it, handicapped against the original. fastmae fine-tunes it on "
                "single-sentence tasks (SST-2, CoLA); `fastmae export` keeps the embedding for transformers")

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


SOURCE_MARKERS = {"export": "config.json", "checkpoint": "COMPLETE", "run": "config.yaml"}
"""Each kind of model directory and the file that marks it, in the order they are told apart (a config.json without
fastmae's own config in it marks a `foreign` Hugging Face encoder)."""


def source_kind(path: Path) -> str:
    """What a model directory is, told once from the file that marks it: `export` (config.json with fastmae's config),
    `foreign` (another config.json), `checkpoint` (COMPLETE) or `run` (config.yaml); errors name the path and what was
    looked for."""
    if not path.is_dir():
        raise FastmaeError(f"{path}: no such directory (expected a run, checkpoint, exported or Hugging Face model "
                           "directory)")
    for kind, marker in SOURCE_MARKERS.items():
        if (path / marker).is_file():
            return kind if kind != "export" or CONFIG_KEY in config_json(path) else "foreign"
    raise FastmaeError(f"{path}: not a fastmae run directory (no config.yaml), checkpoint directory (no COMPLETE) or "
                       "exported or Hugging Face model directory (no config.json)")


def read_exported(path: Path) -> Pretrained:
    """A directory written by `fastmae export`: its config.json, weights and tokenizer."""
    config, weights, step, origin = read_export(path)
    return Pretrained(config, weights, _tokenizer(path, "the export"), path / WEIGHTS, step, origin=origin)


def read_foreign_encoder(path: Path) -> Pretrained:
    """A Hugging Face encoder of an architecture `fastmae.hf` reads, with its tokenizer."""
    tokenizer = _tokenizer(path, "the model directory")
    config, weights, origin = read_foreign(path, tokenizer.special)
    weights_file = path / WEIGHTS if (path / WEIGHTS).is_file() else path  # sharded or pytorch_model.bin: the directory
    return Pretrained(config, weights, tokenizer, weights_file, 0, origin.name, origin)


def read_checkpoint(path: Path) -> Pretrained:
    """One complete checkpoint of a run: its fp32 weights, and the run's tokenizer."""
    weights_file = path / WEIGHTS
    if not weights_file.is_file():
        raise FastmaeError(f"{path}: checkpoint without {WEIGHTS} (written by an older fastmae); resume the run for a "
                           "step and checkpoint again")
    weights, config_dict, step = read_weights(weights_file)
    return Pretrained(saved_model_config(config_dict, weights_file), weights, _run_tokenizer(path.parent.parent),
                      weights_file, step, origin=read_origin(path.parent.parent))


def read_run(path: Path) -> Pretrained:
    """A run directory: its newest weights (the end-of-run file or a later checkpoint) and its tokenizer."""
    weights_file, step = _newest_weights(path)
    weights, config_dict, _ = read_weights(weights_file)
    return Pretrained(saved_model_config(config_dict, weights_file), weights, _run_tokenizer(path), weights_file,
                      step, origin=read_origin(path))


ORIGIN = "origin.safetensors"
"""RUN/origin.safetensors: the `Origin` of the source a run was continued from (train.init_from), where it had one."""


def write_origin(run_dir: Path, origin: Origin) -> None:
    """Keep a continued run's source origin in its directory, for its exports (nothing for an origin-less source)."""
    if not origin.name:
        return
    from safetensors.torch import save_file

    tensors = {**origin.kept, **({"segment_row": origin.segment_row} if origin.segment_row is not None else {})}
    run_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(run_dir / ORIGIN) as tmp:
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp), metadata={"architecture": origin.name})


def read_origin(run_dir: Path) -> Origin:
    """The origin `write_origin` kept in a run directory (empty without one)."""
    path = run_dir / ORIGIN
    if not path.is_file():
        return Origin()
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        name = handle.metadata()["architecture"]
    return Origin(name, tensors.pop("segment_row", None), tensors)


MODEL_HELP = ("a fastmae run, checkpoint or export directory, or a Hugging Face RoBERTa, BERT, ModernBERT, ESM "
              "(ESM-2's layers with token_dropout off and an embedding LayerNorm; the released ESM-2 checkpoints have "
              "neither) or RoFormer directory")
"""What the commands that take a model (`--model`) accept: every kind `load_pretrained` reads."""

READERS = {"export": read_exported, "foreign": read_foreign_encoder, "checkpoint": read_checkpoint, "run": read_run}


def load_pretrained(path: str | Path) -> Pretrained:
    """Read a run directory, a checkpoint directory, a `fastmae export` or a Hugging Face encoder (`source_kind` tells
    which; one reader per kind), then check that the tokenizer and the embedding fit the model. Errors name the path
    and what is wrong."""
    path = Path(path)
    pretrained = READERS[source_kind(path)](path)
    config, tokenizer, weights_file = pretrained.config, pretrained.tokenizer, pretrained.weights_file
    if tokenizer.vocab_size != config.vocab_size:
        raise FastmaeError(f"{tokenizer.source}: {tokenizer.vocab_size} tokens, but {weights_file} was trained with "
                           f"vocab_size {config.vocab_size}: the tokenizer is from another dataset")
    if tokenizer.special != config.special_tokens:
        raise FastmaeError(f"{tokenizer.source}: special token ids {tokenizer.special.as_dict()}, but {weights_file} "
                           f"was trained with {config.special_tokens.as_dict()}: the tokenizer is from another dataset")
    rows = pretrained.weights.get("embeddings.tokens.weight")
    if rows is not None and rows.shape[0] != config.vocab_size:
        raise FastmaeError(f"{weights_file}: token embedding has {rows.shape[0]} rows, vocab_size is "
                           f"{config.vocab_size}")
    return pretrained


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
    if has_tokenizer(run_dir):
        return load_tokenizer(run_dir)
    data_path = None
    if (run_dir / "config.yaml").is_file():
        data_path = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("data", {}).get("path")
    if data_path is None:
        raise FastmaeError(f"{run_dir}: no tokenizer and no data.path in config.yaml to find one")
    return _tokenizer(Path(data_path), f"{run_dir}'s dataset")


def _tokenizer(directory: Path, what: str) -> Tokenizer:
    if not has_tokenizer(directory):
        raise FastmaeError(f"{directory}: {what} has no tokenizer (tokenizer.model or tokenizer.json)")
    return load_tokenizer(directory)


# ------------------------------------------------------------------------------------------ continued pretraining
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "encoder_layers", "max_seq_len",
                "max_positions", "position_embedding", "rotary_base", "relative_attention_bias",
                "relative_attention_buckets", "relative_attention_max_distance", "norm_position", "layer_norm_eps",
                "ffn_gated", "linear_bias", "norm_bias", "first_attention_norm", "global_attention_every",
                "local_window", "local_rotary_base", *SpecialTokens().as_fields())
"""The encoder's shape and its tokenizer's special ids: what a continued run (train.init_from) takes from its
source."""
ROTARY_BASES = ("rotary_base", "local_rotary_base")


def continued(config: RunConfig) -> tuple[RunConfig, Pretrained | None]:
    """`config` with the encoder's shape of its train.init_from source, and that source (None without one). Refused,
    naming both values: a model field the config sets itself to another value than the source's (but max_seq_len:
    the positions the source holds are kept, a table of learned positions grown past them; and rotary positions'
    bases), and a dataset tokenised with another tokenizer than the source's."""
    if not config.train.init_from:
        return config, None
    source = load_pretrained(config.train.init_from)
    where = f"train.init_from={config.train.init_from}"
    data = config.data.directory
    if has_tokenizer(data) and load_tokenizer(data).sha256 != source.tokenizer.sha256:
        raise FastmaeError(f"data.path={config.data.path} was tokenised with {load_tokenizer(data).source}, not the "
                           f"tokenizer of {where} ({source.tokenizer.source}): prepare the data with `fastmae prepare "
                           f"--tokenizer {config.train.init_from}`")
    shape = {name: getattr(source.config, name) for name in SHAPE_FIELDS}
    if "max_seq_len" in config.model_given:  # any length, the positions the source holds kept
        held, length = source.config.position_capacity, config.model.max_seq_len
        shape["max_seq_len"], shape["max_positions"] = length, held if length < held else 0  # longer: a table grows
    if source.config.position_embedding == "rotary":  # nor on the bases: a context extension raises them
        shape.update({name: getattr(config.model, name) for name in ROTARY_BASES if name in config.model_given})
    for name in SHAPE_FIELDS:
        mine, theirs = getattr(config.model, name), shape[name]
        if name in config.model_given and mine != theirs:
            raise FastmaeError(f"model.{name}={mine!r} but {where} is a model with {name}={theirs!r}: a continued "
                               f"run keeps its source's shape (drop model.{name} from the config file and overrides)")
    # the preset again on the source's shape, so that what it derives from the shape (insert_layer = L) follows
    given = {name: getattr(config.model, name) for name in config.model_given if name not in SHAPE_FIELDS}
    return dataclasses.replace(config, model=ModelConfig.preset(config.model.objective, **given, **shape)), source


def positions_note(config: ModelConfig, source: ModelConfig) -> str:
    """What a continued run's log adds where its sequence length or rotary bases are not its source's ('' where
    none differs)."""
    notes = []
    if config.max_seq_len != source.max_seq_len:
        held = ""
        if config.position_embedding == "learned" and config.position_capacity > source.position_capacity:
            held = f" (learned positions from {source.position_capacity:,} on new)"
        elif config.position_capacity > config.max_seq_len:
            held = f" (its {config.position_capacity:,} positions kept)"
        notes.append(f"sequences up to {config.max_seq_len:,} tokens, the source's {source.max_seq_len:,}{held}")
    notes += [f"{name} {getattr(config, name):,g}, the source's {getattr(source, name):,g}" for name in ROTARY_BASES
              if getattr(config, name) != getattr(source, name)]
    return "".join(f"; {note}" for note in notes)


def initialise(model: MaskedLM, source: Pretrained, decoder: str = "new") -> list[str]:
    """Copy into `model` every weight of `source` it has under the same name and shape (the encoder, the LM head,
    and a decoder of the same depth and kind); with `decoder="top"`, a decoder the source lacks gets copies of the
    source encoder's top layers (decoder layer i <- encoder layer L - d + i) and the insertion's positions and
    LayerNorm those of the embeddings. A table of learned positions longer than the source's takes its rows first,
    its further rows left as initialised. Returns the names of the tensors it left wholly as initialised."""
    own = model.state_dict()
    weights = dict(source.weights)
    if decoder == "top":
        depth, layers = model.config.decoder_layers, source.config.encoder_layers
        renamed = {"insertion.positions.weight": "embeddings.positions.weight",
                   "insertion.norm.weight": "embeddings.norm.weight", "insertion.norm.bias": "embeddings.norm.bias"}
        for i in range(min(depth, layers)):
            top = layers - min(depth, layers) + i
            renamed.update({name: f"encoder.{top}.{name.split('.', 2)[2]}" for name in own
                            if name.startswith(f"decoder.{i}.")})
        for name, origin in renamed.items():
            if name not in weights and origin in source.weights:
                weights[name] = source.weights[origin]
    loaded = {k: v for k, v in weights.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(loaded, strict=False)
    grown = {k: v for k, v in weights.items() if k.endswith("positions.weight") and k in own
             and own[k].shape[1:] == v.shape[1:] and own[k].shape[0] > v.shape[0]}
    with torch.no_grad():
        for name, rows in grown.items():
            own[name][:rows.shape[0]].copy_(rows)
    return sorted(k for k in own if k not in loaded and k not in grown)
