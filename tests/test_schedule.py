"""Learning-rate schedules (fastmae/schedule.py): warmup-stable-decay's shapes and ends; a wsd run extended while
stable, and a decay branched from a stable checkpoint into its own run, end bit-identical to the run planned that
long; what cannot continue exactly is refused naming both values."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import warm_python
from synthetic import prepare_word_dataset
from test_train import SCRIPT_END, WORDS, overrides

from fastmae.config import TrainConfig, load_run_config
from fastmae.data import PackedLoader
from fastmae.errors import FastmaeError
from fastmae.flops import plan_budget
from fastmae.schedule import Schedule, check_continuation, lr_multiplier

ROOT = Path(__file__).resolve().parent.parent


def wsd(steps=100, warmup=10, **fields) -> Schedule:
    return Schedule.of(TrainConfig(schedule="wsd", steps=steps, warmup_steps=warmup, lr=1e-3, **fields))


@pytest.mark.parametrize("shape, at_quarter", [("linear", 0.75), ("1-sqrt", 0.5), ("cosine", (1 + 2 ** -0.5) / 2)])
def test_wsd_warms_up_holds_then_decays_in_its_shape_to_its_end(shape, at_quarter):
    schedule = wsd(decay_steps=20, decay_shape=shape, min_lr_ratio=0.1)
    assert [schedule.multiplier(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # linear warm-up over 10 steps
    assert all(schedule.multiplier(s) == 1.0 for s in range(9, 81))  # stable through the decay's first step
    assert schedule.decay_start == 80
    assert math.isclose(schedule.multiplier(85), 0.1 + 0.9 * at_quarter)
    assert schedule.multiplier(100) == schedule.multiplier(150) == pytest.approx(0.1)
    decay = [schedule.multiplier(s) for s in range(80, 101)]
    assert decay == sorted(decay, reverse=True)
    fraction = wsd(decay_fraction=0.25)  # without decay_steps: a share of the (planned) steps
    assert (fraction.decay_steps, fraction.decay_start) == (25, 75)
    held = wsd(decay_fraction=0.0)  # no decay: the peak to the last step (ModernBERT's phase 1)
    assert held.multiplier(99) == 1.0 and "then stable to step 100 (wsd, no decay)" in held.describe()
    polynomial = Schedule.of(TrainConfig(steps=100, warmup_steps=10, schedule="polynomial", power=2.0))
    assert polynomial.describe() == "lr 0.0002: 10 warm-up steps, then polynomial (power 2) decay to 0 at step 100"
    cut = Schedule.of(TrainConfig(steps=40, warmup_steps=100, lr=3e-3))  # a run shorter than its warm-up
    assert cut.multiplier(39) == 0.4 and cut.describe() == ("lr 0.003: 100 warm-up steps, cut by the run's end at "
                                                            "step 40: the last step at 0.4 x lr, no decay")
    assert [polynomial.multiplier(s) for s in range(0, 120, 7)] == [lr_multiplier(s, 10, 100, 2.0)
                                                                    for s in range(0, 120, 7)]
    with pytest.raises(FastmaeError, match=r"train.decay_steps=95 and train.warmup_steps=10 exceed train.steps=100"):
        wsd(decay_steps=95)


def test_a_continuation_is_refused_where_a_step_taken_would_change_its_rate_or_batch(tmp_path):
    """The rule: every step up to the checkpoint's, and the next (which the restored optimizer takes at its saved
    rate), keeps its learning rate; and the global batch stays (seen failing: the check run through step - 1)."""
    batch = {"micro_batches_per_step": 2, "tokens_per_micro_batch": 256}
    planned = wsd(steps=100, decay_steps=20)  # stable through step 80
    state = {"step": 80, "schedule": planned.record(), "batch": batch}
    check_continuation(tmp_path, state, wsd(steps=1000, decay_steps=20), batch)  # extended while stable
    check_continuation(tmp_path, state, wsd(steps=90, decay_steps=10), batch)  # a branch decaying from step 80
    with pytest.raises(FastmaeError, match=r"gives step 80 a learning rate of 0.000909091 where it was 0.001"):
        check_continuation(tmp_path, state, wsd(steps=90, decay_steps=11), batch)
    decaying = {**state, "step": 90}
    with pytest.raises(FastmaeError, match=r"step 90 was reached under lr 0.001: 10 warm-up steps, stable to step 80"
                                           r".* gives step 81 a learning rate of 0.001 where it was 0.00095"):
        check_continuation(tmp_path, decaying, wsd(steps=1000, decay_steps=20), batch)
    with pytest.raises(FastmaeError, match=r"gives step 0 a learning rate of 0.0002 where it was 0.0001"):
        check_continuation(tmp_path, state, Schedule.of(TrainConfig(schedule="wsd", steps=1000, warmup_steps=10,
                                                                    lr=2e-3, decay_steps=20)), batch)
    with pytest.raises(FastmaeError, match=r"trained with global batches of 2 micro-batches of 256 tokens, this "
                                           r"run's are 4 micro-batches of 256 tokens: .*\(data.tokens_per_micro_batch="
                                           r"256 and train.tokens_per_step=512, or train.tokens_per_step and "
                                           r"train.grad_accum left unset: a resume keeps its batch\)"):
        check_continuation(tmp_path, state, planned, {**batch, "micro_batches_per_step": 4})
    warmed = {**batch, "warmup": {"tokens": 3000, "from": 256}}  # a batch warm-up's settings, changed or dropped
    with pytest.raises(FastmaeError, match=r"2 micro-batches of 256 tokens, growing from 256 tokens over the first "
                                           r"3000, this run's are 2 micro-batches of 256 tokens: .*a resume keeps its "
                                           r"batch; and its train.batch_warmup_tokens and train.batch_warmup_from\)"):
        check_continuation(tmp_path, {**state, "batch": warmed}, planned, batch)
    check_continuation(tmp_path, {"step": 80}, wsd(steps=20), batch)  # a checkpoint from before these were kept



def test_a_masking_rate_schedule_moves_in_whole_percents_or_one_step():
    """MaskRates: linear in whole percents from mask_rate at step 0 to mask_rate_end at the last (a few rates, each
    a fixed set of counts), or one switch; a constant rate without mask_rate_end; bad values named."""
    from fastmae.config import ModelConfig
    from fastmae.errors import ConfigError
    from fastmae.schedule import MaskRates

    linear = MaskRates.of(ModelConfig.preset("mlm", mask_rate=0.3, mask_rate_end=0.15), steps=1001)
    rates = [linear.rate(s) for s in range(1001)]
    assert rates[0] == 0.3 and rates[500] == 0.22 and rates[-1] == 0.15 and rates == sorted(rates, reverse=True)
    assert len(set(rates)) == 16 and all(round(100 * r) / 100 == r for r in rates)
    step = MaskRates.of(ModelConfig.preset("3ml", mask_rate_end=0.3, mask_rate_shape="step", mask_rate_switch=0.75),
                        steps=100)
    assert [step.rate(s) for s in (0, 73, 74, 75, 99)] == [0.5, 0.5, 0.5, 0.3, 0.3]
    constant = MaskRates.of(ModelConfig.preset("mlm"), steps=100)
    assert constant.constant and constant.by_index(4) is None and constant.describe() == "masking rate 0.15"
    assert linear.by_index(2)(2 * 500 + 1) == 0.22  # micro-batch 1001 of 2 a step: step 500
    from fastmae.study.objectives import parse_objectives  # the study's grammar takes a schedule as two fields

    assert parse_objectives("mlm,mlm:mask_rate=0.3:mask_rate_end=0.15")[1].overrides == {"mask_rate": 0.3,
                                                                                         "mask_rate_end": 0.15}
    for field, value, message in (("mask_rate_end", 1.0, "must be in \\[0, 1\\), or -1"),
                                  ("mask_rate_shape", "cosine", "must be 'linear' or 'step'"),
                                  ("mask_rate_switch", 1.0, "must be in \\(0, 1\\)"),
                                  ("mask_rate_end", 0.155, "a linear masking-rate schedule runs between whole "
                                                           "percents")):
        with pytest.raises(ConfigError, match=f"model.{field}={value!r}: {message}"):
            ModelConfig.preset("mlm", **{field: value})


EXTEND_AND_BRANCH = """
import sys
from pathlib import Path
from safetensors.torch import load_file
from fastmae.distributed import init_distributed, set_world_of_one_env
set_world_of_one_env()
init_distributed()
from fastmae.config import load_run_config
from fastmae.errors import FastmaeError
from fastmae.flops import plan_budget
from fastmae.trainer import Trainer
sys.path.insert(0, "tests")
from test_train import as_if_killed_after

