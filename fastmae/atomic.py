"""Atomic file writes: write beside the target under a temporary name, fsync, then rename over it.

A crash mid-write leaves the old file (or none), never a half-written one that looks valid. Every checkpoint file,
fastmae's and DeepSpeed's (`engine.AtomicCheckpointEngine`), is written through `open_for_write`: one place where a
write can fail, so a full disk is met (and named) the same way whichever library wrote.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import FastmaeError


@contextlib.contextmanager
def named_disk_errors(path: str | Path, needed: int | None = None) -> Iterator[None]:
    """Turn a full disk met while writing `path` (a file or a directory of files; `needed` bytes, where known) into a
    FastmaeError naming the directory, the file and the space it needed, and a directory turned read-only or
    forbidden into one naming it, whatever library was writing (Python's OSError; torch's and safetensors'
    RuntimeErrors such as "basic_ios::clear: iostream error", counted as a full disk only if the disk has < 1 MiB
    free)."""
    path = Path(path)
    try:
        yield
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise FastmaeError(f"no space left on {path.parent} while writing {path.name}{_space(path, needed)}") \
                from None
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise FastmaeError(f"{path.parent} cannot be written ({os.strerror(err.errno).lower()}) while writing "
                               f"{path.name}") from None
        raise
    except RuntimeError as err:
        if shutil.disk_usage(_existing_dir(path)).free < 2**20:
            raise FastmaeError(f"no space left on {path.parent} while writing {path.name} ({err})") from None
        raise


def _existing_dir(path: Path) -> Path:
    """`path` or its nearest ancestor that exists as a directory (whose disk it is written to)."""
    return next((p for p in (path, *path.parents) if p.is_dir()), Path("/"))


def _space(path: Path, needed: int | None) -> str:
    free = shutil.disk_usage(_existing_dir(path)).free
    return f" ({free:,} bytes free)" if needed is None else f" ({needed:,} bytes needed, {free:,} free)"


def open_for_write(path: Path) -> BinaryIO:
    """`path` opened to write bytes: the one place fastmae opens a file it writes (FASTMAE_FAULT_ENOSPC replaces
    it, fastmae/faults.py)."""
    return path.open("wb")


@contextlib.contextmanager
def atomic_path(path: str | Path, needed: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on normal exit it is fsynced and renamed to `path`. A full disk is a
    FastmaeError naming the directory, the file and the `needed` bytes where known."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with named_disk_errors(path, needed):
            path.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            if tmp.is_file():
                with tmp.open("rb+") as handle:
                    os.fsync(handle.fileno())
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically."""
    with atomic_path(path, needed=len(data)) as tmp, open_for_write(tmp) as file:
        file.write(data)


@contextlib.contextmanager
def atomic_stream(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write `path` through, atomically (its size not known ahead: a full disk is named with the
    space left)."""
    with atomic_path(path) as tmp, open_for_write(tmp) as file:
        yield file


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))
