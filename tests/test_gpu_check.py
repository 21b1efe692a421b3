"""scripts/gpu_check.sh on a machine without a GPU: its dry run names every step, and each step's files and training
overrides are valid (so the first run on a GPU does not fail on a typo)."""

import shlex
import subprocess
from pathlib import Path

from fastmae.config import load_run_config
from fastmae.train import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_names_every_step_and_its_inputs_are_valid():
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    steps = {line.split("]", 1)[0][3:]: shlex.split(line.split("] ", 1)[1])
             for line in done.stdout.splitlines() if line.startswith("+ [")}
    assert list(steps) == ["device", "kernel_tests", "kernel_tests_large", "attention_tests", "relative_bias_tests",
                           "sync_tests", "graph_tests", "finetune_tests", "host_overhead_benchmark",
                           "host_overhead_graphs_benchmark", "kernel_benchmark", "attention_benchmark",
                           "throughput_benchmark", "throughput_recipe_benchmark", "micro_batch", "train_3ml_base"]
    # compiled kernels at realistic shapes too
    for name, marks in (("kernel_tests", "not large"), ("kernel_tests_large", "large"),
                        ("attention_tests", "large or not large")):
        assert steps[name][-3:-1] == ["-m", marks] and (ROOT / steps[name][-1]).exists()
    for name, selected in (("sync_tests", "steady_state"), ("relative_bias_tests", "relative_bias"),
                           ("finetune_tests", "bf16")):
        assert steps[name][-2:] == ["-k", selected] and (ROOT / steps[name][-3]).is_file()
    assert all((ROOT / steps[name][-1]).is_file() for name in ("kernel_benchmark", "attention_benchmark",
                                                              "host_overhead_benchmark", "graph_tests"))
    graphs = steps["host_overhead_graphs_benchmark"]
    assert "--cuda-graphs" in graphs and (ROOT / graphs[1]).is_file()
    throughput = steps["throughput_benchmark"]
    assert throughput[throughput.index("--size") + 1] == "base" and (ROOT / throughput[1]).is_file()
    command = steps["train_3ml_base"]
    assert command[:3] == ["deepspeed", "--num_gpus", "1"] and (ROOT / command[3]).is_file()
    args = build_parser().parse_args(command[4:])
    config = load_run_config(str(ROOT / args.config), args.overrides)
    model = config.model
    assert (model.objective, model.hidden_size, model.encoder_layers, model.max_seq_len) == ("3ml", 768, 12, 512)
    assert config.train.steps == 50 and config.data.path == "builtin" and args.resume == "none"
    assert config.for_world(1).train.grad_accum == 1  # one GPU, one micro-batch of the recipe's size per step
    recipe = steps["throughput_recipe_benchmark"]
    assert int(recipe[recipe.index("--sequences") + 1]) * 512 == load_run_config(
        str(ROOT / "configs/roberta-base.yaml"), ["model.vocab_size=32000"]).data.tokens_per_micro_batch
    assert (ROOT / steps["micro_batch"][1]).is_file()
    assert "benchmarks/results/gpu/DEVICE" in done.stdout
    assert not (ROOT / "benchmarks" / "results" / "gpu" / "DEVICE").exists()  # a dry run writes nothing


def test_unknown_argument_is_refused():
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--bogus"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr
