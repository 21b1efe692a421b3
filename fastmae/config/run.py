"""The run config: `model:` plus one typed section each for data, train, eval, checkpoint and log, loaded from
YAML and dotted `key=value` overrides."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .fields import apply_overrides, did_you_mean, typed_value
from .model import ModelConfig
from .tokens import SpecialTokens

# --------------------------------------------------------------------------------------------- training configs
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SCHEDULES, DECAY_SHAPES = ("linear", "polynomial", "wsd"), ("linear", "1-sqrt", "cosine")  # the latter: wsd's decay

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
            raise ConfigError(f"data.packing={self.packing!r}: must be 'full' or 'doc'")
        if self.tokens_per_micro_batch <= 0:
            raise ConfigError(f"data.tokens_per_micro_batch={self.tokens_per_micro_batch}: must be positive")
        if self.builtin_vocab_size <= 5:
            raise ConfigError(f"data.builtin_vocab_size={self.builtin_vocab_size}: must exceed the 5 special tokens")
        if not 0.0 < self.builtin_valid_fraction < 1.0:
            raise ConfigError(f"data.builtin_valid_fraction={self.builtin_valid_fraction}: must be in (0, 1)")


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
    batch_warmup_tokens: int = 0
    """If > 0, a batch-size warm-up (ModernBERT's): over the first this many (nominal) tokens the global batch grows
    linearly in steps, one micro-batch a rank at a time, from batch_warmup_from tokens to the full step."""
    batch_warmup_from: int = 0
    """The batch warm-up's first global batch in tokens (rounded down to whole micro-batches on every rank, at least
    one)."""
    optimizer: str = "adamw"
    """`adamw` (torch) or `lamb` (DeepSpeed's fused LAMB; CUDA only)."""
    lr: float = 2e-4
    """Peak learning rate."""
    warmup_steps: int = 10000
    """Linear warm-up steps."""
    schedule: str = "polynomial"
    """After warm-up: `linear` or `polynomial` (with `power`) decay to min_lr_ratio * lr at `steps`, or `wsd`
    (warmup-stable-decay: the peak held, then decay_shape over the last decay_steps; fastmae/schedule.py)."""
    power: float = 1.0
    """Exponent of the polynomial decay (1.0 is linear, as fairseq's polynomial_decay default)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr."""
    decay_steps: int = 0
    """wsd: the decay's length in optimizer steps (0: decay_fraction of the run)."""
    decay_fraction: float = 0.1
    """wsd without decay_steps: the decay's share of the run's (planned) steps; 0: none, the peak held to the last
    step (decays then come as branches of its checkpoints, branch_from)."""
    decay_shape: str = "linear"
    """wsd: the decay's shape, `linear`, `1-sqrt` or `cosine`."""
    branch_from: str = ""
    """wsd: a checkpoint directory of a run in its stable phase; this run continues it (weights, optimizer, data
    position, RNG) for train.decay_steps more steps, decaying over them, in its own log.dir (fastmae/schedule.py)."""
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
    flat_parameters: bool = True
    """Hold the parameters in one flat tensor per weight-decay group under ZeRO stages 0-2 (fastmae/flat.py): DeepSpeed
    then does its per-parameter work (gradient casts and copies, norms) on two tensors instead of every parameter,
    ~700 fewer device ops per step at base size; the price is that ZeRO's gradient reduction waits for the whole
    backward instead of overlapping it. ZeRO-3 gathers parameters module by module and keeps them apart."""
    cuda_graphs: str = "auto"
    """Record the training forward and backward as CUDA graphs and replay them (fastmae/graphs.py): `auto` where the
    run allows (CUDA, ZeRO 0-2, no activation checkpointing, no train.compile; the log says which), `always` (an error
    where it cannot), `never`. Only micro-batches of a recorded shape replay; others run eagerly. Under `doc` packing
    micro-batches are then padded to a few fixed shapes (fastmae/padding.py; with a varlen attention kernel)."""
    cublas_workspace: str = "default"
    """CUDA: `default` (torch's cuBLAS workspace: most GEMMs issue a memset, weight gradients a split-K reduction) or
    `none` (no workspace: one kernel a GEMM; fastmae.hardware.use_cublas_workspace). Set in the environment before the
    first GEMM, so the whole process runs with it."""
    seed: int = 0
    init_from: str = ""
    """Continued pretraining: start from the weights of this fastmae run, checkpoint or export directory, or of a
    Hugging Face encoder `fastmae.hf` reads (RoBERTa, BERT, RoFormer, ESM-2, ModernBERT), instead of a random
    initialisation. The model's shape and special token ids come from it (a shape field set to another value is
    refused) and `model.preset` chooses the objective on top; weights the source lacks (a new decoder) start as in
    pretraining, or see init_decoder. Not a resume: the optimizer, schedule and data position start afresh
    (fastmae.pretrained.continued)."""
    init_decoder: str = "new"
    """With init_from, how a decoder the source lacks starts: `new` (as in pretraining) or `top` (copies of the
    source encoder's top layers, and the insertion's positions and LayerNorm from its embeddings)."""
    max_bad_steps: int = 20
    """Stop after this many non-finite losses in a row (each is skipped and counted)."""
    collective_timeout_s: int = 600
    """A collective that waits longer than this (a dead rank) ends the job."""

    def validate(self) -> None:
        def bad(key, msg):
            raise ConfigError(f"train.{key}={getattr(self, key)!r}: {msg}")

        for key in ("steps", "grad_accum", "max_bad_steps", "collective_timeout_s"):
            if getattr(self, key) <= 0:
                bad(key, "must be positive")
        if self.tokens_per_step < 0:
            bad("tokens_per_step", "must be >= 0 (0: use grad_accum)")
        if self.batch_warmup_tokens and self.flops_budget:
            bad("batch_warmup_tokens", "a FLOP budget's plan counts full steps: set train.steps with a batch warm-up")
        choices = {"optimizer": ("adamw", "lamb"), "schedule": SCHEDULES, "decay_shape": DECAY_SHAPES,
                   "precision": PRECISIONS, "init_decoder": ("new", "top"), "cuda_graphs": ("auto", "always", "never"),
                   "cublas_workspace": ("default", "none"), "zero_stage": (0, 1, 2, 3)}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                bad(key, f"must be one of {allowed}")
        if self.decay_steps < 0:
            bad("decay_steps", "must be >= 0 (0: decay_fraction of the run)")
        if not 0 <= self.decay_fraction <= 1:
            bad("decay_fraction", "must be in [0, 1]")
        if self.lr <= 0:
            bad("lr", "must be positive")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            bad("min_lr_ratio", "must be in [0, 1]")
        for key in ("weight_decay", "eps", "clip", "power", "flops_budget", "batch_warmup_tokens", "batch_warmup_from"):
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
    keep_weights: bool = False
    """Also write the fp32 weights at every evaluation, to RUN/eval_weights/stepN/ (a directory `fastmae analyze`
    and `finetune` read): how `fastmae study` compares objectives at the same held-out loss."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every={self.every}: must be >= 0 (0 disables evaluation)")
        if self.every_flops < 0:
            raise ConfigError(f"eval.every_flops={self.every_flops}: must be >= 0")
        if self.sequences <= 0:
            raise ConfigError(f"eval.sequences={self.sequences}: must be positive")
        if not 0.0 < self.mask_rate < 1.0:
            raise ConfigError(f"eval.mask_rate={self.mask_rate}: must be in (0, 1)")


@dataclass
class CheckpointConfig:
    every: int = 1000
    """Save every N optimizer steps (and at the end)."""
    keep: int = 3
    """Keep the newest K checkpoints."""
    keep_every: int = 0
    """Also keep, beside the newest, every checkpoint of a step that is a multiple of N (0: none): the stable run of
    warmup-stable-decay keeps the checkpoints its branches start from."""

    def validate(self) -> None:
        for key in ("every", "keep"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"checkpoint.{key}={getattr(self, key)}: must be positive")
        if self.keep_every < 0 or (self.keep_every and self.keep_every % self.every):
            raise ConfigError(f"checkpoint.keep_every={self.keep_every}: must be 0 or a multiple of "
                              f"checkpoint.every={self.every} (the steps checkpointed)")


@dataclass
class LogConfig:
    dir: str = "runs/default"
    """Run directory: resolved config, metrics.jsonl, checkpoints/, plots."""
    every: int = 10
    """Log metrics every N optimizer steps."""
    tensorboard: bool = True
    """Also write TensorBoard events when tensorboard is installed."""
    curves: bool = True
    """Draw RUN/curves.png when the run ends (matplotlib, ~1.3 s of a 2-core CPU); `fastmae plot RUN` draws it at any
    time."""

    def validate(self) -> None:
        if self.every <= 0:
            raise ConfigError(f"log.every={self.every}: must be positive")
        if not self.dir:
            raise ConfigError("log.dir is empty: name a run directory")


def default_model() -> ModelConfig:
    """The model of a config that names none: `mae-lm` at base size, for the default (embedded) data's vocabulary."""
    return ModelConfig.preset("mae-lm", vocab_size=DataConfig.builtin_vocab_size)


@dataclass
class RunConfig:
    """Everything a training run needs; loaded from YAML plus dotted `key=value` overrides."""

    model: ModelConfig = field(default_factory=default_model)
    """The model; YAML gives `preset` (mlm, mae-lm, 3ml) and ModelConfig overrides, vocab_size defaulting to the
    dataset's (resolved_model)."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    deepspeed: dict = field(default_factory=dict)
    """Raw DeepSpeed config entries merged over the derived config (they win)."""
    model_given: tuple[str, ...] = field(default=(), compare=False)
    """The model fields the YAML and its overrides set themselves (the rest came from the preset): a continued run
    (train.init_from) refuses these where they differ from its source, and takes the source's for the others. Not
    part of the config's value: two configs that resolve alike are equal however they were written."""

    def to_yaml(self) -> str:
        """This config as YAML that `load_run_config` reads back to an equal config (the model as its preset name
        and every field)."""
        import yaml

        resolved = dataclasses.asdict(self)
        del resolved["model_given"]
        model = {f.name: getattr(self.model, f.name) for f in dataclasses.fields(self.model) if f.init}
        resolved["model"] = {"preset": self.model.objective, **model}
        resolved["train"]["betas"] = list(resolved["train"]["betas"])
        return yaml.safe_dump(resolved, sort_keys=False)

    def for_world(self, world: int) -> RunConfig:
        """This config for `world` ranks: train.grad_accum derived from train.tokens_per_step when that is set.
        Raises ValueError naming the values when they do not divide or disagree."""
        train, micro = self.train, self.data.tokens_per_micro_batch
        if not train.tokens_per_step:
            return self
        accum, rest = divmod(train.tokens_per_step, world * micro)
        if rest or not accum:
            raise ConfigError(f"train.tokens_per_step={train.tokens_per_step} is not a multiple of {world} rank(s) x "
                             f"data.tokens_per_micro_batch={micro} = {world * micro}: change one of them")
        if train.grad_accum not in (1, accum):  # 1 is the default: any other value was meant
            raise ConfigError(f"train.grad_accum={train.grad_accum} disagrees with train.tokens_per_step="
                             f"{train.tokens_per_step} on {world} rank(s) of data.tokens_per_micro_batch={micro} "
                             f"(which gives {accum}); set only one of them")
        return dataclasses.replace(self, train=dataclasses.replace(train, grad_accum=accum))

    def validate(self) -> None:
        for section in (self.data, self.train, self.eval, self.checkpoint, self.log):
            section.validate()
        if self.eval.every_flops and not self.train.flops_budget:
            raise ConfigError(f"eval.every_flops={self.eval.every_flops} needs train.flops_budget > 0")


SECTIONS = {"data": DataConfig, "train": TrainConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig,
            "log": LogConfig}


def dataset_tokens(data: DataConfig) -> dict | None:
    """What the run's dataset fixes of the model: {vocab_size, pad_token_id, ..., mask_token_id}, from the dataset's
    meta.json (its tokenizer's; datasets from before special ids were recorded, and the embedded corpus at
    data.builtin_vocab_size, have fastmae's own), or None when data.path holds no dataset yet."""
    if data.path == "builtin":
        return {"vocab_size": data.builtin_vocab_size, **SpecialTokens().as_fields()}
    meta = data.directory / "meta.json"
    try:
        values = json.loads(meta.read_text(encoding="utf-8"))
        special = SpecialTokens(**values.get("special_tokens", {}))
        return {"vocab_size": int(values["vocab_size"]), **special.as_fields()}
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{meta}: unreadable dataset metadata ({type(err).__name__}: {err})") from None


def resolved_model(values: dict, data: DataConfig) -> ModelConfig:
    """The `model:` section as a ModelConfig: `preset` plus field overrides. vocab_size and the special ids are the
    dataset's (which values written here must equal); a dataset not prepared yet needs model.vocab_size written."""
    values = dict(values)
    preset = values.pop("preset", None)
    if not isinstance(preset, str):
        raise ConfigError("model.preset is missing (mlm, mae-lm or 3ml)" if preset is None else
                          f"model.preset: expected str (mlm, mae-lm or 3ml), got {preset!r}")
    defaults = ModelConfig()
    values = {key: typed_value(f"model.{key}", getattr(defaults, key), value) if hasattr(defaults, key) else value
              for key, value in values.items()}
    fixed = dataset_tokens(data)
    if fixed is None and "vocab_size" not in values:
        raise ConfigError(f"data.path: {data.directory / 'meta.json'}: missing; run `fastmae prepare --output "
                          f"{data.directory}` first (or set model.vocab_size to load this config without its data)")
    for name, value in (fixed or {}).items():
        if values.setdefault(name, value) != value:
            what = f"a vocabulary of {value}" if name == "vocab_size" else f"{name} {value} (its tokenizer's)"
            raise ConfigError(f"model.{name}={values[name]} but the dataset of data.path={data.path} has {what}")
    return ModelConfig.preset(preset, **values)


def parse_override(text: str) -> tuple[list[str], object]:
    """`a.b=value` -> (['a', 'b'], value parsed as YAML, so numbers and booleans get their types)."""
    import yaml

    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def load_run_config(path: str | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config, apply `key=value` overrides, and validate. Errors are ConfigErrors naming the file
    (unreadable, not a mapping, unknown section) or the key and value (everything else)."""
    import yaml

    raw: dict = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as handle:
                raw = yaml.safe_load(handle) or {}
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {key} is not a section")
        node[keys[-1]] = value
    unknown = sorted(set(raw) - (known := {"model", "deepspeed", *SECTIONS}))
    if unknown:
        raise ConfigError(f"{path or 'config'}: unknown section(s) {unknown}{did_you_mean(unknown[0], known)}")
    sections = {name: apply_overrides(cls(), raw.get(name) or {}, name) for name, cls in SECTIONS.items()}
    model_values = raw.get("model") or {"preset": "mae-lm"}
    model = resolved_model(model_values, sections["data"])
    config = RunConfig(model=model, deepspeed=dict(raw.get("deepspeed") or {}), **sections,
                       model_given=tuple(sorted(k for k in model_values if k != "preset")))
    config.validate()
    return config
