"""Model configuration: one dataclass for `mlm`, `mae-lm` and `3ml` (ARCHITECTURE.md section 1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

# Fixed special-token ids, shared by the tokenizer (data pipeline) and the model.
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
NUM_SPECIAL_TOKENS = 5
# Tokens that are never selected for prediction. `<unk>` is an ordinary (maskable) token, as in RoBERTa.
UNMASKABLE_IDS = (PAD_ID, BOS_ID, EOS_ID, MASK_ID)


@dataclass
class ModelConfig:
    """Architecture and masking objective of a `MaskedLM`.

    The unifying knob is `insert_layer` k: layers [0, k) run on visible tokens only, the insertion puts the
    masked slots back, and layers [k, encoder_layers + decoder_layers) run on the full sequence.
    """

    objective: str = "mlm"
    """Name of the preset this config came from (`mlm`, `mae-lm`, `3ml`); informational."""
    vocab_size: int = 32000
    """Rows of the token-embedding table, specials included (ids 0-4: pad, bos, eos, unk, mask)."""
    hidden_size: int = 768
    """Model width H."""
    num_heads: int = 12
    """Attention heads; `hidden_size` must be divisible by it."""
    intermediate_size: int = 0
    """Feed-forward width; 0 means 4 * hidden_size."""
    encoder_layers: int = 12
    """L: the layers kept for fine-tuning."""
    decoder_layers: int = 0
    """d: shallow decoder layers after the encoder, discarded after pretraining."""
    insert_layer: int = 0
    """k in [0, L]: where masked slots re-enter. 0 is RoBERTa MLM, L is MAE-LM / 3ML."""
    decoder_kind: str = "self"
    """`self`: decoder layers attend over the full sequence. `cross`: only masked rows are updated; their queries
    attend to the whole sequence (encoder outputs at visible rows). Needs insert_layer == encoder_layers."""
    max_seq_len: int = 512
    """Longest sequence, in tokens (specials included)."""
    position_embedding: str = "learned"
    """`learned` (RoBERTa absolute, exportable to Hugging Face) or `rotary` (applied by original position id)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies (only with position_embedding=rotary)."""
    relative_attention_bias: bool = False
    """T5-style relative position bias in the encoder's attention (MAE-LM's reference encoder): one table of
    [buckets, heads] shared by all encoder layers, looked up by original positions; the decoder has none."""
    relative_attention_buckets: int = 64
    """Buckets of the relative bias (per direction: a quarter exact, then log-spaced; the reference's bucketing,
    fastmae.attention.relative_position_buckets). The reference: 64 (base), 128 (large)."""
    relative_attention_max_distance: int = 128
    """Distances from max_distance - 1 on share the last bucket; the reference: 128 (base), 256 (large)."""
    norm_position: str = "post"
    """`post` (RoBERTa, BERT) or `pre` LayerNorm in each layer."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon everywhere."""
    dropout: float = 0.1
    """Hidden dropout in the encoder (and its embeddings)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities in the encoder."""
    decoder_dropout: float = 0.0
    """Hidden and attention dropout in the decoder (MAE-LM uses 0)."""
    mask_rate: float = 0.15
    """Share of maskable tokens predicted per sequence (exact count: round(rate * maskable))."""
    mask_token_prob: float = 0.8
    """Share of the predicted tokens whose input is removed / replaced by <mask>."""
    random_token_prob: float = 0.1
    """Share of the predicted tokens replaced by a random ordinary token (the rest keep their token)."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    pad_token_id: int = field(default=PAD_ID, init=False)
    mask_token_id: int = field(default=MASK_ID, init=False)

    def __post_init__(self):
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ValueError naming the first field with a bad value."""

        def bad(key, msg):
            raise ValueError(f"ModelConfig.{key}={getattr(self, key)!r}: {msg}")

        for key in ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "encoder_layers", "max_seq_len"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                bad(key, "must be a positive integer")
        if self.vocab_size <= NUM_SPECIAL_TOKENS:
            bad("vocab_size", f"must exceed the {NUM_SPECIAL_TOKENS} special tokens")
        if self.hidden_size % self.num_heads:
            bad("hidden_size", f"must be divisible by num_heads={self.num_heads}")
        if self.position_embedding == "rotary" and (self.hidden_size // self.num_heads) % 2:
            bad("num_heads", "rotary positions need an even head dimension")
        if not isinstance(self.decoder_layers, int) or self.decoder_layers < 0:
            bad("decoder_layers", "must be an integer >= 0")
        if not isinstance(self.insert_layer, int) or not 0 <= self.insert_layer <= self.encoder_layers:
            bad("insert_layer", f"must be in [0, encoder_layers={self.encoder_layers}]")
        if self.decoder_layers and self.insert_layer != self.encoder_layers:
            bad("decoder_layers", f"a decoder needs insert_layer == encoder_layers ({self.encoder_layers})")
        if self.decoder_kind not in ("self", "cross"):
            bad("decoder_kind", "must be 'self' or 'cross'")
        if self.decoder_kind == "cross" and self.decoder_layers == 0:
            bad("decoder_kind", "'cross' needs decoder_layers > 0")
        if self.removed_rows_see_no_context:
            raise ValueError(
                f"ModelConfig.insert_layer={self.insert_layer} with encoder_layers={self.encoder_layers} and "
                f"decoder_layers={self.decoder_layers}: no layer runs after the insertion, so every removed token "
                f"reaches the LM head as the same <mask> embedding and can learn only token frequencies; use "
                f"decoder_layers >= 1 or insert_layer < encoder_layers (or mask_rate=0 for an encoder that "
                f"predicts nothing)")
        if self.relative_attention_buckets < 4 or self.relative_attention_buckets % 2:
            bad("relative_attention_buckets", "must be an even number >= 4")
        if self.relative_attention_max_distance <= self.relative_attention_buckets // 4 + 1:
            bad("relative_attention_max_distance",
                "must exceed relative_attention_buckets / 4 + 1 (past the exact distances)")
        if self.position_embedding not in ("learned", "rotary"):
            bad("position_embedding", "must be 'learned' or 'rotary'")
        if self.norm_position not in ("post", "pre"):
            bad("norm_position", "must be 'post' or 'pre'")
        for key in ("dropout", "attention_dropout", "decoder_dropout", "mask_token_prob", "random_token_prob"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                bad(key, "must be in [0, 1]")
        if not 0.0 <= self.mask_rate < 1.0:
            bad("mask_rate", "must be in [0, 1)")
        if self.mask_token_prob + self.random_token_prob > 1.0 + 1e-9:
            bad("random_token_prob", f"mask_token_prob + random_token_prob must be <= 1 (got {self.mask_token_prob})")

    # ----------------------------------------------------------------- helpers
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_layers(self) -> int:
        """All layers, encoder and decoder."""
        return self.encoder_layers + self.decoder_layers

    @property
    def removed_rows_see_no_context(self) -> bool:
        """Whether tokens removed at the insertion are predicted without any layer after it (k > 0 and
        k == L + d): their head inputs are then all the one `<mask>` embedding, whatever the sequence says."""
        removes = self.mask_rate > 0 and self.mask_token_prob > 0
        return removes and self.insert_layer > 0 and self.insert_layer == self.num_layers

    @property
    def position_offset(self) -> int:
        """Learned position ids start at pad_token_id + 1, as in Hugging Face RoBERTa, so exported tables match."""
        return self.pad_token_id + 1

    def replace(self, **overrides) -> ModelConfig:
        """A copy with `overrides` applied and validated (a default feed-forward width follows `hidden_size`)."""
        if "hidden_size" in overrides and "intermediate_size" not in overrides and (
            self.intermediate_size == 4 * self.hidden_size
        ):
            overrides = {**overrides, "intermediate_size": 0}
        return apply_overrides(self, overrides)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """The config saved as `dataclasses.asdict(config)` (derived fields such as mask_token_id are dropped)."""
        return cls(**{k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(cls) if f.init}})

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """The config of objective `name` (`mlm`, `mae-lm`, `3ml`) at base size, with `overrides` applied.

        A `3ml` preset's decoder depth follows the encoder depth (2 layers under 24 encoder layers, else 3),
        unless `decoder_layers` is overridden.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        base = dict(PRESETS[name])
        layers = overrides.get("encoder_layers", ModelConfig.encoder_layers)
        if name in ("mae-lm", "3ml"):
            # The insertion sits at the top of the encoder unless the caller moves it.
            base["insert_layer"] = layers
        if name == "3ml":
            base["decoder_layers"] = 3 if layers >= 24 else 2
        base.update(overrides)
        unknown = sorted(set(base) - {f.name for f in dataclasses.fields(cls) if f.init})
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}")
        return cls(**base)


PRESETS: dict[str, dict] = {
    # RoBERTa: [MASK] at the input, 15%, 80/10/10.
    "mlm": dict(objective="mlm", insert_layer=0, decoder_layers=0, mask_rate=0.15, mask_token_prob=0.8,
                random_token_prob=0.1),
    # MAE-LM (Meng et al., ICLR 2024): 4-layer decoder of encoder width, dropout 0, masked tokens all removed.
    "mae-lm": dict(objective="mae-lm", decoder_layers=4, mask_rate=0.15, mask_token_prob=1.0, random_token_prob=0.0,
                   decoder_dropout=0.0),
    # 3ML (Liao et al., 2022): 50% removed; 2 (base) / 3 (large) decoder layers, see ARCHITECTURE.md section 1.
    "3ml": dict(objective="3ml", mask_rate=0.5, mask_token_prob=1.0, random_token_prob=0.0, decoder_dropout=0.0),
}


def _as_float(value):
    """`value` as a float when it is a number or a string that reads as one ("2e-3": YAML 1.1 leaves it a string)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def apply_overrides(config, overrides: dict, name: str | None = None):
    """Return a copy of dataclass `config` with `overrides` applied; unknown keys and wrong types name the key.

    Values must have the type of the current value (an int is accepted for a float, a list for a tuple).
    `name` is how errors call the dataclass (default: its class name).
    """
    name = name or type(config).__name__
    if not isinstance(overrides, dict):
        raise ValueError(f"{name}: expected a mapping, got {overrides!r}")
    fields = {f.name: f for f in dataclasses.fields(config) if f.init}
    values = {key: getattr(config, key) for key in fields}
    for key, value in overrides.items():
        if key not in fields:
            raise ValueError(f"unknown key {name}.{key}; known: {sorted(fields)}")
        current = values[key]
        if isinstance(current, bool) or isinstance(value, bool):
            ok = isinstance(value, bool) and isinstance(current, bool)
        elif isinstance(current, float):
            value = _as_float(value)
            ok = isinstance(value, float)
        elif isinstance(current, tuple):
            ok = isinstance(value, (list, tuple))
            value = tuple(value) if ok else value
        else:
            ok = isinstance(value, type(current))
        if not ok:
            raise ValueError(f"{name}.{key}: expected {type(current).__name__}, got {value!r}")
        values[key] = value
    return type(config)(**values)


def add_arguments(parser, defaults, meaning: dict[str, str]) -> None:
    """One `--field-name` option per field of the dataclass instance `defaults`, typed and defaulted by it;
    `meaning` gives each field's help text."""
    for f in dataclasses.fields(defaults):
        value = getattr(defaults, f.name)
        parser.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value,
                            help=f"{meaning[f.name]} (default {value})")


