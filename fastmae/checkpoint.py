"""Checkpoints of a DeepSpeed run that a crash can never leave looking valid.

    RUN/checkpoints/step00001000/       DeepSpeed's files (model, optimizer, scheduler) for every rank
                                   /fastmae_rank{R}.pt   the trainer's own state: counters, RNG, data cursor
                                   /model.safetensors    the fp32 master weights, gathered (what `export` reads)
                                   /MANIFEST.json        size and sha256 of every file above
                                   /COMPLETE             written last; names the step and world size
                                   /universal/           made on a resume by another number of ranks
Everything is first written under `.partial-stepN` and renamed once every rank has finished, so only directories with
a COMPLETE marker count, and a checkpoint is resumed only if every file matches its manifest (`verify`): a damaged
newest checkpoint is skipped for the one before. An old checkpoint is dropped by renaming it to `.deleting-stepN`
first, so a kill mid-deletion never leaves a half-deleted one that looks complete; what a killed run left (partial
and deleting directories, temporary files, unsealed eval weights) is cleared when the run starts again
(`clear_leftovers`). The trainer's state loads with `weights_only=True`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from .atomic import atomic_path, atomic_write_bytes, atomic_write_text, named_disk_errors
from .config import ModelConfig, RunConfig
from .data.shards import file_sha256
from .errors import FastmaeError

STEP_DIR = re.compile(r"^step(\d{8})$")
WEIGHTS = "model.safetensors"
UNIVERSAL = "universal"
MANIFEST = "MANIFEST.json"
EVAL_WEIGHTS = "eval_weights"  # RUN/eval_weights/stepN/{model.safetensors, COMPLETE}: eval.keep_weights


def eval_weights_dir(run_dir: Path, step: int) -> Path:
    """Where a run keeps its weights of the evaluation at `step` (eval.keep_weights): `write_eval_weights` into it seals
    it with a COMPLETE marker, so `load_pretrained` reads it as a checkpoint directory."""
    return Path(run_dir) / EVAL_WEIGHTS / f"step{step}"


def kept_eval_weights(run_dir: Path) -> dict[int, Path]:
    """step -> directory of the weights a run kept at that evaluation (eval.keep_weights; complete ones only)."""
    kept = {}
    for directory in (Path(run_dir) / EVAL_WEIGHTS).glob("step*"):
        if (directory / "COMPLETE").is_file() and (directory / WEIGHTS).is_file() and directory.name[4:].isdigit():
            kept[int(directory.name[4:])] = directory
    return dict(sorted(kept.items()))


def write_weights(path: Path, tensors: dict[str, torch.Tensor], model_config: dict, step: int) -> None:
    """Write fp32 weights by parameter name as safetensors, with the model config and step as metadata (atomic)."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().float().cpu().contiguous() for name, t in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"model_config": json.dumps(model_config), "step": str(step)})


def write_eval_weights(path: Path, tensors: dict[str, torch.Tensor], model_config: dict, step: int) -> None:
    """`write_weights` into an `eval_weights_dir` (`path` = its WEIGHTS file), then its COMPLETE marker: the
    directory counts (`kept_eval_weights`) once its weights are whole."""
    write_weights(path, tensors, model_config, step)
    atomic_write_text(path.parent / "COMPLETE", json.dumps({"step": step}) + "\n")


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


def saved_model_config(values: dict, source: Path) -> ModelConfig:
    """The ModelConfig saved in `source` (FastmaeError naming it when the values are bad)."""
    try:
        return ModelConfig.from_dict(values)
    except (TypeError, ValueError) as err:
        raise FastmaeError(f"{source}: bad model config ({err})") from None


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


def _manifest(directory: Path) -> dict[str, dict]:
    """Size and sha256 of every file of a checkpoint directory but its marker, manifest and universal form."""
    entries = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_file() and relative.parts[0] not in ("COMPLETE", MANIFEST, UNIVERSAL):
            entries[relative.as_posix()] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return entries


