"""Configuration: special-token ids (`tokens`), the model (`model`), a training run (`run`), and the typed path from
YAML values and command-line options to dataclasses (`fields`). Import from here."""

from .fields import add_arguments, apply_overrides, from_arguments, option
from .model import PRESETS, ModelConfig
from .run import (
    BUILTIN_ROOT,
    PRECISIONS,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    RunConfig,
    TrainConfig,
    load_run_config,
    parse_override,
)
from .tokens import BOS_ID, EOS_ID, MASK_ID, NUM_SPECIAL_TOKENS, PAD_ID, UNK_ID, UNMASKABLE_IDS

__all__ = ["BOS_ID", "BUILTIN_ROOT", "EOS_ID", "MASK_ID", "NUM_SPECIAL_TOKENS", "PAD_ID", "PRECISIONS", "PRESETS",
           "SECTIONS", "UNK_ID", "UNMASKABLE_IDS", "CheckpointConfig", "DataConfig", "EvalConfig", "LogConfig",
           "ModelConfig", "RunConfig", "TrainConfig", "add_arguments", "apply_overrides", "from_arguments",
           "load_run_config", "option", "parse_override"]