def from_arguments(cls, args):
    """The dataclass `cls` from the options `add_arguments` declared."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# --------------------------------------------------------------------------------------------- training configs
PRECISIONS = ("auto", "fp32", "bf16", "fp16")

BUILTIN_ROOT = "runs/data"
"""Where `data.path: builtin` prepares the embedded corpus (relative to the working directory)."""


@dataclass
class DataConfig:
    """Where the tokens come from and how they are packed."""

    path: str = "builtin"
    """A dataset directory written by `fastmae prepare`, or `builtin`: the embedded Python-docs corpus (the offline
    demo), prepared on first use into BUILTIN_ROOT/builtin-v{builtin_vocab_size}. A path that holds no dataset is an
    error, never a reason to build one."""
    builtin_vocab_size: int = 8000
    """Tokenizer size of the embedded corpus (path: builtin)."""
    builtin_valid_fraction: float = 0.05
    """Share of the embedded corpus's documents held out for evaluation (path: builtin)."""
    packing: str = "full"
    """`full` (RoBERTa FULL-SENTENCES) or `doc` (one document per varlen sequence)."""
    tokens_per_micro_batch: int = 8192
    """Token budget of one micro-batch on one rank (specials included)."""
    verify_checksums: bool = False
    """Hash every shard at start-up (slow for big corpora; sizes and indexes are always checked)."""

    @property
    def directory(self) -> Path:
        """The dataset directory: `path`, or where `builtin` is prepared."""
        if self.path == "builtin":
            return Path(BUILTIN_ROOT) / f"builtin-v{self.builtin_vocab_size}"
        return Path(self.path)

    def validate(self) -> None:
        if self.packing not in ("full", "doc"):
            raise ValueError(f"data.packing={self.packing!r}: must be 'full' or 'doc'")
        if self.tokens_per_micro_batch <= 0:
            raise ValueError(f"data.tokens_per_micro_batch={self.tokens_per_micro_batch}: must be positive")
        if self.builtin_vocab_size <= 5:
            raise ValueError(f"data.builtin_vocab_size={self.builtin_vocab_size}: must exceed the 5 special tokens")
        if not 0.0 < self.builtin_valid_fraction < 1.0:
            raise ValueError(f"data.builtin_valid_fraction={self.builtin_valid_fraction}: must be in (0, 1)")


