"""What fastmae guarantees when things go wrong (docs/reliability.md): each case here can fail."""

import errno
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import warm_python

from fastmae.atomic import atomic_path, atomic_write_bytes
from fastmae.errors import FastmaeError


def test_a_full_disk_names_the_directory_and_the_file(tmp_path, monkeypatch):
    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("fastmae.atomic.open_for_write", full)
    target = tmp_path / "ckpt" / "fastmae_rank0.pt"
    with pytest.raises(FastmaeError, match=f"^no space left on {tmp_path / 'ckpt'} while writing fastmae_rank0.pt "
                                           r"\(3 bytes needed, [0-9,]+ free\)$"):
        atomic_write_bytes(target, b"xyz")
    assert not target.exists() and not list((tmp_path / "ckpt").iterdir())  # no temporary left behind


def test_deepspeeds_recovery_scripts_meet_a_full_disk_as_every_checkpoint_file_does(tmp_path, monkeypatch):
    """The scripts DeepSpeed copies beside its ZeRO shards (zero_to_fp32.py, ...) go through fastmae's one write
    (`engine.copy_recovery_scripts`, which build_engine puts in DeepSpeed's place): executable, atomic, and a full
    disk (FASTMAE_FAULT_ENOSPC's, or a real one) is named with the directory and the file."""
    from fastmae.engine import copy_recovery_scripts

    copy_recovery_scripts(str(tmp_path))
    assert (tmp_path / "zero_to_fp32.py").stat().st_mode & 0o100

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("fastmae.atomic.open_for_write", full)
    (tmp_path / "full").mkdir()
    with pytest.raises(FastmaeError, match=f"^no space left on {tmp_path / 'full'} while writing zero_to_fp32.py"):
        copy_recovery_scripts(str(tmp_path / "full"))
    assert not list((tmp_path / "full").iterdir())


def test_a_directory_turned_read_only_is_named(tmp_path, monkeypatch):
    def read_only(path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("fastmae.atomic.open_for_write", read_only)
    with pytest.raises(FastmaeError, match=f"^{tmp_path / 'ckpt'} cannot be written \\(read-only file system\\) "
                                           "while writing fastmae_rank1.pt$"):
        atomic_write_bytes(tmp_path / "ckpt" / "fastmae_rank1.pt", b"x")


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
    done = subprocess.run([*warm_python.COMMAND, "-m", "fastmae.prepare", "--input", str(tmp_path / "in.txt"),
                           "--output", str(tmp_path / "out"), "--vocab-size", "20"], capture_output=True, text=True,
                          env=warm_python.environment())
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"fastmae prepare: error: --output {tmp_path / 'out'}: exists and is "
                                                "not a directory"]


def test_an_explicit_resume_that_does_not_verify_is_a_one_line_error(tmp_path):
    from fastmae import checkpoint

    directory = tmp_path / "step00000002"
    directory.mkdir()
    (directory / "COMPLETE").write_text('{"step": 2, "world_size": 1}')
    (directory / "x.pt").write_bytes(b"abc")
    (directory / checkpoint.MANIFEST).write_text('{"x.pt": {"bytes": 3, "sha256": "0"}}')
    with pytest.raises(FastmaeError, match=f"^--resume {directory}: x.pt differs from its sha256"):
        checkpoint.resolve_resume(tmp_path, str(directory), print)
    with pytest.raises(FastmaeError, match="none of its 1 checkpoint"):
        checkpoint.resolve_resume(tmp_path, "auto", lambda line: None)


class _GoneLauncher:
    """A launcher process that has exited, as psutil reports it."""

    pid = 4242

    def is_running(self) -> bool:
        return False


def _agree_with_launcher_gone_on_rank_1(rank: int, port: int, out: Path) -> None:
    import json

    import torch.distributed as dist

    from fastmae.distributed import StopAgreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    lines = []
    stop = StopAgreement(torch.device("cpu"), lines.append)
    stop.launchers = [_GoneLauncher()] if rank == 1 else []
    (out / f"rank{rank}.json").write_text(json.dumps({"stop": stop.agreed(), "lines": lines}))
    dist.destroy_process_group()


def test_every_rank_stops_when_one_sees_its_launcher_gone_and_rank_0_says_why(tmp_path):
    # only rank 0 writes the log: a launcher seen gone by another rank must still be named there
    import json

    from test_train import _free_port

    torch.multiprocessing.spawn(_agree_with_launcher_gone_on_rank_1, args=(_free_port(), tmp_path), nprocs=2)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["stop"] and rank1["stop"]
    assert rank0["lines"] == ["the launcher of rank 1 is gone: saving a checkpoint and exiting"]
    assert rank1["lines"] == ["the launcher (pid 4242) is gone: saving a checkpoint and exiting"]


