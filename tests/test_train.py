"""The DeepSpeed trainer on CPU ranks (the real engine): exact resume, configs, faults, two "nodes" on loopback.

Each launch costs ~20 s (process start, DeepSpeed init), so the runs are few and share one prepared dataset.
"""

import contextlib
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import warm_python
import yaml
from pinned import check_pinned
from safetensors.torch import load_file
from synthetic import prepare_word_dataset

from fastmae import PackedBatch
from fastmae.config import ModelConfig, load_run_config
from fastmae.data import PackedLoader
from fastmae.flops import plan_budget

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import chaos  # noqa: E402  (benchmarks/chaos.py: the launcher start the kill trials share)

MLM = {"model.preset": "mlm", "model.decoder_layers": 0}
WORDS = "the cat dog bird sat ran flew on under over a big small red green blue mat tree sky".split()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepare_word_dataset(tmp_path_factory.mktemp("train-data"), WORDS, 400, 60, vocab_size=40,
                                valid_fraction=0.1)


def overrides(dataset, run_dir, steps=6, **extra):
    values = {"model.preset": "mae-lm", "model.hidden_size": 32, "model.num_heads": 2, "model.encoder_layers": 2,
              "model.decoder_layers": 1, "model.intermediate_size": 64, "model.max_seq_len": 64,
              "data.path": str(dataset), "data.tokens_per_micro_batch": 256, "train.steps": steps,
              "train.warmup_steps": 2, "train.lr": 1e-3, "train.zero_stage": 2, "train.precision": "fp32",
              "eval.every": 3, "eval.sequences": 16,
              "checkpoint.every": 3, "checkpoint.keep": 2, "log.every": 1, "log.dir": str(run_dir),
              "log.tensorboard": False, "log.curves": False, **extra}
    return [f"{k}={v}" for k, v in values.items()]


PINNED_PEAK = "FASTMAE_FAULT_STARTUP_PEAK_FLOPS"  # the session's peak (conftest); empty: the run measures its own
SUITE_LAUNCHER = (str(ROOT / "tests" / "rank_launcher.py"),)


def launch(args, env_extra=None, ranks=2, timeout=300, launcher=SUITE_LAUNCHER):
    """`ranks` ranks of fastmae/train.py on this machine (benchmarks/chaos.py's `start`) under the suite's per-node
    launcher, tests/rank_launcher.py: what DeepSpeed's starts, without its ~6 s a launch. `launcher=chaos.
    DEEPSPEED_LAUNCHER` for DeepSpeed's own; the `deepspeed` command itself is tested by the two-node and
    launcher-SIGTERM tests."""
    process = chaos.start(args, ranks, env_extra, stdout=subprocess.PIPE, launcher=launcher)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


_free_port = chaos.free_port


def running_until(process: subprocess.Popen, until: Path, timeout=240) -> subprocess.Popen:
    """`process` (a run, stderr piped), left running once `until` exists."""
    deadline = time.monotonic() + timeout
    while not until.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"{until} never appeared:\n{process.communicate()[1][-3000:]}")
        time.sleep(0.05)
    return process


def train_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def records_of(run_dir, kind="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if r["kind"] == kind}


def as_if_killed_after(source, step, dest):
    """A copy of finished run `source` as a run killed right after step `step` leaves it: its checkpoints up to that
    step and its records up to that step (the hard kill itself is tested with FASTMAE_FAULT_AT_STEP)."""
    shutil.copytree(source, dest)
    for directory in (dest / "checkpoints").glob("step*"):
        if int(directory.name.removeprefix("step")) > step:
            shutil.rmtree(directory)
    for name in ("model.safetensors", "curves.png"):
        (dest / name).unlink(missing_ok=True)
    lines = (dest / "metrics.jsonl").read_text().splitlines()
    (dest / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] <= step))
    return dest


# ------------------------------------ a FLOP budget, a hard kill and damaged checkpoints (2 ranks, dropout on)
@pytest.fixture(scope="module")
def budget_plan(dataset):
    """About 8.5 steps' FLOPs, planned from both ranks' batches, evaluated after each third."""
    config = ModelConfig.preset("mae-lm", hidden_size=32, num_heads=2, encoder_layers=2, decoder_layers=1,
                                intermediate_size=64, max_seq_len=64, vocab_size=PackedLoader(dataset).vocab_size)
    stream = PackedLoader(dataset, max_seq_len=64, tokens_per_batch=256, world_size=2)  # both ranks' micro-batches
    budget = 8.5 * plan_budget(stream.every_rank(), config, 2, 1e30, exact_micro_batches=2).flops_per_step
    return budget, plan_budget(stream.every_rank(), config, 2, budget, eval_every_flops=budget / 3)


def budget_args(dataset, run_dir, budget, **extra):
    return overrides(dataset, run_dir, steps=1000, **{"train.flops_budget": budget, "eval.every_flops": budget / 3,
                                                      "eval.every": 0, "checkpoint.every": 1, "checkpoint.keep": 4,
                                                      **extra})


@pytest.fixture(scope="module")
def straight_with_dropout(dataset, budget_plan, tmp_path_factory):
    """The budget's steps on 2 ranks with dropout on, so a bit-identical resume needs every rank's RNG state back."""
    run_dir = tmp_path_factory.mktemp("fault") / "straight"
    run = launch(budget_args(dataset, run_dir, budget_plan[0]))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run_dir, run.stderr


@pytest.mark.xdist_group("fault")
def test_a_flop_budget_ends_and_evaluates_where_the_plan_says(straight_with_dropout, budget_plan):
    """train.flops_budget: the step count and evaluation points planned from both ranks' batches, and the FLOPs the
    ranks then count (summed) equal the plan's to the FLOP; the run logs, evaluates and keeps its newest 4
    checkpoints."""
    (run_dir, stderr), (budget, plan) = straight_with_dropout, budget_plan
    train, evals = records_of(run_dir), records_of(run_dir, "eval")
    assert plan.exact and sorted(train) == list(range(1, plan.steps + 1)) and 7 <= plan.steps <= 9
    assert train[plan.steps]["flops"] == plan.planned_flops <= budget
    assert sorted(evals) == list(plan.eval_steps)
    assert [train[s]["flops"] for s in sorted(train)] == sorted(r["flops"] for r in train.values())
    assert f"FLOP budget {budget:.4g}: {plan.steps} steps" in stderr
    assert all(0 <= r["accuracy"] <= 1 and r["tokens_per_s"] > 0 and mfu_as_its_peak_says(r) for r in train.values())
    assert all(0 <= e["accuracy"] <= 1 and e["mask_rate"] == 0.15 for e in evals.values())
    # keep the newest 4; a half-written checkpoint never counts
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step*")) == \
        [f"step{s:08d}" for s in range(plan.steps - 3, plan.steps + 1)]