@dataclass
class TrainConfig:
    """Optimisation, precision and parallelism."""

    steps: int = 1000
    """Optimizer steps (replaced by the planned count when flops_budget is set)."""
    flops_budget: float = 0.0
    """If > 0: train for the most steps whose training FLOPs (fastmae/flops.py's count, all ranks) fit this budget,
    planned from the run's own batches before the first step, so the schedule decays to the budget's end."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank; derived from tokens_per_step when that is set (a value other
    than 1 given here must then agree)."""
    tokens_per_step: int = 0
    """If > 0, the global batch in tokens per optimizer step (all ranks and micro-batches; nominal, since a
    micro-batch holds at most data.tokens_per_micro_batch tokens): grad_accum = tokens_per_step / (ranks x
    data.tokens_per_micro_batch), which must be a whole number, so one recipe runs on any rank count that divides."""
    optimizer: str = "adamw"
    """`adamw` (torch) or `lamb` (DeepSpeed's fused LAMB; CUDA only)."""
    lr: float = 2e-4
    """Peak learning rate."""
    warmup_steps: int = 10000
    """Linear warm-up steps."""
    schedule: str = "polynomial"
    """Decay after warm-up: `linear` or `polynomial` (with `power`) down to min_lr_ratio * lr at `steps`."""
    power: float = 1.0
    """Exponent of the polynomial decay (1.0 is linear, as fairseq's polynomial_decay default)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr."""
    weight_decay: float = 0.01
    betas: tuple = (0.9, 0.98)
    eps: float = 1e-6
    clip: float = 2.0
    """Gradient clipping by global norm (0 disables)."""
    precision: str = "auto"
    """`auto` (bf16 where the device multiplies bf16 natively: CUDA sm_80+, CPUs with AMX or AVX512-BF16; fp32
    elsewhere), `fp32`, `bf16` or `fp16` (DeepSpeed mixed precision). Gradients accumulate in fp32 in every case."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage 0-3."""
    activation_checkpointing: bool = False
    """Recompute each layer in backward instead of keeping its activations."""
    compile: bool = False
    """Compile every transformer layer (torch.compile, dynamic shapes; MaskedLM.compile_layers)."""
    seed: int = 0
    max_bad_steps: int = 20
    """Stop after this many non-finite losses in a row (each is skipped and counted)."""
    collective_timeout_s: int = 600
    """A collective that waits longer than this (a dead rank) ends the job."""

    def validate(self) -> None:
        def bad(key, msg):
            raise ValueError(f"train.{key}={getattr(self, key)!r}: {msg}")

        for key in ("steps", "grad_accum", "max_bad_steps", "collective_timeout_s"):
            if getattr(self, key) <= 0:
                bad(key, "must be positive")
        if self.tokens_per_step < 0:
            bad("tokens_per_step", "must be >= 0 (0: use grad_accum)")
        if self.optimizer not in ("adamw", "lamb"):
            bad("optimizer", "must be 'adamw' or 'lamb'")
        if self.schedule not in ("linear", "polynomial"):
            bad("schedule", "must be 'linear' or 'polynomial'")
        if self.precision not in PRECISIONS:
            bad("precision", f"must be one of {PRECISIONS}")
        if self.zero_stage not in (0, 1, 2, 3):
            bad("zero_stage", "must be 0, 1, 2 or 3")
        if self.lr <= 0:
            bad("lr", "must be positive")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            bad("min_lr_ratio", "must be in [0, 1]")
        for key in ("weight_decay", "eps", "clip", "power", "flops_budget"):
            if getattr(self, key) < 0:
                bad(key, "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", "must be two numbers in [0, 1)")