def test_the_failing_rank_names_itself_and_its_peer_does_not_bury_it(tmp_path):
    """A token id outside the vocabulary in a sequence only rank 1 draws in step 1: rank 1 stops with its one-line
    error, rank 0 (waiting for it in a collective) with one line pointing at it, no traceback; exit non-zero."""
    import numpy as np
    from test_train import WORDS, chaos, launch, overrides, prepare_word_dataset

    from fastmae.data import PackedLoader
    from fastmae.data.shards import shard_files

    (tmp_path / "data").mkdir()
    data = prepare_word_dataset(tmp_path / "data", WORDS, 400, 60, vocab_size=40, valid_fraction=0.1)
    args = overrides(data, tmp_path / "run", **{"eval.every": 0, "data.packing": "doc"})
    rank1 = PackedLoader(data, max_seq_len=64, packing="doc", tokens_per_batch=256, rank=1, world_size=2)
    sequence = next(iter(rank1)).dataset_ids[0]
    shard, start, _ = (int(a[0]) for a in rank1.index.stream_spans(np.array([sequence])))
    name = rank1.data.meta["splits"]["train"]["shards"][shard]
    tokens_path = shard_files(data, "train", name)[0]
    tokens = np.fromfile(tokens_path, dtype=np.uint16)
    tokens[start] = 999  # under `doc` packing a sequence's stream position is its first token's index
    tokens.tofile(tokens_path)
    run = launch(args, launcher=chaos.DEEPSPEED_LAUNCHER)  # DeepSpeed's launcher stops rank 0 once rank 1 fails
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.startswith("fastmae train")]
    assert any(line.startswith("fastmae train [rank 1 of 2]: error: ") and "token id 999 is outside" in line
               for line in lines), run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]


def test_a_checkpoint_directory_that_vanishes_as_a_save_ends_is_named_by_the_next_save(tmp_path, monkeypatch):
    """The directory moved away after a save wrote its checkpoint but before the save returned (say while it rotated
    old ones out): the next save refuses by name, as for a directory that vanished between saves, instead of
    re-creating it (a checkpointer that read the directory's identity again would have found none and forgotten it)."""
    from fastmae import checkpoint

    root = tmp_path / "checkpoints"

    def save_then_vanish(engine, directory, step, *args):
        (directory / f"step{step:08d}").mkdir(parents=True)
        directory.rename(tmp_path / "aside")
        return directory / f"step{step:08d}"

    monkeypatch.setattr(checkpoint, "save", save_then_vanish)
    saver = checkpoint.Checkpointer(root, every=1, keep=2, last_step=4, model_config={})
    saver.save(None, 1, {}, None)
    with pytest.raises(FastmaeError, match="vanished during the run"):
        saver.save(None, 2, {}, None)
    assert not root.exists()


def test_what_a_killed_run_left_half_written_is_cleared_and_nothing_else(tmp_path):
    """A kill can land inside a checkpoint write, between a deletion's first and last file, inside an atomic write or
    between eval weights and their marker: `clear_leftovers` removes exactly those, before the run resumes."""
    from fastmae.checkpoint import clear_leftovers

    run = tmp_path / "run"
    kept = [run / "checkpoints" / "step00000004" / "COMPLETE", run / "checkpoints" / "step00000004" / "x.pt",
            run / "eval_weights" / "step00000004" / "COMPLETE", run / "metrics.jsonl", run / "config.yaml"]
    left = [run / "checkpoints" / ".partial-step00000006" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            run / "checkpoints" / ".deleting-step00000002" / "COMPLETE",
            run / "checkpoints" / "step00000004" / ".partial-universal" / "x",
            run / "checkpoints" / ".partial-step00000006" / ".model.safetensors.tmp-123",
            run / "eval_weights" / "step00000006" / "model.safetensors", run / ".config.yaml.tmp-77"]
    for path in kept + left:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    removed = clear_leftovers(run)
    assert all(path.exists() for path in kept) and not any(path.exists() for path in left)
    assert {p.name for p in removed} >= {".partial-step00000006", ".deleting-step00000002", ".partial-universal",
                                         "step00000006", ".config.yaml.tmp-77"}
    assert clear_leftovers(run) == [] and clear_leftovers(tmp_path / "absent") == []


def test_a_record_torn_by_a_kill_is_dropped(tmp_path):
    from fastmae.metrics import MetricsWriter, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{"kind": "train", "step": 2, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]  # read before the run resumes: the torn line left out
    writer = MetricsWriter(tmp_path, tensorboard=False)  # the resumed run appends after the last whole record
    writer.write({"kind": "train", "step": 2, "loss": 1.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 2.0), (2, 1.5)]


def test_rotation_keeps_the_newest_and_every_multiple_of_keep_every():
    """A save drops all but the newest `checkpoint.keep` checkpoints, except, with `checkpoint.keep_every`, those of
    its multiples (what a warmup-stable-decay branch starts from)."""
    from fastmae.checkpoint import rotated_out

    found = [(step, Path(f"step{step:08d}")) for step in range(5, 45, 5)]
    assert [p.name for p in rotated_out(found, 3)] == [f"step{s:08d}" for s in (5, 10, 15, 20, 25)]
    assert [p.name for p in rotated_out(found, 3, keep_every=10)] == [f"step{s:08d}" for s in (5, 15, 25)]
    assert rotated_out(found[:2], 3, keep_every=10) == []