@pytest.mark.xdist_group("fault")
def test_a_full_disk_then_a_kill_then_damaged_checkpoints_resume_from_the_newest_intact_one(
        dataset, straight_with_dropout, budget_plan, tmp_path):
    """One run through three faults, each resume continuing the last. Rank 1's disk fills up half-way through its
    part of step 5's checkpoint (FASTMAE_FAULT_ENOSPC: every file it writes, DeepSpeed's optimizer shard first,
    written by fastmae's one write) while rank 0's writes succeed: the run stops (no rank waits in a collective) with
    one line naming the rank, the directory, DeepSpeed's file and the space left. Run again, it clears the
    half-written checkpoint, resumes from step 4 and is killed hard right after step 6 (checkpoints 3-6 kept); the
    three newest are then damaged three ways (a flipped byte in the weights, a truncated optimizer shard, a garbage
    marker): `--resume auto` says what it skips and why, resumes from step 3 and ends bit-identical to the run that
    never failed (losses, FLOP count, weights)."""
    straight, budget = straight_with_dropout[0], budget_plan[0]
    run_dir = tmp_path / "faults"
    checkpoints = run_dir / "checkpoints"
    failed = launch(budget_args(dataset, run_dir, budget), env_extra={"FASTMAE_FAULT_ENOSPC": "1:5"}, timeout=240)
    assert failed.returncode != 0
    partial = checkpoints / ".partial-step00000005"
    assert re.search(rf"fastmae train \[rank 1 of 2\]: error: no space left on {re.escape(str(partial))} while "
                     r"writing zero_pp_rank_1_mp_rank_00_optim_states\.pt \([0-9,]+ bytes free\)", failed.stderr), \
        failed.stderr[-3000:]
    assert not list(partial.glob("zero_pp_rank_1_*"))  # the half-written shard never stands under its name
    assert partial.is_dir() and not (checkpoints / "step00000005").exists()

    killed = launch(budget_args(dataset, run_dir, budget), env_extra={"FASTMAE_FAULT_AT_STEP": "6"})
    assert killed.returncode != 0  # died hard right after the step-6 checkpoint
    assert f"removed {partial}, left half-written by an earlier run" in killed.stderr
    assert f"resumed from {checkpoints / 'step00000004'} at step 4" in killed.stderr
    assert sorted(p.name for p in checkpoints.glob("step*")) == [f"step0000000{s}" for s in (3, 4, 5, 6)]
    weights = checkpoints / "step00000006" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-100] ^= 0x01
    weights.write_bytes(bytes(raw))
    shard = next((checkpoints / "step00000005").glob("zero_pp_rank_1_*optim_states.pt"))
    shard.write_bytes(shard.read_bytes()[:-10])
    (checkpoints / "step00000004" / "COMPLETE").write_text("garbage{")
    resumed = launch(budget_args(dataset, run_dir, budget))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping checkpoint {checkpoints / 'step00000006'}: model.safetensors differs from its sha256" \
        in resumed.stderr
    assert f"skipping checkpoint {checkpoints / 'step00000005'}: {shard.name} has" in resumed.stderr
    assert f"skipping checkpoint {checkpoints / 'step00000004'}: unreadable COMPLETE marker" in resumed.stderr
    assert f"resumed from {checkpoints / 'step00000003'} at step 3" in resumed.stderr
    expected, got = records_of(straight), records_of(run_dir)
    assert {s: r["loss"] for s, r in got.items()} == {s: r["loss"] for s, r in expected.items()}
    assert {s: r["flops"] for s, r in got.items()} == {s: r["flops"] for s, r in expected.items()}
    a, b = load_file(straight / "model.safetensors"), load_file(run_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.xdist_group("fault")
def test_a_shard_that_vanishes_mid_run_stops_it_named_and_a_resume_once_restored_is_bit_identical(
        dataset, straight_with_dropout, budget_plan, tmp_path):
    """The training shard moved away while the ranks wait after step 1 (FASTMAE_FAULT_HOLD; the loader thread has
    read at most 4 steps ahead of the 7-9 planned): the run stops with the shard named, not with the old bytes of a
    map still open; moved back, the run resumes from its newest checkpoint and ends bit-identical to the run that
    never lost it."""
    data, run_dir = tmp_path / "data", tmp_path / "vanished"
    shutil.copytree(dataset, data)
    shard = data / "train" / "shard_00000.tokens"
    args = budget_args(data, run_dir, budget_plan[0])
    release = tmp_path / "release"
    run = running_until(chaos.start(args, 2, {"FASTMAE_FAULT_HOLD": f"1:{release}"}, launcher=SUITE_LAUNCHER),
                        run_dir / "checkpoints" / "step00000001")
    shard.rename(tmp_path / "aside")
    release.touch()
    _, stderr = run.communicate(timeout=240)
    assert run.returncode != 0
    assert f"error: {shard}: vanished during the run; restore it and resume" in stderr, stderr[-3000:]
    (tmp_path / "aside").rename(shard)
    resumed = launch(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    checkpoints = re.escape(str(run_dir / "checkpoints"))
    assert re.search(rf"resumed from {checkpoints}/step0000000[1-5] at step", resumed.stderr), resumed.stderr[-3000:]
    assert chaos.weights_sha256(run_dir) == chaos.weights_sha256(straight_with_dropout[0])


def test_non_finite_losses_on_one_rank_are_skipped_on_every_rank_alike_under_zero3_bf16(dataset, budget_plan,
                                                                                       tmp_path):
    """NaN losses (and gradients) in steps 3-4 on rank 1 only (FASTMAE_FAULT_NAN): the gradients every rank receives
    are NaN then, so a rank that stepped would hold NaN weights from there on; every rank skips both steps (counted),
    and the final weights, gathered from both ranks' shards, are finite. ZeRO-3 in bf16, with the relative bias table:
    sharded like every parameter and read once per pass for all encoder layers (MaskedLM's own parameter, gathered
    for its forward), it trains. (A burst longer than train.max_bad_steps:
    `test_non_finite_losses_are_skipped_then_stop_the_run`.)"""
    run_dir = tmp_path / "nan-on-rank1"
    run = launch(budget_args(dataset, run_dir, budget_plan[0], **{
        "model.relative_attention_bias": True, "train.zero_stage": 3, "train.precision": "bf16"}),
        env_extra={"FASTMAE_FAULT_NAN": "1:3-4"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "non-finite loss: 1 step(s) skipped up to step 3 (1 so far)" in run.stderr
    assert "non-finite loss: 1 step(s) skipped up to step 4 (2 so far)" in run.stderr
    records = records_of(run_dir)
    assert records[4]["skipped"] == 2 and all(r["loss"] == r["loss"] for r in records.values())
    weights = load_file(run_dir / "model.safetensors")
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
    early = load_file(run_dir / "checkpoints" / f"step{max(records) - 3:08d}" / "model.safetensors")["relative_bias"]
    assert early.shape == (64, 2) and (weights["relative_bias"] - early).abs().max() > 0


BUSY = "import torch\na = torch.randn(512, 512)\nwhile True:\n    a @ a"
"""Another job's work: matmuls on every core (one thread spinning in Python barely slows a GEMM down)."""


def mfu_as_its_peak_says(record: dict) -> bool:
    """A train record's MFU is a fraction of a measured peak, or absent where the peak was a rate the run achieved
    (which a busy machine can cause, so the suite accepts either, as the record names it)."""
    if record["peak_source"] == "achieved":
        return record["mfu"] is None
    return record["peak_source"] in ("measured", "remeasured") and 0 < record["mfu"] <= 1


def test_mfu_stays_a_fraction_when_the_peak_was_measured_on_a_busy_machine(dataset, tmp_path):
    """Another process keeps every core busy while the run measures its matmul peak, and stops right after (as a
    neighbouring job would); FASTMAE_FAULT_STARTUP_PEAK makes that peak read as low as the worst case seen (1.9
    against ~100 GFLOP/s), which real load reaches only sometimes. The first logged window beats the peak, the
    peak is measured again on the idle machine and taken (`peak_source: remeasured`: a GEMM runs far above this
    model's training rate), and every record's MFU is a fraction of the peak the record names."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        run = single_process(overrides(dataset, tmp_path / "busy", steps=6, **{
            **MLM, "model.hidden_size": 128, "model.intermediate_size": 512, "data.tokens_per_micro_batch": 512,
            "eval.every": 0, "checkpoint.every": 100}),
            env_extra={"FASTMAE_FAULT_STARTUP_PEAK": "0.02", PINNED_PEAK: ""})
        said = []
        for line in run.stderr:  # until the peak has been measured (under load)
            said.append(line)
            if "MFU divides by" in line:
                break
    finally:
        busy.kill()
        busy.wait()
    said = "".join(said) + run.communicate(timeout=300)[1]
    assert run.returncode == 0, said[-3000:]
    records = records_of(tmp_path / "busy")
    assert sorted(records) == list(range(1, 7))
    for step, record in records.items():
        assert mfu_as_its_peak_says(record), (step, record["mfu"], said[-2000:])
    # the first window beats the low peak and re-measures; where the machine is still busy then (the suite's other
    # worker), the re-measured GEMM may itself lose to the rate achieved and a later window measures again
    remeasured = [step for step, record in records.items() if record["peak_source"] == "remeasured"]
    assert remeasured and 0 < records[remeasured[0]]["mfu"] < 1, said[-2000:]
    first, last = records[1]["peak_flops"], records[6]["peak_flops"]
    assert last >= first > 0 and "step 1: " in said and "achieved beat the matmul peak" in said
    peaks = [records[step]["peak_flops"] for step in sorted(records)]
    assert peaks == sorted(peaks)  # raised, never lowered


BF16_SIZE = {"model.preset": "3ml", "model.hidden_size": 64, "model.num_heads": 4, "model.intermediate_size": 256,
             "train.precision": "bf16", "eval.every": 0}


def bf16_args(dataset, run_dir, stage):
    return overrides(dataset, run_dir, steps=4, **BF16_SIZE, **{"train.zero_stage": stage})


@pytest.fixture(scope="module")
def bf16_runs(dataset, tmp_path_factory):
    """The same bf16 run sharded two ways (on an AVX2-only CPU bf16 is emulated: a narrow model keeps it short):
    {stage: run directory}. The ZeRO-2 run measures its matmul peak (the suite's others take the session's:
    conftest's startup_peak)."""
    root = tmp_path_factory.mktemp("bf16")
    for stage in (2, 3):
        run = launch(bf16_args(dataset, root / f"z{stage}", stage),
                     env_extra={PINNED_PEAK: ""} if stage == 2 else None)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert ("(measured at start-up" if stage == 2 else "(given by FASTMAE_FAULT_STARTUP_PEAK_FLOPS") in run.stderr
    return {stage: root / f"z{stage}" for stage in (2, 3)}


@pytest.mark.xdist_group("zero3")
def test_zero3_bf16_matches_zero2_and_mfu_is_a_fraction(bf16_runs, tmp_path):
    runs = {stage: train_losses(run_dir) for stage, run_dir in bf16_runs.items()}
    assert sorted(runs[3]) == [1, 2, 3, 4]
    check_pinned("3ml-2-ranks-bf16", runs[2], other_machine_rel=1e-2)  # bf16: emulated on some CPUs
    for step, loss in runs[2].items():  # bf16 keeps 8 mantissa bits: the losses agree to well within 1%
        assert abs(runs[3][step] - loss) <= 5e-3 * abs(loss), (step, runs[2], runs[3])
    records = [json.loads(line) for line in (bf16_runs[2] / "metrics.jsonl").read_text().splitlines()]
    assert all(mfu_as_its_peak_says(r) for r in records if r["kind"] == "train"), [r["mfu"] for r in records]
    for stage in (2, 3):
        check_weights_and_export(bf16_runs[stage], tmp_path / f"hf{stage}")


def chaos_trial(args, run_dir, seed, first_checkpoint):
    """benchmarks/chaos.py's trial at a fixed seed: SIGKILL to the whole group or to rank 1 alone at a moment drawn
    uniformly over the 2 s after the run's first checkpoint (inside training, evaluation or a checkpoint write,
    whatever the machine's start-up time), then the same command until it finishes; under the suite's launcher
    (the benchmark's trials run DeepSpeed's). The ranks the suite's warm Python forked count among the processes
    left: the trial finds by command line only their clients (tests/warm_python.py)."""
    draw = random.Random(seed)
    kill_after, whole_group = draw.uniform(0, 2), draw.random() < 0.5
    record = chaos.trial(args, run_dir, kill_after, whole_group, clock_from=run_dir / "checkpoints" / first_checkpoint,
                         launcher=SUITE_LAUNCHER)
    record["processes_left"] += len(warm_python.forked_processes())
    return record, chaos.weights_sha256


@pytest.mark.xdist_group("fault")
def test_a_run_killed_at_a_random_moment_resumes_to_the_same_weights_zero2(dataset, straight_with_dropout,
                                                                           budget_plan, tmp_path):
    """ZeRO-2 with dropout: killed at a seeded moment past its first checkpoint, resumed until it ends, bit-identical
    to the run never killed; no process and no half-written file left, no more checkpoints than checkpoint.keep."""
    run_dir = tmp_path / "killed"
    record, digest = chaos_trial(budget_args(dataset, run_dir, budget_plan[0]), run_dir, 3, "step00000001")  # rank 1
    assert record["landed"] in ("training", "checkpoint write", "after the end"), record
    assert digest(run_dir) == digest(straight_with_dropout[0]), record
    assert record["processes_left"] == 0 and record["leftover_files"] == [] and record["checkpoints_kept"] <= 4
    assert records_of(run_dir).keys() == records_of(straight_with_dropout[0]).keys()


def check_weights_and_export(run_dir, export_dir):
    """The run's weights are the fp32 masters (the end-of-run file equals the last checkpoint's), and its
    Hugging Face export computes what fastmae computes from them."""
    final = load_file(run_dir / "model.safetensors")
    assert "embeddings.tokens.weight" in final
    assert any((t.bfloat16().float() != t).any() for t in final.values())  # not the bf16 copy
    last = load_file(run_dir / "checkpoints" / "step00000004" / "model.safetensors")
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    transformers = pytest.importorskip("transformers")
    from fastmae.export import export
    from fastmae.pretrained import load_pretrained

    for source in (run_dir, run_dir / "checkpoints" / "step00000003"):
        pretrained = load_pretrained(source)
        assert pretrained.step == (4 if source == run_dir else 3)
        out = export(source, export_dir, overwrite=True)
        ids = [pretrained.tokenizer.encode(["the cat sat on the mat under a big green tree"])[0]]
        ids = [[1, *ids[0], 2]]
        with torch.no_grad():
            ours = pretrained.encoder().eval().encode(PackedBatch.from_sequences(ids))
            theirs = transformers.AutoModel.from_pretrained(out).eval()(torch.tensor(ids)).last_hidden_state[0]
        assert (ours - theirs).abs().max() <= 1e-5


@pytest.mark.parametrize("warm_up", [False, True])
def test_loss_weighs_every_predicted_token_of_the_step_the_same(dataset, tmp_path, warm_up):
    """2 ranks x grad_accum 2 take the same update as one process on the four micro-batches as one batch; with a batch
    warm-up's first step (1 micro-batch a rank of the full 2: DeepSpeed's accumulation set to 1), on those two.

    AdamW with eps far above every |gradient| makes the first update lr / eps * gradient (linear in it), so a
    micro-batch weighted wrongly moves the weights measurably."""
    from fastmae import MaskedLM
    from fastmae.config import ModelConfig
    from fastmae.data import PackedLoader

    lr, eps, seed = 1e3, 1e3, 1 if warm_up else 0  # seeds whose micro-batches predict unlike counts
    run = launch(overrides(dataset, tmp_path / "w", steps=1, **{
        "data.packing": "doc", "train.grad_accum": 2, "train.lr": lr, "train.eps": eps, "train.warmup_steps": 0,
        "train.clip": 0.0, "train.weight_decay": 0.0, "model.dropout": 0.0, "model.attention_dropout": 0.0,
        "eval.every": 0, "train.seed": seed,
        **({"train.batch_warmup_tokens": 10**6, "train.batch_warmup_from": 512} if warm_up else {})}))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    config = ModelConfig.preset("mae-lm", hidden_size=32, num_heads=2, encoder_layers=2, decoder_layers=1,
                                intermediate_size=64, max_seq_len=64, vocab_size=40, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = MaskedLM(config)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    loss_sum, counts = 0.0, []
    for rank in (0, 1):
        loader = iter(PackedLoader(dataset, "train", max_seq_len=64, packing="doc", tokens_per_batch=256, rank=rank,
                                   world_size=2, grad_accum=2, seed=seed))
        for i in (0,) if warm_up else (0, 1):  # the step's micro-batches rank, rank + 2; masks follow that place
            out = model(next(loader), seed=seed, step=i * 2 + rank)
            loss_sum = loss_sum + out.loss * out.num_predicted
            counts.append(out.num_predicted)
    assert len(set(counts)) > 1 and len(counts) == (2 if warm_up else 4), counts  # unlike predicted tokens
    (loss_sum / sum(counts)).backward()
    expected = {name: initial[name] - lr * p.grad / (p.grad.abs() + eps) for name, p in model.named_parameters()}
    got = load_file(tmp_path / "w" / "model.safetensors")
    for name, value in expected.items():
        step = (value - initial[name]).abs().max()
        # fp32 sums in another order: within 1e-4 of the update's size
        assert (got[name] - value).abs().max() <= 1e-4 * step + 1e-7, name


def test_two_nodes_on_loopback_stop_when_one_nodes_deepspeed_command_gets_sigterm(dataset, tmp_path):
    """The `deepspeed` command on each of two nodes on loopback (a hostfile of two, --no_ssh), one rank each: a world
    of 2 whose first two steps are the pinned ones. Then SIGTERM to node 1's command alone (DeepSpeed's runner has no
    handler: it dies at once): its rank notices its launcher gone, both ranks finish the step, write one complete
    checkpoint and exit, rank 0 (on node 0) saying why, and so does every launcher."""
    import psutil

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port, run_dir = str(_free_port()), tmp_path / "two-nodes"
    env = warm_python.environment(PYTHONUNBUFFERED="1")  # started cold: DeepSpeed's launcher is the subject
    deepspeed = shutil.which("deepspeed") or "deepspeed"

    def node(rank):
        cmd = [deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank), "--master_addr",
               "127.0.0.1", "--master_port", port, str(ROOT / "fastmae" / "train.py"),
               *overrides(dataset, run_dir, steps=100_000, **MLM, **{"eval.every": 0, "checkpoint.every": 100_000})]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    second, first = node(1), node(0)
    deadline = time.monotonic() + 240
    while len(records_of(run_dir) if (run_dir / "metrics.jsonl").is_file() else {}) < 2:
        assert first.poll() is None and second.poll() is None and time.monotonic() < deadline, \
            (first.poll(), second.poll())
        time.sleep(0.2)
    family = [p for command in (first, second) for p in psutil.Process(command.pid).children(recursive=True)]
    assert len([p for p in family if "--local_rank" in " ".join(p.cmdline())]) == 2
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=10) == -signal.SIGTERM  # the command itself dies at once: exit 143 in a shell
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    out0, _ = first.communicate(timeout=60)
    assert first.returncode == 0, out0[-3000:]
    saved = sorted((run_dir / "checkpoints").glob("step*"))
    assert len(saved) == 1 and json.loads((saved[0] / "COMPLETE").read_text())["world_size"] == 2
    assert "the launcher of rank 1 is gone: saving a checkpoint and exiting" in out0 and f"saved {saved[0]}" in out0
    check_pinned("mlm-2-ranks", {step: loss for step, loss in train_losses(run_dir).items() if step <= 2})


@pytest.mark.parametrize("override, message", [
    ("train.lr=fast", "train.lr: expected float"),
    ("model.hidden_size=129", "model.hidden_size=129: must be divisible by num_heads"),
    ("train.zero_stage=5", "train.zero_stage=5"),
    ("data.packing=zigzag", "data.packing='zigzag'"),
    ("optimizer.lr=3", "unknown section"),
    # a typo's nearest key is named (difflib), none where nothing is near
    ("train.stepz=4", r"unknown key train.stepz \(did you mean train.steps\?\); known: \["),
    ("traim.steps=3", r"unknown section\(s\) \['traim'\] \(did you mean train\?\)"),
    ("model.presett=3ml", r"unknown model field\(s\) presett \(did you mean model.preset\?\); known"),
    ("model.zzz=1", r"unknown model field\(s\) zzz; known"),
    ("log.every=0", "log.every=0: must be positive"),
    ("checkpoint.every=0", "checkpoint.every=0: must be positive"),
    ("checkpoint.keep=-1", "checkpoint.keep=-1"),
    ("checkpoint.keep_every=7", "checkpoint.keep_every=7: must be 0 or a multiple of checkpoint.every"),
    ("train.steps=-5", "train.steps=-5: must be positive"),
    ("train.warmup_steps=-1", "train.warmup_steps=-1"),
    ("train.precision=fp8", "train.precision='fp8'"),
    ("train.schedule=cosine", r"train.schedule='cosine': must be one of \('linear', 'polynomial', 'wsd'\)"),
    ("train.decay_shape=sqrt", "train.decay_shape='sqrt': must be one of"),
    ("eval.sequences=0", "eval.sequences=0: must be positive"),
    ("eval.every=-1", "eval.every=-1"),
    ("eval.mask_rate=1.5", "eval.mask_rate=1.5"),
    ("data.builtin_valid_fraction=0", "data.builtin_valid_fraction=0"),
    # the model section's values are typed as they load (issue 57), the field, value and type named
    ("model.mask_rate={start: 0.5}", r"model.mask_rate: expected float, got \{'start': 0.5\}"),
    ("model.dropout=[1]", r"model.dropout: expected float, got \[1\]"),
    ("model.encoder_layers=two", "model.encoder_layers: expected int, got 'two'"),
    ("model.ffn_gated=1", "model.ffn_gated: expected bool, got 1"),
    ("model.preset=[mlm]", r"model.preset: expected str \(mlm, mae-lm or 3ml\), got \['mlm'\]"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(str(ROOT / "configs" / "tiny-cpu.yaml"), [override])


def test_floats_in_exponent_notation_are_floats():
    # YAML 1.1 reads "2e-3" as a string; a learning rate written that way must still work
    assert load_run_config(str(ROOT / "configs" / "tiny-cpu.yaml"), ["train.lr=2e-3"]).train.lr == 2e-3


@pytest.mark.parametrize("name", ["tiny-cpu", "roberta-base", "mae-lm-base", "3ml-base", "roberta-large",
                                  "mae-lm-large", "3ml-large", "modernbert-base", "modernbert-large",
                                  "modernbert-3ml-base", "modernbert-3ml-large", "modernbert-mae-lm-base",
                                  "modernbert-mae-lm-large", "mlm30-wsd-base"])
def test_shipped_configs_load(name, tmp_path):
    # the recipes' data/pretrain is not prepared here: its vocabulary must then be written
    overrides = [] if name == "tiny-cpu" else ["model.vocab_size=32000"]
    config = load_run_config(str(ROOT / "configs" / f"{name}.yaml"), overrides)
    assert config.model.objective in ("mlm", "mae-lm", "3ml")
    (tmp_path / "resolved.yaml").write_text(config.to_yaml())  # what a run directory's config.yaml holds
    assert load_run_config(str(tmp_path / "resolved.yaml"), overrides) == config


def test_model_vocabulary_comes_from_the_dataset(tmp_path):
    dataset = tmp_path / "data"
    with pytest.raises(ValueError, match=rf"data.path: {dataset}/meta.json: missing; run `fastmae prepare"):
        load_run_config(None, [f"data.path={dataset}"])
    dataset.mkdir()
    (dataset / "meta.json").write_text(json.dumps({"vocab_size": 1234}))
    assert load_run_config(None, [f"data.path={dataset}", "model.preset=3ml"]).model.vocab_size == 1234
    with pytest.raises(ValueError, match=r"model.vocab_size=999 but the dataset of data.path=.* has a vocabulary of "
                                         r"1234"):
        load_run_config(None, [f"data.path={dataset}", "model.preset=mlm", "model.vocab_size=999"])
    (dataset / "meta.json").write_text("{")
    with pytest.raises(ValueError, match=r"meta.json: unreadable dataset metadata"):
        load_run_config(None, [f"data.path={dataset}"])
    builtin = load_run_config(None, ["data.builtin_vocab_size=700"]).model
    assert (builtin.vocab_size, builtin.objective) == (700, "mae-lm")


@pytest.mark.parametrize("name, micro, accum_by_world", [("roberta-base", 32768, {8: 16, 64: 2}),
                                                          ("roberta-large", 8192, {8: 64, 64: 8}),
                                                          ("mae-lm-base", 32768, {8: 4, 32: 1})])
def test_recipes_fix_tokens_per_step_whatever_the_gpu_count(name, micro, accum_by_world):
    config = load_run_config(str(ROOT / "configs" / f"{name}.yaml"), ["model.vocab_size=32000"])
    assert config.data.tokens_per_micro_batch == micro
    for world, accum in accum_by_world.items():
        derived = config.for_world(world).train
        assert derived.grad_accum == accum and world * accum * micro == config.train.tokens_per_step


@pytest.mark.parametrize("name", ["modernbert-base", "modernbert-3ml-base", "modernbert-mae-lm-base"])
def test_the_modernbert_recipes_steps_hold_its_tokens_through_the_batch_warm_up(name):
    """ModernBERT-base's 50B-token batch warm-up from 768 sequences: on the 8 GPUs the recipes' comment names, the
    learning-rate warm-up's steps are the first to hold 3B tokens and the run's the first to hold 1.719T."""
    from fastmae.data.order import StepSizes

    config = load_run_config(str(ROOT / "configs" / f"{name}.yaml"), ["model.vocab_size=32000"])
    train, micro = config.for_world(8).train, config.data.tokens_per_micro_batch
    sizes = StepSizes.of_train(train, 8, micro)
    assert (sizes.start * micro, sizes.full * micro, len(sizes.ends)) == (768 * 1024, 4608 * 1024, 15)

    warming = np.cumsum([sizes.count(step) * micro for step in range(sizes.ends[-1])])

    def first_step_holding(tokens):  # the steps before it hold fewer
        if tokens <= warming[-1]:
            return int(np.searchsorted(warming, tokens)) + 1
        return sizes.ends[-1] + math.ceil((tokens - warming[-1]) / (sizes.full * micro))

    assert (first_step_holding(3e9), first_step_holding(1.719e12)) == (train.warmup_steps, train.steps)


def test_the_time_left_counts_the_micro_batches_left_not_the_steps(monkeypatch):
    """A log file's progress line under a batch warm-up (steps of 1, 1, 1, 2, 2, 3, 3, 3, then 4 micro-batches): 10 s
    for the first 5 steps, 7 micro-batches, leaves 25 micro-batches at 10 / 7 s each (StepSizes.before counts them),
    not 7 steps at 2 s; the same on a terminal's bar (tqdm's, its rate the one that gives that time left)."""
    from fastmae import distributed
    from fastmae.data.order import StepSizes

    sizes = StepSizes.warming_up(1, 4, 100, 1500, 100)
    assert sizes.ends == (3, 5, 8) and [sizes.before(step) for step in range(13)] == [
        sum(sizes.count(s) for s in range(step)) for step in range(13)]
    said = []
    monkeypatch.setattr(distributed, "log_line", said.append)
    progress = distributed.PlainProgress(12, 0, sizes.before)
    progress.start -= 10.0
    progress.update(5)
    progress.set_postfix("1.0", "100")
    assert said[-1].startswith("step 5/12 (41%)") and said[-1].endswith(", 00:10 elapsed, ~00:35 left")
    terminal = io.StringIO()  # a terminal's bar, whose time left is the same
    with contextlib.closing(distributed.WorkBar(total=12, work=sizes.before, file=terminal, mininterval=0)) as bar:
        bar.start_t -= 10.0
        bar.update(5)
    assert "5/12 [00:10<00:35," in terminal.getvalue()
    # without a warm-up, steps are the measure
    plain = distributed.PlainProgress(12, 0, StepSizes(1).before)
    plain.start -= 10.0
    plain.update(5)
    plain.set_postfix("1.0", "100")
    assert said[-1].endswith(", 00:10 elapsed, ~00:14 left")


def test_plan_says_what_a_recipe_does_on_a_rank_count_without_training(capsys):
    """`fastmae train --plan RANKS`: the run's first lines for that many ranks (the batch warm-up's sizes follow the
    rank count) and its steps' nominal tokens, then exit; a count the batch does not divide is the run's error."""
    from fastmae.train import main

    recipe = ["--config", str(ROOT / "configs" / "modernbert-base.yaml"), "model.vocab_size=50368"]
    run_dir = ROOT / "runs" / "modernbert-base"
    existed = run_dir.exists()
    assert main([*recipe, "--plan", "8"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[1] == ("global batch: 8 rank(s) x 18 micro-batch(es) of at most 32,768 tokens (4,718,592 tokens a "
                       "step); warmed up from 786,432 tokens a step over the first 50,000,000,000 tokens")
    assert "batch warm-up: 3 -> 18 micro-batch(es) of 32,768 tokens a rank a step" in said[2]
    assert said[3] == "372,782 steps, at most 1,719,004,299,264 tokens; run directory runs/modernbert-base"
    assert main([*recipe, "--plan", "16"]) == 0
    assert "batch warm-up: 1 -> 9 micro-batch(es)" in capsys.readouterr().out  # 512 sequences: 1 a rank
    assert main([*recipe, "--plan", "5"]) == 1
    assert capsys.readouterr().err.startswith("fastmae train --plan: error: train.tokens_per_step=4718592 is not a "
                                              "multiple of 5 rank(s)")
    assert main([*recipe, "train.batch_warmup_from=10000000", "--plan", "8"]) == 1  # the warm-up's own refusal
    assert "train.batch_warmup_from=10000000 is not below the full step's 18" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*recipe, "--plan", "0"])
    assert "--plan 0: the number of ranks must be at least 1" in capsys.readouterr().err
    assert run_dir.exists() == existed  # nothing written


def test_tokens_per_step_that_does_not_divide_names_the_values():
    config = load_run_config(str(ROOT / "configs" / "roberta-base.yaml"), ["model.vocab_size=32000"])
    with pytest.raises(ValueError, match=r"train.tokens_per_step=4194304 is not a multiple of 3 rank\(s\) x "
                                         r"data.tokens_per_micro_batch=32768 = 98304"):
        config.for_world(3)
    clash = load_run_config(str(ROOT / "configs" / "roberta-base.yaml"),
                            ["train.grad_accum=4", "model.vocab_size=32000"])
    with pytest.raises(ValueError, match=r"train.grad_accum=4 disagrees .* \(which gives 16\)"):
        clash.for_world(8)
    assert clash.for_world(32).train.grad_accum == 4  # 4,194,304 / (32 x 32,768): the value given agrees
    plain = load_run_config(str(ROOT / "configs" / "tiny-cpu.yaml"))
    assert plain.for_world(2) is plain  # no tokens_per_step: grad_accum as written


# ---------------------------------------- one run on 2 ranks, one in one process: elastic resume, compile, CLI
ELASTIC = {"train.tokens_per_step": 512, "model.dropout": 0.0, "model.attention_dropout": 0.0, "eval.every": 0}


@pytest.fixture(scope="module")
def two_ranks(dataset, tmp_path_factory):
    """The uninterrupted run the elastic ones are compared with: 2 ranks, 2 micro-batches of 256 tokens a step."""
    run_dir = tmp_path_factory.mktemp("elastic") / "two-ranks"
    run = launch(overrides(dataset, run_dir, **ELASTIC))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def one_process(dataset, tmp_path_factory):
    """The same run through `python -m fastmae.train`: one process, grad_accum 2 derived from tokens_per_step."""
    run_dir = tmp_path_factory.mktemp("elastic") / "one-process"
    proc = single_process(overrides(dataset, run_dir, **ELASTIC, **{"log.curves": True}))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return run_dir


@pytest.mark.xdist_group("elastic")
def test_single_process_entry_point_and_bad_config(dataset, one_process, tmp_path):
    assert (one_process / "model.safetensors").is_file() and (one_process / "curves.png").is_file()
    resolved = yaml.safe_load((one_process / "config.yaml").read_text())
    assert resolved["train"]["grad_accum"] == 2 and resolved["train"]["tokens_per_step"] == 512
    # the same run directory with another model is refused, not silently mixed
    shutil.copytree(one_process, tmp_path / "one")
    other = single_process(overrides(dataset, tmp_path / "one", **{**ELASTIC, "model.preset": "mlm",
                                                                    "model.decoder_layers": 0}))
    _, stderr = other.communicate(timeout=300)
    assert other.returncode == 1 and "saved for another model" in stderr.strip().splitlines()[-1]
    bad = single_process(overrides(dataset, tmp_path / "bad", steps=2, **{"train.tokens_per_step": 1000}))
    _, stderr = bad.communicate(timeout=300)
    assert bad.returncode == 1 and "train.tokens_per_step=1000 is not a multiple of 1 rank(s)" in stderr
    bad = single_process(["train.stepz=3"])
    _, stderr = bad.communicate(timeout=120)
    assert bad.returncode == 2 and "unknown key train.stepz" in stderr and len(stderr.splitlines()) == 1


def assert_same_run(expected_dir, got_dir):
    """Every step drew the same sequences (the logged digest of each step's sequence ids); with dropout off the
    losses and final weights agree up to the order of fp32 sums (gradients reduced over ranks or accumulated)."""
    expected, got = records_of(expected_dir), records_of(got_dir)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    assert [got[s]["data_digest"] for s in got] == [expected[s]["data_digest"] for s in got]
    assert len({expected[s]["data_digest"] for s in expected}) == 6  # the digests tell steps apart
    for step in expected:
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-4), step
        assert got[step]["tokens_seen"] == expected[step]["tokens_seen"]
        assert got[step]["flops"] == expected[step]["flops"]
    a, b = load_file(expected_dir / "model.safetensors"), load_file(got_dir / "model.safetensors")
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-6), name


@pytest.mark.xdist_group("elastic")
def test_one_process_and_two_ranks_train_the_same_steps(two_ranks, one_process):
    assert_same_run(two_ranks, one_process)
    assert not (two_ranks / "curves.png").exists()  # log.curves=false (the one process drew its curves)
    check_pinned("mae-lm-2-ranks", train_losses(two_ranks))
    check_pinned("mae-lm-1-process", train_losses(one_process))


@pytest.mark.xdist_group("elastic")
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_number_of_ranks(dataset, tmp_path, two_ranks, one_process, before, after):
    """Checkpointed on `before` ranks at step 3, resumed on `after` without restating the batch: the resume keeps the
    checkpoint's global batch (accumulation follows the ranks) and takes the same steps as the uninterrupted run.
    The one process resumes with train.compile on (through DeepSpeed, dropout off so that neither draws): the same
    losses and weights as the eager run, to fp32's summation order."""
    run_dir = as_if_killed_after(two_ranks if before == 2 else one_process, 3, tmp_path / "elastic")
    args = overrides(dataset, run_dir, **{k: v for k, v in ELASTIC.items() if k != "train.tokens_per_step"})
    if after == 1:
        resumed = single_process([*args, "train.compile=true"])
        _, stderr = resumed.communicate(timeout=600)
    else:
        resumed = launch(args, ranks=after)
        stderr = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, stderr[-3000:]
    assert f"saved by {before} rank(s): converting it to DeepSpeed's universal checkpoint for {after}" in stderr
    assert_same_run(two_ranks, run_dir)


def test_a_batch_warm_up_takes_the_smaller_steps_first_and_resumes_into_the_full_ones(dataset, tmp_path):
    """train.batch_warmup_tokens on 2 ranks (ZeRO-2): full steps of 2 micro-batches a rank, the first 3 of 1 (1,536
    tokens from 512; what such a step computes: test_loss_weighs_every_predicted_token_of_the_step_the_same), then
    the full steps; a resume at the change, on 2 ranks or on one process (the global batch kept, accumulation following
    the ranks), takes the same steps as the run did."""
    warm = {**ELASTIC, "train.tokens_per_step": 1024, "train.batch_warmup_tokens": 1536, "train.batch_warmup_from": 512}
    run_dir = tmp_path / "warm"
    run = launch(overrides(dataset, run_dir, **warm))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "batch warm-up: 1 -> 2 micro-batch(es) of 256 tokens a rank a step" in run.stderr
    got = records_of(run_dir)
    per_step = [got[step]["tokens_seen"] - got.get(step - 1, {"tokens_seen": 0})["tokens_seen"] for step in got]
    assert min(per_step[3:]) > max(per_step[:3]) > 0
    from fastmae.export import batch_line  # the model card's line, from the run's resolved config

    assert batch_line(yaml.safe_load((run_dir / "config.yaml").read_text()), 2) == (
        "2 rank(s) x 2 micro-batch(es) of at most 256 tokens (1,024 tokens a step); warmed up from 512 tokens a step "
        "over the first 1,536 tokens")
    resumed_dir = as_if_killed_after(run_dir, 3, tmp_path / "resumed")
    resumed = launch(overrides(dataset, resumed_dir, **warm))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    again = records_of(resumed_dir)
    assert [again[s]["data_digest"] for s in again] == [got[s]["data_digest"] for s in got]
    for step in got:
        assert again[step]["loss"] == pytest.approx(got[step]["loss"], rel=1e-6), step
    # on one process (its warm-up's sizes its own: 2 and 3 micro-batches, the full 4 from step 3), the full steps
    one_dir = as_if_killed_after(run_dir, 3, tmp_path / "one")
    one = single_process(overrides(dataset, one_dir, **{k: v for k, v in warm.items() if k != "train.tokens_per_step"}))
    _, stderr = one.communicate(timeout=300)
    assert one.returncode == 0 and "the full step from step 3" in stderr, stderr[-3000:]
    assert "resuming 2 rank(s)' run on 1: the same micro-batches follow, 4 per step;" in stderr
    from fastmae.continuation import elastic_batches
    from fastmae.data.order import StepSizes

    assert elastic_batches(StepSizes.warming_up(1, 4, 256, 1536, 512), 1) == (  # a resume inside the warm-up
        "the same micro-batches follow, 4 per step from step 3; the batch warm-up's steps until then take this rank "
        "count's sizes (2 micro-batches at step 2)")
    alone = records_of(one_dir)
    assert [alone[s]["data_digest"] for s in alone] == [got[s]["data_digest"] for s in got]
    for step in got:
        assert alone[step]["loss"] == pytest.approx(got[step]["loss"], rel=1e-4), step


def single_process(args, timeout=300, env_extra=None, **popen):
    env = warm_python.environment(PYTHONUNBUFFERED="1", **(env_extra or {}))
    return subprocess.Popen([*warm_python.COMMAND, "-m", "fastmae.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def test_a_checkpoint_directory_that_vanishes_mid_run_stops_it_named_and_the_resume_logs_what_it_averages(
        dataset, tmp_path):
    """The run's checkpoint directory moved away while the run waits after step 3 (FASTMAE_FAULT_HOLD), as a deleted
    directory or an unmounted file system would leave it: the next save stops the run naming it, and nothing is
    created in its place (checkpoints would land where the resume does not look); moved back, the run resumes from
    its step-3 checkpoint and finishes, with the pinned losses. log.every=2: records average two steps, but the first
    after the resume (at step 3) only one, and says so."""
    run_dir, release = tmp_path / "run", tmp_path / "release"
    checkpoints = run_dir / "checkpoints"
    args = overrides(dataset, run_dir, steps=5, **MLM, **{"log.every": 2, "checkpoint.every": 1, "checkpoint.keep": 5,
                                                           "eval.every": 0})
    run = running_until(single_process(args, env_extra={"FASTMAE_FAULT_HOLD": f"3:{release}"}),
                        checkpoints / "step00000003")
    checkpoints.rename(tmp_path / "aside")
    release.touch()
    _, stderr = run.communicate(timeout=240)
    assert run.returncode == 1, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"fastmae train: error: {checkpoints}: vanished during the run (deleted, moved, or its file system "
        "unmounted), and the checkpoints this run wrote there with it; not re-created, so that no checkpoint lands "
        "where a resume would not look: restore it and resume")
    assert not checkpoints.exists()
    (tmp_path / "aside").rename(checkpoints)
    resumed = single_process(args)
    _, stderr = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, stderr[-3000:]
    assert f"resumed from {checkpoints / 'step00000003'} at step 3" in stderr
    averaged = {s: r["averaged_steps"] for s, r in records_of(run_dir).items()}
    assert averaged == {2: 2, 4: 1, 5: 1}
    check_pinned("mlm-1-process-resumed", train_losses(run_dir))


def test_a_mistyped_data_path_is_an_error_not_the_embedded_corpus(tmp_path):
    """The demo config builds the embedded corpus only for `data.path: builtin`; any other missing path stops."""
    typo = tmp_path / "runs" / "data" / "bultin-v1000"
    proc = single_process(["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), f"data.path={typo}",
                           f"log.dir={tmp_path / 'run'}", "train.steps=1"])
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2  # a config error, found when the config loads
    assert stderr.strip().splitlines()[-1] == (f"fastmae train: error: data.path: {typo / 'meta.json'}: missing; run "
                                               f"`fastmae prepare --output {typo}` first (or set model.vocab_size "
                                               "to load this config without its data)")
    assert not typo.exists()
    demo = load_run_config(str(ROOT / "configs" / "tiny-cpu.yaml")).data
    assert demo.path == "builtin" and demo.directory == Path("runs/data/builtin-v1000")
    with pytest.raises(ValueError, match="prepare_builtin"):  # the old switch is gone, and says so by name
        load_run_config(str(ROOT / "configs" / "tiny-cpu.yaml"), ["data.prepare_builtin=true"])


def test_non_finite_losses_are_skipped_then_stop_the_run(dataset, tmp_path):
    """An absurd learning rate blows the weights up within a few steps; every later loss is non-finite. A checkpoint
    every step, 2 kept, 4 bad steps allowed in a row: the run stops naming the 4 steps, and the newest checkpoint
    left is the one from the step before them (written inside the streak, checkpoints would rotate it out)."""
    run_dir = tmp_path / "nan"
    proc = single_process(overrides(dataset, run_dir, steps=50, **{
        "train.lr": 1e12, "train.clip": 0.0, "train.warmup_steps": 0, "train.max_bad_steps": 4, "eval.every": 0,
        "checkpoint.every": 1, "checkpoint.keep": 2}))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-2000:]
    assert "step(s) skipped" in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("fastmae train: error: ") and "optimizer steps in a row with a non-finite loss" in last
    steps = re.search(r"(\d+) optimizer steps in a row with a non-finite loss \(steps (\d+)-(\d+)\): stopping; "
                      "the checkpoints written before them are kept", last)
    assert steps and int(steps[1]) == 4 and int(steps[3]) - int(steps[2]) == 3, last  # the steps named
    first_bad = int(steps[2])
    assert first_bad > 1, stderr[-2000:]  # a checkpoint before the streak exists to be kept
    kept = sorted(int(p.name.removeprefix("step")) for p in (run_dir / "checkpoints").glob("step*"))
    assert kept[-1] == first_bad - 1, (kept, last)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-device synchronisation is a CUDA matter")
@pytest.mark.parametrize("objective", ["mlm", "3ml"])
def test_the_steady_state_step_never_waits_for_the_gpu(dataset, tmp_path, objective):
    """FASTMAE_SYNC_DEBUG=1 turns torch.cuda.set_sync_debug_mode("error") on around every steady-state step (past
    warm-up, not logged), DeepSpeed's optimizer step and the next micro-batches' one-copy transfers included: any
    .item(), .tolist() or blocking copy raises. ZeRO-2, whose norm DeepSpeed computes on the device (fastmae clips by
    it; no overflow check). 3ml's run gives cuBLAS no workspace (train.cublas_workspace=none), as the log says."""
    workspace = "none" if objective == "3ml" else "default"
    proc = single_process(overrides(dataset, tmp_path / objective, steps=8, **{
        "model.preset": objective, "model.decoder_layers": 0 if objective == "mlm" else 1, "train.precision": "bf16",
        "train.zero_stage": 2, "train.grad_accum": 2, "eval.every": 0, "checkpoint.every": 100, "log.every": 4,
        "train.cublas_workspace": workspace}), env_extra={"FASTMAE_SYNC_DEBUG": "1"})
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert f"cuBLAS workspace: {workspace if workspace == 'none' else 'torch'}" in stderr, stderr[-3000:]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(dataset, tmp_path):
    import signal
    import time

    run_dir = tmp_path / "term"
    proc = single_process(overrides(dataset, run_dir, steps=100000, **{
        "model.preset": "3ml", "eval.every": 0, "checkpoint.every": 100000}))
    deadline = time.time() + 240
    while not (run_dir / "metrics.jsonl").is_file() and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert "stop requested" in stderr
    saved = sorted((run_dir / "checkpoints").glob("step*"))
    assert len(saved) == 1 and (saved[0] / "COMPLETE").is_file()
    check_pinned("3ml-1-process-first-step", {1: train_losses(run_dir)[1]})


SCRIPT_END = """
# ended as fastmae's entry point ends (fastmae/train.py: main, exit_now): the process group's threads stopped here and
# the interpreter's teardown skipped, where a process that had finished its script once aborted ("terminate called
# without an active exception", exit -6)
import os, sys, torch.distributed
torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""
"""The end of a `python -c` script of the suite that trains in a process group of its own."""


WORLD_OF_ONE = """
import contextlib
import dataclasses
import sys

import torch
from fastmae.distributed import init_distributed, set_world_of_one_env
set_world_of_one_env()
from fastmae.engine import build_engine, gradient_norm, master_weights
init_distributed()
sys.path.insert(0, "benchmarks")
from host_overhead import StepCounter
import systems
import fastmae.step
from fastmae import MaskedLM, ModelConfig, PackedBatch
from fastmae.config import RunConfig
from fastmae.step import train_step

# host-device syncs asked for by DeepSpeed or torch in the steady-state steps (host reads, tensors from host data,
# the accelerator's synchronize): none (bf16 ZeRO-1's norm check, DeepSpeed's two a step, is left to
# fastmae's skip flag on the device: fastmae/zero_patches.py)
KNOWN_SYNCS = {("fp32", 0): {}, ("bf16", 2): {}, ("bf16", 1): {}}
config = ModelConfig.preset("3ml", vocab_size=50, hidden_size=32, num_heads=2, encoder_layers=2, max_seq_len=32)
batches = [dataclasses.replace(PackedBatch.from_sequences(
    torch.randint(5, 50, (3, 20), generator=torch.Generator().manual_seed(i)).tolist()), index=i) for i in range(3)]


def engine_of(precision, model=None, deepspeed=None, **train):
    # (model, engine, skip flag): `model` (by default a MaskedLM of `config` from seed 0) under build_engine's
    # DeepSpeed engine, the run config's defaults with lr 1e-2, one warm-up step and the `train` fields given
    if model is None:
        torch.manual_seed(0)
        model = MaskedLM(config)
    run = RunConfig()
    run.train.lr, run.train.warmup_steps = 1e-2, 1
    for key, value in train.items():
        setattr(run.train, key, value)
    run.deepspeed = deepspeed or {}
    non_finite = torch.zeros(())
    engine, _ = build_engine(model, run, precision, torch.device("cpu"), non_finite)
    return model, engine, non_finite


for precision, stage in KNOWN_SYNCS:
    weights = []
    for allreduce in (True, False) if stage < 2 else (True,):
        torch.manual_seed(0)
        model = MaskedLM(config)
        initial = [p.detach().float().clone() for p in model.parameters()]
        model, engine, non_finite = engine_of(precision, model, zero_stage=stage)
        if stage < 2:
            assert engine.enable_backward_allreduce is False, (precision, stage)  # nothing to average in a world of one
            engine.enable_backward_allreduce = allreduce
        counter = StepCounter()
        for i, batch in enumerate(batches):
            with counter if i else contextlib.nullcontext():
                stats = train_step(engine, [batch], seed=0, non_finite=non_finite, compute_accuracy=True)
            assert stats.sums[1] == stats.sums[3] > 0 and stats.non_finite == 0 and stats.tokens == 60
        assert dict(counter.syncs) == KNOWN_SYNCS[precision, stage], (precision, stage, counter.syncs)
        weights.append([p.detach().float().clone() for p in model.parameters()])
        assert not any(torch.equal(a, b) for a, b in zip(initial, weights[-1])), "a parameter did not train"
    moved = max((a - b).abs().max().item() for a, b in zip(weights[0], weights[-1]))
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[-1])), (precision, moved)

# in a world of one, ZeRO-2 takes DeepSpeed's all-reduce path (`reduce_scatter` off: an identity there), copies each
# slice's first bf16 gradient into its fp32 partition (not zero-filled: here filled with NaN, as reused memory may be)
# and adds the next in one pass, takes its norms in fp32 and its global norm in fewer ops (fastmae/zero_patches.py):
# with a clip that binds, flat parameters or not, one micro-batch a step or two, the weights and the norms DeepSpeed's
# own code gives (its reduce-scatter path, partition, add and global norm), bit for bit, with fewer passes over
# model-sized tensors, no casts and no zero fill
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
import fastmae.zero_patches
from fastmae.masking import mask_batch
PATCHES = fastmae.zero_patches.PATCHES
fastmaes_norm, deepspeeds_norm = PATCHES[DeepSpeedZeroOptimizer, "scaled_global_norm"]


@contextlib.contextmanager
def deepspeeds_own(owner, own=True):
    # inside: `owner`'s methods that fastmae patches as DeepSpeed wrote them (own), else fastmae's
    for (patched, name), (fastmaes, deepspeeds) in PATCHES.items():
        if patched is owner:
            setattr(owner, name, deepspeeds if own else fastmaes)
    try:
        yield
    finally:
        for (patched, name), (fastmaes, _) in PATCHES.items():
            if patched is owner:
                setattr(owner, name, fastmaes)


def nan_filled_partition(self, group):  # what torch.empty may hand out: every slice of the partition NaN
    built = PATCHES[DeepSpeedZeroOptimizer, "_build_compact_grad_partition_buffer"][0](self, group)
    for offset, numel in getattr(built.flat_partition, "unwritten", {}).items():
        built.flat_partition.narrow(0, offset, numel).fill_(float("nan"))
    return built


@contextlib.contextmanager
def zero2_bf16_engine(ours, grad_accum=1, flat=True):
    with deepspeeds_own(DeepSpeedZeroOptimizer, own=not ours):
        if ours:
            DeepSpeedZeroOptimizer._build_compact_grad_partition_buffer = nan_filled_partition
        model, engine, non_finite = engine_of("bf16", None, {} if ours else {"zero_optimization": {"reduce_scatter":
                                                                                                    True}},
                                              zero_stage=2, clip=0.05, grad_accum=grad_accum, flat_parameters=flat)
        assert engine.optimizer.reduce_scatter is not ours
        yield model, engine, non_finite


for grad_accum, flat in ((1, True), (2, True), (2, False)):
    trained = []
    for ours in (True, False):
        with zero2_bf16_engine(ours, grad_accum, flat) as (model, engine, non_finite):
            sizes = [p.numel() for p in model.parameters()]
            counter = StepCounter(model_sized=(sum(sizes) // 2, sum(sizes)))  # the decay group's partition
            norms = []
            for i in range(3):
                with counter if i == 2 else contextlib.nullcontext():
                    train_step(engine, [batches[(i + j) % 3] for j in range(grad_accum)], seed=0,
                               non_finite=non_finite)
                norms.append(gradient_norm(engine))
            trained.append((master_weights(engine), counter.model_passes, torch.stack(norms)))
    (weights, passes, norms), (deepspeeds_weights, deepspeeds_passes, deepspeeds_norms) = trained
    assert all(torch.equal(weights[name], deepspeeds_weights[name]) for name in weights), (grad_accum, flat)
    assert torch.equal(norms, deepspeeds_norms) and norms.min() > 0.05, (norms, deepspeeds_norms)  # the clip binds
    assert "_to_copy" not in passes and "zeros" in deepspeeds_passes and "zeros" not in passes, (passes,
                                                                                                 deepspeeds_passes)
    # one micro-batch a step: the flat gradient copied into its partition, no zero fill or add of any kind; flat
    # gradients reduced where autograd left them, not first copied into DeepSpeed's bucket (engine.SKIPPED_BUCKET_SIZE):
    # two copies, into the fp32 partition and back into the bf16 weights, where DeepSpeed's path makes more
    assert grad_accum > 1 or not {"zero_", "add_"} & set(passes), passes
    assert not flat or passes["copy_"] == 2 < deepspeeds_passes["copy_"], (passes, deepspeeds_passes)

# a parameter that no gradient reached this step: its slice of the fp32 partition zero, as DeepSpeed's zero fill left
# it, before anything reads it (the step's first micro-batch's backward has one parameter's gradient only)
partitions = []
for ours in (True, False):
    with zero2_bf16_engine(ours, flat=False) as (model, engine, non_finite):
        first = next(model.parameters())
        engine.backward(first.float().square().sum())
        partitions.append(torch.cat([built.flat_partition for built in engine.optimizer.averaged_gradients.values()]))
assert torch.equal(partitions[0], partitions[1]) and 0 < partitions[1].count_nonzero() <= first.numel()

# bf16 ZeRO-1 (DeepSpeed's BF16_Optimizer) and ZeRO-3 step without their host reads (no sync in a steady step where
# DeepSpeed's have two and three), and ZeRO-1 adds each bf16 gradient into the fp32 one in one pass: with a clip that
# binds, the weights and norms of DeepSpeed's own steps, add and ZeRO-3 norm, bit for bit, with no cast pass at
# ZeRO-1; a NaN gradient makes the norm inf, which sets the skip flag on the device, and the weights stay where they
# were, as DeepSpeed's skip on the host leaves them
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from fastmae.zero_patches import Stage3Optimizer
for stage, owner in ((1, BF16_Optimizer), (3, Stage3Optimizer)):
    stepped = []
    for ours in (True, False):
        with deepspeeds_own(owner, own=not ours):
            model, engine, non_finite = engine_of("bf16", zero_stage=stage, clip=0.05)
            sizes = [p.numel() for p in model.parameters()]
            counter = StepCounter(model_sized=(sum(sizes) // 2, sum(sizes)))
            norms = []
            for i, batch in enumerate(batches):
                with counter if i == 2 else contextlib.nullcontext():
                    train_step(engine, [batch], seed=0, non_finite=non_finite)
                norms.append(float(gradient_norm(engine)))
            assert stage == 3 or ("_to_copy" in counter.model_passes) is not ours, counter.model_passes
            # and no zero fill of ZeRO-1's fp32 gradients, where DeepSpeed's step and zero_grad make one each
            assert stage == 3 or counter.model_passes["zero_"] == (0 if ours else 2), counter.model_passes
            # the third step (ZeRO-3's parameter trace settled by then): DeepSpeed's norm checks its only syncs (the
            # counter files a sync fastmae's code asks for under its own host reads)
            ours_syncs = [where for where in counter.host_reads if "zero_patches" in where]
            assert sum(counter.syncs.values()) == (0 if ours else {1: 2, 3: 3}[stage]) and not ours_syncs, (
                stage, ours, counter.syncs, ours_syncs)
            weights = master_weights(engine)
            engine.backward(engine(mask_batch(batches[0], config, 0, 3)).loss)
            gradients = (engine.optimizer.fp32_groups_gradient_flat_partition[0] if stage == 1
                         else engine.optimizer.averaged_gradients[0][0].view(-1))
            gradients[0] = float("nan")
            engine.step()
            after_nan = master_weights(engine)
            assert all(torch.equal(after_nan[name], weights[name]) for name in weights), (stage, ours)
            stepped.append((weights, norms, float(gradient_norm(engine)), float(non_finite)))
    (weights, norms, nan_norm, skipped), (deepspeeds_weights, deepspeeds_norms, deepspeeds_nan_norm, _) = stepped
    assert all(torch.equal(weights[name], deepspeeds_weights[name]) for name in weights), stage
    assert norms == deepspeeds_norms and min(norms) > 0.05, (stage, norms, deepspeeds_norms)  # the clip binds
    assert nan_norm == deepspeeds_nan_norm == float("inf") and skipped == 1.0, (stage, nan_norm, deepspeeds_nan_norm,
                                                                               skipped)

# bf16 ZeRO-1: a parameter that no gradient reached this step steps on a zero gradient, as DeepSpeed's zero fill
# left it, where its fp32 gradient still holds the last step's (no fill now: fastmae/zero_patches.py); the weights
# DeepSpeed's own code gives, bit for bit
stepped = []
for ours in (True, False):
    with deepspeeds_own(BF16_Optimizer, own=not ours):
        model, engine, non_finite = engine_of("bf16", zero_stage=1, flat_parameters=False)
        train_step(engine, [batches[0]], seed=0, non_finite=non_finite)
        first = next(model.parameters())
        engine.backward(first.float().square().sum())
        engine.step()
        stepped.append(master_weights(engine))
assert all(torch.equal(stepped[0][name], stepped[1][name]) for name in stepped[0])

# the global norm on one partition's gradients: DeepSpeed's value bit for bit in 7 device ops where DeepSpeed's takes
# 36; a NaN or an inf in a gradient makes both inf
with zero2_bf16_engine(True) as (model, engine, non_finite):  # the partitions filled, the step not taken
    engine.backward(engine(mask_batch(batches[0], config, 0, 0)).loss)
optimizer = engine.optimizer
gradient = next(iter(optimizer.averaged_gradients[0])).view(-1)
for bad in (None, float("nan"), float("inf")):
    if bad is not None:
        gradient[3] = bad
    counters = StepCounter(), StepCounter()
    with counters[0]:
        ours = fastmaes_norm(optimizer)
    with counters[1]:
        deepspeeds = deepspeeds_norm(optimizer)
    assert torch.equal(ours, deepspeeds) and (bad is None) == bool(ours.isfinite()), (bad, ours, deepspeeds)
    assert [sum(c.ops.values()) for c in counters] == [7, 36], (counters[0].ops, counters[1].ops)

# the fp32 masters start from the module's fp32 values, not its bf16 cast (issue 57): one step at lr 1e-12 leaves
# them where they started at every ZeRO stage (without the fix they moved by bf16 rounding, up to 2.4e-4 here)
for stage in (1, 2, 3):
    torch.manual_seed(0)
    model = MaskedLM(config)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    model, engine, non_finite = engine_of("bf16", model, zero_stage=stage, lr=1e-12)
    train_step(engine, [batches[0]], seed=0, non_finite=non_finite)
    masters = master_weights(engine)
    assert engine._copy_recovery_script is fastmae.engine.copy_recovery_scripts  # fastmae's write, not copyfile
    moved = max((masters[name] - initial[name]).abs().max().item() for name in initial)
    assert sorted(masters) == sorted(initial) and moved < 1e-9, (stage, moved)

# clipping is by the norm of every gradient in every ZeRO stage (DeepSpeed's ZeRO optimizers step the parameter
# groups one at a time): with a clip that binds, fp32 ZeRO-1, -2 (flat parameters) and -3 train what ZeRO-0 trains
trained = []
for stage in (0, 1, 2, 3):
    model, engine, non_finite = engine_of("fp32", zero_stage=stage, clip=0.05)
    for batch in batches:
        train_step(engine, [batch], seed=0, non_finite=non_finite)
    trained.append((master_weights(engine), gradient_norm(engine)))
reference, reference_norm = trained[0]
assert reference_norm > 0.5, reference_norm  # the clip binds
assert sorted(reference) == sorted(name for name, _ in MaskedLM(config).named_parameters())
for stage, (weights, norm) in enumerate(trained[1:], 1):
    assert abs(float(norm) / float(reference_norm) - 1) < 1e-5, (stage, float(norm), float(reference_norm))
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-4, atol=1e-6, msg=f"ZeRO-{stage} {name}")

# CUDA graphs' CPU twin (fastmae.graphs: static buffers, the replayed autograd path, gradients handed on in the
# recording's memory, which each backward writes again) trains what the eager model trains through DeepSpeed's bf16
# ZeRO-2 (which copies each gradient into its partition as it arrives) and ZeRO-1 (whose parameters keep theirs to
# the step: a copy is made before the next replay), two micro-batches per step, bit for bit; with the micro-batches
# padded to a fixed shape (fastmae/padding.py, as doc packing's are) the step counts the same tokens, FLOPs and
# predicted rows, and its losses (the second step's after an update) agree to bf16's rounding
from fastmae.graphs import StepGraphs
from fastmae.pipeline import masked_ahead
from fastmae.padding import ShapeLadder
trained = []
for stage, graphs, shapes in ((2, False, None), (2, True, None), (2, True, ShapeLadder(config, 64)), (1, False, None),
                              (1, True, None)):
    model, engine, non_finite = engine_of("bf16", zero_stage=stage, grad_accum=2)
    if graphs:
        recorded = StepGraphs(model, capture=False)
    masked = list(masked_ahead(iter(batches + [dataclasses.replace(batches[0], index=3)]), config, seed=0,
                               shapes=shapes))
    assert all((m.filler is not None) == (shapes is not None) for m in masked)
    stats = [train_step(engine, masked[i:i + 2], seed=0, non_finite=non_finite) for i in (0, 2)]
    trained.append(([s.sums[0] for s in stats], master_weights(engine), [(s.tokens, s.flops, float(s.sums[1]))
                                                                           for s in stats]))
    assert not graphs or (recorded.eager_batches, recorded.replayed_batches) == (1, 3)
for eager, replayed in ((0, 1), (3, 4)):
    assert trained[eager][0] == trained[replayed][0], [trained[eager][0], trained[replayed][0]]
    for name, tensor in trained[eager][1].items():
        assert torch.equal(trained[replayed][1][name], tensor), name
# (the weights themselves are compared at the model level, in fp32: tests/test_padding.py; here Adam would turn bf16
# rounding of gradient entries near zero into whole steps of either sign)
assert trained[2][2] == trained[0][2], (trained[2][2], trained[0][2])
torch.testing.assert_close(torch.stack(trained[2][0]), torch.stack(trained[0][0]), rtol=1e-2, atol=0)

# the throughput benchmark times exactly the trainer's step

calls = []
fastmae.step.train_step = lambda *args, **kwargs: calls.append(1) or train_step(*args, **kwargs)
step, _ = systems.fastmae_step(config, torch.randint(5, 50, (2, 32)), torch.device("cpu"), "fp32", None)
step()
step()
assert len(calls) == 2, calls
# its rows without a cuBLAS workspace: the trainer's setting (train.cublas_workspace=none), before the first GEMM
import os
os.environ.pop("CUBLASLT_WORKSPACE_SIZE", None)
step, _ = systems.fastmae_step(config, torch.randint(5, 50, (2, 32)), torch.device("cpu"), "fp32", systems.NO_WORKSPACE)
step()
assert len(calls) == 3 and os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0", calls
print("OK")
""" + SCRIPT_END


def test_world_of_one_skips_the_all_reduce_with_identical_updates():
    """build_engine turns DeepSpeed's gradient all-reduce off in a world of one (it only copies gradients there);
    the weights after three `train_step`s are bit-identical to a run with it on, in fp32 (ZeRO-0) and bf16 (ZeRO-1);
    bf16 ZeRO-2 there (DeepSpeed's all-reduce path, fastmae's fp32 partition without a zero fill, its first gradient
    copied in and the next added in one pass, and its global norm) trains DeepSpeed's own reduce-scatter path's
    weights with its norms bit for bit, flat parameters or not, one or two micro-batches a step, in fewer passes over
    model-sized tensors; a parameter without a gradient has a zero slice, as in DeepSpeed's; the global norm takes 7
    device ops where DeepSpeed's takes 36 (a NaN or inf gradient: inf in both).
    Steady-state steps ask for no host-device sync outside fastmae (benchmarks/host_overhead.StepCounter: host reads,
    tensors from host data, the accelerator's synchronize, which DeepSpeed's throughput timer calls), in fp32 ZeRO-0
    and bf16 ZeRO-1 and -2, clipping included (bf16 ZeRO-1's step trains DeepSpeed's own step's weights and norms
    bit for bit without its host read; a NaN gradient: the norm inf, the skip flag set, the weights unchanged).
    Clipping is by the global norm in every ZeRO stage: fp32 ZeRO-1/2/3 train what ZeRO-0 trains with a clip that
    binds, and the master weights come back under the module names from flat parameters. CUDA graphs' CPU twin trains
    the same weights as the eager model (bf16 ZeRO-2, two micro-batches per step). bf16's fp32 masters start from
    the module's fp32 values at ZeRO-1, -2 and -3 (what export and checkpoints gather).
    And benchmarks/throughput.py's step is `train_step`."""
    done = subprocess.run([*warm_python.COMMAND, "-c", WORLD_OF_ONE], cwd=ROOT, env=warm_python.environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout[-3000:] + done.stderr[-3000:]
