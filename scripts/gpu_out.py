"""What the device tool brings back from a lent machine's $OUT (its README's limits), and bringing it into the tree:
the rules a folder must keep, the tail of a long log, a phase packed as one file, `--collect`. Standard library only,
as scripts/gpu_check.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

OUT_MAX_FILES, OUT_MAX_BYTES, OUT_MAX_FOLDERS = 8, 16 * 2**20, 2
OUT_NAME = re.compile(r"[A-Za-z0-9._-]+")


def out_problems(out: Path) -> list[str]:
    """Why the device tool would not bring back everything under `out` (empty when it would)."""
    problems, files = [], sorted(path for path in out.rglob("*") if not path.is_dir())
    if len(files) > OUT_MAX_FILES:
        problems.append(f"{len(files)} files (at most {OUT_MAX_FILES} come back)")
    for path in files:
        relative = path.relative_to(out)
        if len(relative.parts) - 1 > OUT_MAX_FOLDERS:
            problems.append(f"{relative}: {len(relative.parts) - 1} folders down (at most {OUT_MAX_FOLDERS})")
        if path.is_symlink() or not path.is_file():
            problems.append(f"{relative}: not a plain file")
        elif path.stat().st_size > OUT_MAX_BYTES:
            problems.append(f"{relative}: {path.stat().st_size} bytes (at most {OUT_MAX_BYTES})")
        problems += [f"{relative}: the name {part!r} has characters other than letters, digits, '.', '_', '-'"
                     for part in relative.parts if not OUT_NAME.fullmatch(part)]
    return problems


def directory_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3'."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device)


def add_tail(archive: tarfile.TarFile, path: Path, limit: int) -> None:
    """`path` into `archive` under its own name, only its last `limit` bytes when longer."""
    with path.open("rb") as file:
        size = file.seek(0, os.SEEK_END)
        file.seek(max(0, size - limit))
        info = tarfile.TarInfo(path.name)
        info.size, info.mtime = min(size, limit), int(path.stat().st_mtime)
        archive.addfile(info, file)


def pack_out(phase: str, out: Path) -> Path:
    """$OUT/PHASE/ as the one file $OUT/PHASE.tar, so that a later phase of the same call keeps its files within the
    device tool's count (`--collect` unpacks it)."""
    packed = out / f"{phase}.tar"
    with tarfile.open(packed, "w") as archive:
        archive.add(out / phase, arcname=phase)
    shutil.rmtree(out / phase)
    return packed


def collect(brought: Path, results: Path) -> list[Path]:
    """Rebuild results/DEVICE/PHASE/ from what a lent machine brought back of $OUT (`brought` holds PHASE/ folders or
    PHASE.tar archives of them, or is one); DEVICE from each phase.json's machine (FASTMAE_GPU_DEVICE overrides it).
    Returns the directories."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as unpacked:
        for packed in sorted(brought.glob("*.tar")):  # the earlier phases of a call that ran several
            with tarfile.open(packed) as archive:
                archive.extractall(unpacked, filter="data")
        records = ([brought / "phase.json"] if (brought / "phase.json").is_file()
                   else sorted(brought.glob("*/phase.json"))) + sorted(Path(unpacked).glob("*/phase.json"))
        if not records:
            raise SystemExit(f"gpu_check: {brought} holds no phase.json (nor PHASE/phase.json): is it what $OUT "
                             "brought back?")
        return [_collect_phase(record, results) for record in records]


def _collect_phase(record: Path, results: Path) -> Path:
    """One phase's directory under results/DEVICE/ from its phase.json and the files beside it, logs unpacked."""
    data = json.loads(record.read_text())
    device = os.environ.get("FASTMAE_GPU_DEVICE") or directory_name(data.get("machine", {}).get("device", ""))
    if not device:
        raise SystemExit(f"gpu_check: {record} names no device (its machine: {data.get('machine')}); set "
                         "FASTMAE_GPU_DEVICE")
    directory = results / device / data["phase"]
    directory.mkdir(parents=True, exist_ok=True)
    for path in record.parent.iterdir():
        if path.name == "logs.tar.gz":
            with tarfile.open(path) as archive:
                archive.extractall(directory, filter="data")
        elif path.is_file():
            shutil.copy2(path, directory / path.name)
    return directory