def verify(directory: Path) -> str | None:
    """Why the checkpoint in `directory` must not be resumed (unreadable marker, missing manifest, a file missing,
    of another size or another sha256), or None when it is intact. Reads every file once."""
    try:
        marker = json.loads((directory / "COMPLETE").read_text())
        int(marker["step"]), int(marker["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable COMPLETE marker"
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    for name, expected in manifest.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, its manifest says {expected['bytes']}"
        if file_sha256(path) != expected["sha256"]:
            return f"{name} differs from its sha256 in {MANIFEST}"
    return None


def resolve_resume(root: Path, resume: str | None, log) -> Path | None:
    """The checkpoint to resume from, verified (rank 0's work): `auto` walks back from the newest complete one to the
    newest that verifies, `log`ging what it skips and why, and starts afresh only if there is none at all; a path
    must verify; None or `none`: start afresh."""
    if resume in (None, "", "none"):
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        for _, path in reversed(found):
            problem = verify(path)
            if problem is None:
                return path
            log(f"skipping checkpoint {path}: {problem}")
        if found:
            raise FastmaeError(f"{root}: none of its {len(found)} checkpoint(s) verifies; resume one with --resume DIR "
                               "after repairing it, or start afresh with --resume none (or another log.dir)")
        return None
    path = Path(resume)
    if not (path / "COMPLETE").is_file():
        raise FastmaeError(f"--resume {resume}: not a complete checkpoint directory (no COMPLETE marker)")
    problem = verify(path)
    if problem is not None:
        raise FastmaeError(f"--resume {resume}: {problem}")
    return path


def save(engine, root: Path, step: int, trainer_state: dict, keep: int, metadata: dict,
         weights: dict[str, torch.Tensor] | None, keep_every: int = 0) -> Path:
    """Collective: every rank writes its part, rank 0 also the gathered fp32 `weights` (None on other ranks); rank 0
    seals the checkpoint and drops what `rotated_out` says. metadata must hold the `model_config` dict."""
    root = Path(root)
    rank, world = dist.get_rank(), dist.get_world_size()
    partial, final = root / f".partial-step{step:08d}", step_dir(root, step)
    if rank == 0 and partial.exists():
        shutil.rmtree(partial)  # left by a crash during an earlier save
    dist.barrier()
    with named_disk_errors(partial):  # DeepSpeed writes its files itself
        engine.save_checkpoint(str(root), tag=partial.name, save_latest=False)
    buffer = io.BytesIO()
    torch.save(trainer_state, buffer)
    atomic_write_bytes(partial / f"fastmae_rank{rank}.pt", buffer.getvalue())
    if weights is not None:
        write_weights(partial / WEIGHTS, weights, metadata["model_config"], step)
    dist.barrier()
    if rank == 0:
        atomic_write_text(partial / MANIFEST, json.dumps(_manifest(partial), indent=1) + "\n")
        atomic_write_text(partial / "COMPLETE", json.dumps({"step": step, "world_size": world, **metadata}) + "\n")
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        for old in rotated_out(complete_checkpoints(root), keep, keep_every):
            doomed = old.with_name(f".deleting-{old.name}")
            old.rename(doomed)
            shutil.rmtree(doomed)
    dist.barrier()
    return final


def rotated_out(found: list[tuple[int, Path]], keep: int, keep_every: int = 0) -> list[Path]:
    """Of the complete checkpoints `found` ((step, directory), oldest first), those a save drops: all but the newest
    `keep` and, with `keep_every`, those of steps that are its multiples."""
    return [path for step, path in found[:-keep] if not (keep_every and step % keep_every == 0)]


LEFTOVER_DIRS = (".partial-*", ".deleting-*")
LEFTOVER_FILES = ".*.tmp-*"  # fastmae.atomic's temporary names


def leftovers(run_dir: Path) -> list[Path]:
    """What a killed run left half-written in `run_dir`: partial and half-deleted checkpoint directories, atomic
    writes' temporary files, eval weights without their COMPLETE marker. None of it is ever resumed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    owned = [run_dir / "checkpoints", run_dir / EVAL_WEIGHTS]  # only what fastmae writes there
    found = [path for tree in owned for pattern in LEFTOVER_DIRS for path in tree.rglob(pattern) if path.is_dir()]
    found += [path for path in (run_dir / EVAL_WEIGHTS).glob("step*") if not (path / "COMPLETE").is_file()]
    files = [path for tree in owned for path in tree.rglob(LEFTOVER_FILES) if path.is_file()]
    files += [path for path in run_dir.glob(LEFTOVER_FILES) if path.is_file()]
    return found + [path for path in files if not any(folder in path.parents for folder in found)]


def clear_leftovers(run_dir: Path) -> list[Path]:
    """Rank 0, before a run starts or resumes in `run_dir`: remove its `leftovers`; returns them."""
    found = leftovers(run_dir)
    for path in found:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found


def saved_world_size(directory: Path) -> int:
    """How many ranks wrote the checkpoint in `directory`."""
    return int(json.loads((Path(directory) / "COMPLETE").read_text())["world_size"])


def saved_batch(directory: Path) -> dict | None:
    """The global batch a checkpoint's run trained with ({micro_batches_per_step, tokens_per_micro_batch}; None from
    checkpoints before it was kept)."""
    state = torch.load(Path(directory) / "fastmae_rank0.pt", map_location="cpu", weights_only=True)
    return state.get("batch")


def saved_step(directory: Path, name: str) -> int:
    """The step of the complete checkpoint in `directory` (`name`: the setting that gave it, for errors)."""
    try:
        return int(json.loads((Path(directory) / "COMPLETE").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        raise FastmaeError(f"{name}={directory}: not a complete checkpoint directory (no readable COMPLETE "
                           "marker)") from None


def make_universal(directory: Path) -> Path:
    """Rank 0, before the engine exists: DeepSpeed's universal (rank-count independent) form of the checkpoint in
    `directory`, converted once into `directory/universal` (atomically; later resumes reuse it)."""
    from deepspeed.checkpoint import ds_to_universal

    universal = Path(directory) / UNIVERSAL
    if not universal.is_dir():
        partial = Path(directory) / f".partial-{UNIVERSAL}"
        if partial.exists():
            shutil.rmtree(partial)
        args = argparse.Namespace(input_folder=str(directory), output_folder=str(partial), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)  # the state Megatron-DeepSpeed records, made up
        with contextlib.redirect_stdout(io.StringIO()):  # its progress report would interleave with the ranks' logs
            ds_to_universal.main(args)
        partial.rename(universal)
    return universal


def load(engine, directory: Path, model_config: dict) -> list[dict]:
    """Restore the engine from `directory` and return the trainer state of every rank that saved it.

    The checkpoint must be for the same `model_config`. Saved by another number of ranks, it is read through its
    universal form (`make_universal`, which rank 0 must have run and the engine built with `load_universal`).
    """
    directory = Path(directory)
    marker = json.loads((directory / "COMPLETE").read_text())
    saved = marker.get("model_config", {})
    changed = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
    if changed:
        differences = ", ".join(f"{k}={saved.get(k)!r}" for k in changed)
        raise FastmaeError(f"{directory}: saved for another model ({differences}); resume with the same model, or "
                           "start a new run (log.dir=... or --resume none)")
    if marker["world_size"] == dist.get_world_size():
        path, _ = engine.load_checkpoint(str(directory.parent), tag=directory.name)
    else:
        path, _ = engine.load_checkpoint(str(directory), tag=UNIVERSAL)
    if path is None:
        raise FastmaeError(f"{directory}: DeepSpeed could not load this checkpoint")
    states = []
    for rank in range(marker["world_size"]):
        state_file = directory / f"fastmae_rank{rank}.pt"
        if not state_file.is_file():
            raise FastmaeError(f"{state_file}: missing")
        states.append(torch.load(state_file, map_location="cpu", weights_only=True))
    return states


class Checkpointer:
    """When and where a run checkpoints: every `every` steps, at the last step, and when the run stops early."""

    def __init__(self, root: Path, every: int, keep: int, last_step: int, model_config: dict, keep_every: int = 0):
        self.root, self.every, self.keep, self.last_step = Path(root), every, keep, last_step
        self.model_config, self.keep_every = model_config, keep_every
        self.root_identity = _identity(self.root)  # None until the directory exists

    @classmethod
    def of_run(cls, config: RunConfig) -> Checkpointer:
        """The checkpointer of a run: LOG_DIR/checkpoints, its `checkpoint` settings, its last step, its model."""
        settings = config.checkpoint
        return cls(Path(config.log.dir) / "checkpoints", settings.every, settings.keep, config.train.steps,
                   dataclasses.asdict(config.model), settings.keep_every)

    def due(self, step: int, stopping: bool, inside_bad_streak: Callable[[], bool] = lambda: False) -> bool:
        """Whether to checkpoint after `step`: on a stop, at the last step, and every `every` steps unless
        `inside_bad_streak()` (skipped steps leave the weights of the checkpoint before them)."""
        return stopping or step == self.last_step or (step % self.every == 0 and not inside_bad_streak())

    def save(self, engine, step: int, trainer_state: dict, weights: dict[str, torch.Tensor] | None) -> Path:
        """Collective: `save` with this run's settings (`weights`: the gathered fp32 masters on rank 0). Raises
        FastmaeError, before writing, where the checkpoint directory this rank saw has gone or been replaced."""
        # the directory's identity is read once (at start-up, or here when the first save makes it), never after a
        # save: a directory that vanished while a save finished (rotating old checkpoints out) would be forgotten
        if self.root_identity is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self.root_identity = _identity(self.root)
        elif _identity(self.root) != self.root_identity:
            raise FastmaeError(f"{self.root}: vanished during the run (deleted, moved, or its file system unmounted), "
                               "and the checkpoints this run wrote there with it; not re-created, so that no "
                               "checkpoint lands where a resume would not look: restore it and resume")
        return save(engine, self.root, step, trainer_state, self.keep, {"model_config": self.model_config}, weights,
                    self.keep_every)


def _identity(directory: Path) -> tuple[int, int] | None:
    """(device, inode) of `directory`, None where it does not exist."""
    try:
        stat = directory.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino
