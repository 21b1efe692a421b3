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
from .tokens import ROLES, SpecialTokens

__all__ = ["BUILTIN_ROOT", "PRECISIONS", "PRESETS", "ROLES", "SECTIONS", "CheckpointConfig", "DataConfig",
           "EvalConfig", "LogConfig", "ModelConfig", "RunConfig", "SpecialTokens", "TrainConfig", "add_arguments",
           "apply_overrides", "from_arguments", "load_run_config", "option", "parse_override"]
