"""What fastmae guarantees when things go wrong (README "Faults"): each case here can fail."""

import errno
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastmae.atomic import atomic_path, atomic_write_bytes
from fastmae.errors import FastmaeError


def test_a_full_disk_names_the_directory_and_the_file(tmp_path, monkeypatch):
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    target = tmp_path / "ckpt" / "fastmae_rank0.pt"
    with pytest.raises(FastmaeError, match=f"^no space left on {tmp_path / 'ckpt'} while writing fastmae_rank0.pt$"):
        atomic_write_bytes(target, b"x")
    assert not target.exists() and not list((tmp_path / "ckpt").iterdir())  # no temporary left behind


def test_a_library_write_error_counts_as_a_full_disk_only_when_the_disk_is_full(tmp_path, monkeypatch):
    def failing_save(obj, path):
        raise RuntimeError("basic_ios::clear: iostream error")

    for free, expected in ((0, FastmaeError), (2**30, RuntimeError)):
        monkeypatch.setattr("shutil.disk_usage", lambda p, free=free: SimpleNamespace(free=free))
        with pytest.raises(expected):
            with atomic_path(tmp_path / "weights.pt") as tmp:
                failing_save({"w": torch.zeros(1)}, tmp)


def test_prepare_output_that_is_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "in.txt").write_text("a b c\n" * 50)
    (tmp_path / "out").write_text("a file")
    done = subprocess.run([sys.executable, "-m", "fastmae.prepare", "--input", str(tmp_path / "in.txt"), "--output",
                           str(tmp_path / "out"), "--vocab-size", "20"], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"fastmae prepare: error: --output {tmp_path / 'out'}: exists and is "
                                                "not a directory"]
