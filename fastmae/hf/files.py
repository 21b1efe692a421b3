"""A Hugging Face model directory's files as fastmae reads them: config.json, and the weights in whichever of the
three forms `save_pretrained` writes (errors name the file)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import WEIGHTS
from ..errors import FastmaeError


def config_json(directory: Path) -> dict:
    """The parsed config.json of a Hugging Face directory; errors name the file."""
    config_file = directory / "config.json"
    try:
        values = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FastmaeError(f"{config_file}: unreadable ({err})") from None
    if not isinstance(values, dict):
        raise FastmaeError(f"{config_file}: not a JSON object")
    return values


def read_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a directory's weights: model.safetensors, the shards model.safetensors.index.json names,
    or (older checkpoints) pytorch_model.bin, loaded with weights_only=True. Errors name the file."""
    from safetensors import SafetensorError, safe_open

    index, legacy = directory / "model.safetensors.index.json", directory / "pytorch_model.bin"
    if (directory / WEIGHTS).is_file():
        files = [directory / WEIGHTS]
    elif index.is_file():
        try:
            files = sorted({directory / name for name in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise FastmaeError(f"{index}: unreadable ({type(err).__name__}: {err})") from None
    elif legacy.is_file():
        try:
            return torch.load(legacy, map_location="cpu", weights_only=True), {}
        except Exception as err:  # noqa: BLE001 (torch.load raises many kinds)
            raise FastmaeError(f"{legacy}: unreadable ({type(err).__name__}: {err})") from None
    else:
        raise FastmaeError(f"{directory / WEIGHTS}: missing (and no model.safetensors.index.json or "
                           "pytorch_model.bin)")
    tensors, metadata = {}, {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
                metadata = metadata or handle.metadata() or {}
        except (SafetensorError, OSError) as err:
            raise FastmaeError(f"{file}: unreadable safetensors file ({err})") from None
    return tensors, metadata