root = Path(sys.argv[1])
args = {name: value.split(" ") for name, value in (line.split("=", 1) for line in sys.argv[2:])}

def train(name):
    try:
        Trainer(load_run_config(None, args[name]), "auto").run()
    except FastmaeError as err:
        return f"REFUSED {err}"
    return load_file(root / name / "model.safetensors")

long, _, _ = train("long"), train("short"), train("stable")
as_if_killed_after(root / "short", 3, root / "extended")
(root / "short" / "model.safetensors").unlink()  # resumable again: its step-6 checkpoint is its newest
masked = train("masked")
as_if_killed_after(root / "masked", 3, root / "masked_resumed")
masked_resumed = train("masked_resumed")
print("MASKED_RESUMED", all((masked[k] == masked_resumed[k]).all() for k in masked))
as_if_killed_after(root / "masked", 3, root / "masked_longer")
print(train("masked_longer"))
train("budgeted")
extended, branched = train("extended"), train("branched")
print("EXTENDED", all((long[k] == extended[k]).all() for k in long))
print("BRANCHED", all((long[k] == branched[k]).all() for k in long))
print(train("late_branch"))
print(train("decaying"))
""" + SCRIPT_END


def test_an_extended_run_and_a_branched_decay_end_as_the_run_planned_that_long(tmp_path):
    """`long`: 10 steps, wsd with a 3-step decay (stable to step 7). `short` planned 6 (stable to 3): its checkpoint
    of step 3, resumed with train.steps=10, ends bit-identical to `long` (weights; dropout on, so the RNG carries over).
    A branch of the step-7 checkpoint of `stable` (12 steps, no decay), given its config and train.decay_steps=3 but not
    its length, in a directory of its own, ends bit-identical to `long` too. Branching from step 8 (decaying) and
    resuming `short`'s step-6 checkpoint with another length are refused naming both rates. A run whose masking rate
    falls 40% -> 15% (mae-lm: its encoder stream grows) masks each step at its rate, resumes mid-schedule bit-identical,
    and refuses another length, which would have masked its past steps otherwise. One process, a world of one, the real
    DeepSpeed engine."""
    (tmp_path / "data").mkdir()
    data = prepare_word_dataset(tmp_path / "data", WORDS, 200, 40, vocab_size=40, valid_fraction=0.1)
    wsd_args = {"train.schedule": "wsd", "train.decay_steps": 3, "train.warmup_steps": 2, "eval.every": 0,
                "checkpoint.every": 1, "checkpoint.keep": 20, "log.every": 1}

    def run_args(name, steps, **extra):
        return f"{name}=" + " ".join(overrides(data, tmp_path / name, steps=steps, **{**wsd_args, **extra}))

    checkpoints = tmp_path / "long" / "checkpoints"
    schedule = {"model.mask_rate": 0.4, "model.mask_rate_end": 0.15, "eval.every": 3}
    model = load_run_config(None, overrides(data, tmp_path / "x", **schedule)).model
    constant = plan_budget(PackedLoader(data, max_seq_len=64, tokens_per_batch=256).every_rank(),
                           model.replace(mask_rate_end=-1.0), 1, 1e30, exact_micro_batches=4).flops_per_step
    budget = 7.5 * constant  # at 40% throughout: 7 steps; falling to 15% (mae-lm: dearer steps), fewer
    plan = plan_budget(PackedLoader(data, max_seq_len=64, tokens_per_batch=256).every_rank(), model, 1, budget)
    done = subprocess.run([*warm_python.COMMAND, "-c", EXTEND_AND_BRANCH, str(tmp_path), run_args("long", 10),
                           run_args("short", 6), run_args("masked", 6, **schedule),
                           run_args("masked_resumed", 6, **schedule), run_args("masked_longer", 10, **schedule),
                           run_args("budgeted", 1000, **schedule, **{"train.flops_budget": budget}),
                           run_args("extended", 10),
                           run_args("stable", 12, **{"train.decay_steps": 0, "train.decay_fraction": 0.0}),
                           # the stable run's own config (12 steps, no decay), its length not restated: the branch
                           # plans 7 + 3 steps itself
                           run_args("branched", 12, **{"train.decay_steps": 3, "train.decay_fraction": 0.0,
                                                       "train.branch_from": tmp_path / "stable" / "checkpoints"
                                                       / "step00000007"}),
                           run_args("late_branch", 10, **{"train.branch_from": checkpoints / "step00000008"}),
                           run_args("decaying", 10, **{"log.dir": tmp_path / "short"})],
                          cwd=ROOT, env=warm_python.environment(), capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert "EXTENDED True" in lines and "BRANCHED True" in lines, done.stdout + done.stderr[-3000:]
    assert "MASKED_RESUMED True" in lines
    longer, late, decaying = [line for line in lines if line.startswith("REFUSED")]
    assert "masking rate 0.4 -> 0.15 linearly in steps of 1% (26 rates) over 6 steps" in longer
    assert "masks step 1 at 0.37 where it was masked at 0.35" in longer
    records = [json.loads(line) for line in (tmp_path / "masked" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["mask_rate"] for r in train_records] == [0.4, 0.35, 0.3, 0.25, 0.2, 0.15]
    per_token = [(b["flops"] - a["flops"]) / (b["tokens_seen"] - a["tokens_seen"])
                 for a, b in zip([{"flops": 0, "tokens_seen": 0}, *train_records], train_records)]
    assert per_token[-1] > 1.05 * per_token[0]  # mae-lm: fewer removed at 15%, a longer encoder stream
    budgeted = [json.loads(line) for line in (tmp_path / "budgeted" / "metrics.jsonl").read_text().splitlines()]
    budgeted = [r for r in budgeted if r["kind"] == "train"]
    assert 2 <= plan.steps < 7 and [r["step"] for r in budgeted] == list(range(1, plan.steps + 1))
    assert budgeted[-1]["flops"] == plan.planned_flops <= budget  # the plan integrated the schedule it trains with
    assert budgeted[0]["mask_rate"] == 0.4 and budgeted[-1]["mask_rate"] == 0.15
    evals = [r["mask_rate"] for r in records if r["kind"] == "eval"]
    assert evals == [0.15, 0.15]  # evaluation keeps its own rate (eval.mask_rate)
    assert "step 8 was reached under lr 0.001: 2 warm-up steps, stable to step 7" in late
    assert "gives step 8 a learning rate of 0.001 where it was 0.000666667" in late
    assert "step 6 was reached under" in decaying and "stable to step 3" in decaying
    assert "gives step 4 a learning rate of 0.001 where it was 0.000666667" in decaying
    assert f"branched from {tmp_path / 'stable' / 'checkpoints' / 'step00000007'} at step 7" in done.stderr
    assert f"resumed from {tmp_path / 'extended' / 'checkpoints' / 'step00000003'} at step 3" in done.stderr
