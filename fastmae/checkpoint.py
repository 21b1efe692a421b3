"""Checkpoints of a DeepSpeed run that a crash can never leave looking valid.

    RUN/checkpoints/step00001000/       DeepSpeed's files (model, optimizer, scheduler) for every rank
                                   /fastmae_rank{R}.pt   the trainer's own state: counters, RNG, data cursor
                                   /model.safetensors    the fp32 master weights, gathered (what `export` reads)
                                   /COMPLETE             written last; names the step and world size
Everything is first written under `.partial-stepN` and renamed once every rank has finished, so only directories with
a COMPLETE marker count. The trainer's state loads with `weights_only=True`.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .atomic import atomic_path, atomic_write_bytes, atomic_write_text
from .errors import FastmaeError

STEP_DIR = re.compile(r"^step(\d{8})$")
WEIGHTS = "model.safetensors"


def write_weights(path: Path, tensors: dict[str, torch.Tensor], model_config: dict, step: int) -> None:
    """Write fp32 weights by parameter name as safetensors, with the model config and step as metadata (atomic)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().float().cpu().contiguous() for name, t in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"model_config": json.dumps(model_config), "step": str(step)})


def weights_metadata(path: Path) -> tuple[dict, int]:
    """(model config dict, step) of a file written by `write_weights`, without reading its tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise FastmaeError(f"{path}: unreadable safetensors file ({err})") from None
    if "model_config" not in metadata:
        raise FastmaeError(f"{path}: no fastmae model_config in its metadata (not written by fastmae)")
    return json.loads(metadata["model_config"]), int(metadata.get("step", -1))


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict, int]:
    """(weights, model config dict, step) of a file written by `write_weights`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    model_config, step = weights_metadata(path)
    try:
        return load_file(str(path)), model_config, step
    except (SafetensorError, OSError) as err:
        raise FastmaeError(f"{path}: unreadable safetensors file ({err})") from None


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of finished checkpoints under `root`, oldest first."""
    found = []
    if Path(root).is_dir():
        for path in Path(root).iterdir():
            match = STEP_DIR.match(path.name)
            if match and (path / "COMPLETE").is_file():
                found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_resume(root: Path, resume: str | None) -> Path | None:
    """The checkpoint directory `--resume` names: `auto` (newest complete one, or none), a path, or None."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / "COMPLETE").is_file():
        raise FastmaeError(f"--resume {resume}: not a complete checkpoint directory (no COMPLETE marker)")
    return path


def save(engine, root: Path, step: int, trainer_state: dict, keep: int, metadata: dict,
         weights: dict[str, torch.Tensor] | None) -> Path:
    """Collective: every rank writes its part, rank 0 also the gathered fp32 `weights` (None on other ranks); rank 0
    seals the checkpoint and drops the oldest beyond `keep`. metadata must hold the `model_config` dict."""
    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    partial, final = root / f".partial-step{step:08d}", step_dir(root, step)
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a crash during an earlier save
    dist.barrier()
    engine.save_checkpoint(str(root), tag=partial.name, save_latest=False)
    buffer = io.BytesIO()
    torch.save(trainer_state, buffer)
    atomic_write_bytes(partial / f"fastmae_rank{rank}.pt", buffer.getvalue())
    if weights is not None:
        write_weights(partial / WEIGHTS, weights, metadata["model_config"], step)
    dist.barrier()
    if rank == 0:
        atomic_write_text(partial / "COMPLETE", json.dumps({"step": step, "world_size": world, **metadata}) + "\n")
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for _, old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def load(engine, directory: Path, model_config: dict) -> dict:
    """Restore the engine from `directory` and return this rank's trainer state.

    The checkpoint must have been saved by as many ranks, for the same `model_config`.
    """
    directory = Path(directory)
    marker = json.loads((directory / "COMPLETE").read_text())
    world = dist.get_world_size()
    if marker["world_size"] != world:
        raise FastmaeError(f"{directory}: saved by {marker['world_size']} ranks, resuming with {world}")
    saved = marker.get("model_config", {})
    changed = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
    if changed:
        differences = ", ".join(f"{k}={saved.get(k)!r}" for k in changed)
        raise FastmaeError(f"{directory}: saved for another model ({differences}); resume with the same model, or "
                           "start a new run (log.dir=... or --resume none)")
    path, _ = engine.load_checkpoint(str(directory.parent), tag=directory.name)
    if path is None:
        raise FastmaeError(f"{directory}: DeepSpeed could not load this checkpoint")
    state_file = directory / f"fastmae_rank{dist.get_rank()}.pt"
    if not state_file.is_file():
        raise FastmaeError(f"{state_file}: missing")
    return torch.load(state_file, map_location="cpu", weights_only=True)