@dataclass
class EvalConfig:
    """Held-out evaluation: masked-token loss and accuracy at one fixed mask rate for every objective."""

    every: int = 1000
    """Evaluate every N optimizer steps (and at the end); 0 disables."""
    every_flops: float = 0.0
    """If > 0 (needs train.flops_budget): evaluate instead after the last step within each multiple of this many
    training FLOPs (and at the end), so runs of different objectives are evaluated at the same compute."""
    sequences: int = 1024
    """Held-out sequences per evaluation: the first N of the validation split in file order (all if it has fewer),
    the same whatever the world size or micro-batch size."""
    mask_rate: float = 0.15
    """Share of each held-out sequence's maskable tokens predicted; fixed for every objective."""
    seed: int = 0
    """Seed of the held-out masks (independent of train.seed, so runs with other seeds see the same masks)."""

    def validate(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every={self.every}: must be >= 0 (0 disables evaluation)")
        if self.every_flops < 0:
            raise ValueError(f"eval.every_flops={self.every_flops}: must be >= 0")
        if self.sequences <= 0:
            raise ValueError(f"eval.sequences={self.sequences}: must be positive")
        if not 0.0 < self.mask_rate < 1.0:
            raise ValueError(f"eval.mask_rate={self.mask_rate}: must be in (0, 1)")


@dataclass
class CheckpointConfig:
    every: int = 1000
    """Save every N optimizer steps (and at the end)."""
    keep: int = 3
    """Keep the newest K checkpoints."""

    def validate(self) -> None:
        for key in ("every", "keep"):
            if getattr(self, key) <= 0:
                raise ValueError(f"checkpoint.{key}={getattr(self, key)}: must be positive")


@dataclass
class LogConfig:
    dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, checkpoints/, plots."""
    every: int = 10
    """Log metrics every N optimizer steps."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is installed."""

    def validate(self) -> None:
        if self.every <= 0:
            raise ValueError(f"log.every={self.every}: must be positive")
        if not self.dir:
            raise ValueError("log.dir is empty: name a run directory")


@dataclass
class RunConfig:
    """Everything a training run needs; loaded from YAML plus dotted `key=value` overrides."""

    model: dict = field(default_factory=lambda: {"preset": "mae-lm"})
    """`preset` (mlm, mae-lm, 3ml) and ModelConfig overrides; vocab_size defaults to the dataset's."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    deepspeed: dict = field(default_factory=dict)
    """Raw DeepSpeed config entries merged over the derived config (they win)."""

    @property
    def max_seq_len(self) -> int:
        """The model's sequence length, known before the dataset's vocabulary (the loader needs it first)."""
        return int(self.model.get("max_seq_len", ModelConfig.max_seq_len))

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The ModelConfig of this run; `vocab_size` (the dataset's) unless the YAML sets one, which must agree."""
        values = dict(self.model)
        preset = values.pop("preset", None)
        if preset is None:
            raise ValueError("model.preset is missing (mlm, mae-lm or 3ml)")
        if values.setdefault("vocab_size", vocab_size) != vocab_size:
            raise ValueError(f"model.vocab_size={values['vocab_size']} but the dataset's tokenizer has {vocab_size}")
        try:
            return ModelConfig.preset(preset, **values)
        except ValueError as err:
            raise ValueError(str(err).replace("ModelConfig.", "model.")) from None

    def for_world(self, world: int) -> RunConfig:
        """This config for `world` ranks: train.grad_accum derived from train.tokens_per_step when that is set.
        Raises ValueError naming the values when they do not divide or disagree."""
        train, micro = self.train, self.data.tokens_per_micro_batch
        if not train.tokens_per_step:
            return self
        accum, rest = divmod(train.tokens_per_step, world * micro)
        if rest or not accum:
            raise ValueError(f"train.tokens_per_step={train.tokens_per_step} is not a multiple of {world} rank(s) x "
                             f"data.tokens_per_micro_batch={micro} = {world * micro}: change one of them")
        if train.grad_accum not in (1, accum):  # 1 is the default: any other value was meant
            raise ValueError(f"train.grad_accum={train.grad_accum} disagrees with train.tokens_per_step="
                             f"{train.tokens_per_step} on {world} rank(s) of data.tokens_per_micro_batch={micro} "
                             f"(which gives {accum}); set only one of them")
        return dataclasses.replace(self, train=dataclasses.replace(train, grad_accum=accum))

    def validate(self) -> None:
        for section in (self.data, self.train, self.eval, self.checkpoint, self.log):
            section.validate()
        if self.eval.every_flops and not self.train.flops_budget:
            raise ValueError(f"eval.every_flops={self.eval.every_flops} needs train.flops_budget > 0")


SECTIONS = {"data": DataConfig, "train": TrainConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig,
            "log": LogConfig}


def parse_override(text: str) -> tuple[list[str], object]:
    """`a.b=value` -> (['a', 'b'], value parsed as YAML, so numbers and booleans get their types)."""
    import yaml

    if "=" not in text:
        raise ValueError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def load_run_config(path: str | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config, apply `key=value` overrides, and validate; errors name the file and key."""
    import yaml

    raw: dict = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as handle:
                raw = yaml.safe_load(handle) or {}
        except FileNotFoundError:
            raise ValueError(f"{path}: config file not found") from None
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML ({err})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {text!r}: {key} is not a section")
        node[keys[-1]] = value
    unknown = sorted(set(raw) - {"model", "deepspeed", *SECTIONS})
    if unknown:
        raise ValueError(f"{path or 'config'}: unknown section(s) {unknown}")
    try:
        sections = {name: apply_overrides(cls(), raw.get(name) or {}, name) for name, cls in SECTIONS.items()}
        config = RunConfig(model=dict(raw.get("model") or {"preset": "mae-lm"}),
                           deepspeed=dict(raw.get("deepspeed") or {}), **sections)
        config.validate()
    except ValueError as err:
        raise ValueError(f"{path or 'config'}: {err}") from None
    return config
