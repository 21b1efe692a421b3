"""The GPU check's phases (scripts/gpu_check.py runs them): each phase's steps, their commands, the files they keep
and what they need, in the order of what they decide; and the runs a lent machine's lease cannot hold. Standard
library only."""

from __future__ import annotations

import dataclasses

PY = "{python}"  # stands for the interpreter running gpu_check.py

# Modules a phase needs, with the distribution that provides each. Those in CARRIED install from .whl/ when missing;
# a missing one of the others is named and the phase stops.
CARRIED = {"setuptools": "setuptools", "wheel": "wheel", "deepspeed": "deepspeed", "hjson": "hjson",
           "pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
           "typing_inspection": "typing-inspection", "zstandard": "zstandard", "einops": "einops",
           "msgpack": "msgpack", "cpuinfo": "py-cpuinfo", "ninja": "ninja", "xdist": "pytest-xdist",
           "execnet": "execnet"}
IMAGE = {"torch": "torch", "triton": "triton", "numpy": "numpy", "tqdm": "tqdm", "yaml": "pyyaml",
         "sentencepiece": "sentencepiece", "safetensors": "safetensors", "psutil": "psutil",
         "matplotlib": "matplotlib", "pytest": "pytest", "transformers": "transformers", "packaging": "packaging"}

RUN_3ML_BASE = ["--config", "configs/3ml-base.yaml", "--resume", "none", "data.path=builtin",
                "data.builtin_vocab_size=8000", "train.warmup_steps=1", "checkpoint.keep=1"]


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    command: tuple[str, ...]
    keeps: tuple[str, ...] = ()  # files the command writes, copied into the phase's directory
    env: tuple[tuple[str, str], ...] = ()
    # files of another phase the command reads ({results} = benchmarks/results/gpu/DEVICE): on a fresh machine they
    # exist only where they were collected into the tree and travelled with it
    needs: tuple[str, ...] = ()
    # an earlier step of the phase whose seconds this one is expected to take again: it runs only when they are left
    fits_after: str = ""
    # seconds kept back for this step from the phase's budget: it runs however the steps before it ended (cut, failed)
    finally_s: int = 0


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    minutes: int  # on a fresh machine, set-up from .whl/ and Triton compiles included
    decides: str
    steps: tuple[Step, ...]
    # `minutes` as the phase ran on a lent machine, set-up included, rounded up (an H200, 2026-11-27, at f6d59b9:
    # smoke 300 s with the row-op tests, then headline 138 s in the same call, then modernbert 231 s in a second
    # call on the same warm machine (a fresh one adds its start and about 25 s of set-up), its local-attention step
    # timing every candidate tiling: 711 s held for the three; the study 425 s), else estimated
    timed: bool = False
    budget_s: int = 0  # the phase's limit, set-up included (0: PHASE_BUDGET_S)
    # what the command line must give the phase (`--corpus PATH`: {corpus} in its steps)
    arguments: tuple[str, ...] = ()
    # {name} in its steps: (name, value, the value under --quick, the same steps at the CPU's scale)
    values: tuple[tuple[str, str, str], ...] = ()


ROW_OP_TESTS = "(test_embed_rows or test_insert_rows or test_the_extra_rows_gradient_joins_the_tables)"


# pytest's workers on a lent machine's 16 cores: the fused kernels' tests are mostly Triton's compilations, one
# process's CPU work (207 s of 375 at 7dd4d54's smoke on one worker); each worker has a CUDA context of its own
WORKERS = ("-n", "8", "--dist", "loadgroup")


def _pytest(*args: str) -> tuple[str, ...]:
    return (PY, "-m", "pytest", "-q", *args)


PHASES = (
    Phase("smoke", 4, "torch's FlashAttention-2 kernels compute the windowed oracle; captured graphs compute what "
                      "eager computes; no host-device sync in a steady step", (
        # the torch_flash backend's CUDA kernels against the oracle (global, windows; lengths no block divides),
        # dropout redrawn from the rng state and in a recorded graph
        Step("flash_tests", _pytest("tests/test_flash.py", "tests/test_attention.py", "-k",
                                    "torch_flash or window or rng_state or recorded_graph or traces_whole")),
        # the layers' fused kernels (rotary of q and k; the projection's bias + dropout + residual add + LayerNorm;
        # GeGLU; bias + GELU; the QKV projection's gathering backward; the local-attention kernel on shortened and
        # full streams; every candidate tiling) and the row ops (the embedding gather, of the visible ids too, and
        # its <mask> row; the insertion: in bf16 only, their compilations' cost), the tables' gradients from them
        # (runs of ids across programs) and the cross-entropy's rows (bf16 only) compiled for this GPU, against
        # their references forward and backward
        Step("fused_kernel_tests", _pytest(*WORKERS, "-m", "not large", "-k",
                                           f"not ({ROW_OP_TESTS} or test_kernel_cross_entropy or "
                                           "test_kernel_table_grad) or bfloat16",
                                           "tests/kernels/test_kernel_rotary.py", "tests/kernels/test_kernel_norm.py",
                                           "tests/kernels/test_kernel_activation.py",
                                           "tests/kernels/test_kernel_projection.py",
                                           "tests/kernels/test_kernel_local_attention.py",
                                           "tests/kernels/test_kernel_rows.py",
                                           "tests/kernels/test_kernel_table_grad.py",
                                           "tests/kernels/test_kernel_cross_entropy.py")),
        Step("graph_tests", _pytest(*WORKERS, "tests/test_graphs.py", "-k", "captured")),
        Step("sync_tests", _pytest("tests/test_train.py", "-k", "steady_state")),
        # one 3ml base step replayed from its recording under set_sync_debug_mode("error"): step 3 of 4 (the second
        # sight records; the last step is logged), at the recipe's 65,536 tokens per micro-batch
        Step("sync_step_3ml_base", (PY, "-m", "fastmae.train", *RUN_3ML_BASE, "train.steps=4",
                                    "train.tokens_per_step=65536", "eval.every=0", "checkpoint.every=1000",
                                    "log.every=4",
                                    "log.dir=runs/gpu-check/sync-3ml-base"),
             keeps=("runs/gpu-check/sync-3ml-base/metrics.jsonl", "runs/gpu-check/sync-3ml-base/run_info.json"),
             env=(("FASTMAE_SYNC_DEBUG", "1"),)),
    )),
    Phase("headline", 4, "3ml and mlm against Hugging Face RoBERTa at base size: tokens/s, MFU, GPU busy", (
        # and one replayed 3ml step as a Chrome trace, host and GPU: where the GPU waits, between what (its GPU busy
        # was 0.93 at f6d59b9, mlm's 0.97); it comes back in place of the plot (the json holds the plot's figures),
        # so that smoke and headline still come back from one call
        Step("throughput_headline", (PY, "benchmarks/throughput.py", "--size", "base", "--sequences", "128",
                                     "--systems", "hf-roberta,mlm,3ml", "--eager", "--no-cublas-workspace",
                                     "--trace", "3ml", "--name", "throughput_headline"),
             keeps=(*(f"benchmarks/results/throughput_headline.{ext}" for ext in ("json", "md")),
                    "benchmarks/results/throughput_headline_3ml_trace.json.gz")),
        # each fused layer kernel against the stock torch ops it replaces, at the headline's 65,536 rows
        Step("layer_kernels", (PY, "benchmarks/kernels.py", "--ops", "layers", "--tokens", "65536", "--name",
                               "kernels_layers"),
             keeps=("benchmarks/results/kernels_layers.json", "benchmarks/results/kernels_layers.md")),
        # cuDNN's and FlashAttention-2's attention, forward and backward, at 3ml's encoder stream (128 x 257 rows: one
        # past a multiple of their tiles), at 128 x 256 and 128 x 320: what the 257th row costs (a table in the log)
        Step("attention_lengths", (PY, "scripts/flash_probe.py", "--lengths", "257,256,320")),
    )),
    Phase("modernbert", 4, "fastmae on ModernBERT's layers against transformers' ModernBertForMaskedLM at base size", (
        Step("throughput_modernbert", (PY, "benchmarks/throughput.py", "--size", "base", "--sequences", "128",
                                       "--systems", "hf-modernbert,modern-mlm,modern-3ml,modern-mae-lm",
                                       "--name", "throughput_modernbert_gpu"),
             keeps=tuple(f"benchmarks/results/throughput_modernbert_gpu.{ext}" for ext in ("json", "md", "png"))),
        Step("local_attention", (PY, "benchmarks/local_attention.py"),
             keeps=("benchmarks/results/local_attention_flex.json", "benchmarks/results/local_attention_flex.md")),
    ), timed=True),
    # after a change to the kernels, with the minutes a lease has left after the phases above (each lease so far
    # ended with about 5 of its 15 left, too few for another phase; at 1a99eec a hand-made probe of these steps, each
    # under its own timeout, lost its throughput table to a timeout that cut the step's last system)
    Phase("retime", 4, "what a kernel change did: the local-attention kernels against their reference on CUDA (bf16), "
          "mlm's and 3ml's tokens/s and MFU against Hugging Face RoBERTa's, the local-attention table", (
        Step("local_attention_tests", _pytest("tests/kernels/test_kernel_local_attention.py", "-k",
                                              "(matches_the_reference and bfloat16) or sums_dq")),
        Step("throughput_retime", (PY, "benchmarks/throughput.py", "--size", "base", "--sequences", "128",
                                   "--systems", "hf-roberta,mlm,3ml", "--name", "throughput_retime"),
             keeps=tuple(f"benchmarks/results/throughput_retime.{ext}" for ext in ("json", "md"))),
        Step("local_attention", (PY, "benchmarks/local_attention.py"),
             keeps=("benchmarks/results/local_attention_flex.json", "benchmarks/results/local_attention_flex.md")),
    ), budget_s=4 * 60),
    Phase("kernels", 6, "every Triton kernel compiled for this GPU against its torch reference; their speed", (
        Step("kernel_tests", _pytest("-n", "8", "-m", "not large", "tests/kernels")),
        Step("kernel_benchmark", (PY, "benchmarks/kernels.py"),
             keeps=("benchmarks/results/kernels.json", "benchmarks/results/kernels.md")),
    )),
    Phase("attention", 6, "every attention backend against the naive reference; their speed", (
        Step("attention_tests", _pytest("-m", "large or not large", "tests/test_attention.py")),
        Step("relative_bias_tests", _pytest("tests/test_model.py", "-k", "relative_bias")),
        Step("attention_benchmark", (PY, "benchmarks/attention.py"),
             keeps=("benchmarks/results/attention.json", "benchmarks/results/attention.md")),
    )),
    Phase("overhead", 6, "device ops, launches and syncs per step, eager and replayed; bf16 fine-tuning", (
        Step("host_overhead_benchmark", (PY, "benchmarks/host_overhead.py"),
             keeps=("benchmarks/results/host_overhead.json", "benchmarks/results/host_overhead.md")),
        Step("host_overhead_graphs_benchmark", (PY, "benchmarks/host_overhead.py", "--zero-stage", "2",
                                                "--cuda-graphs", "--name", "host_overhead_zero2_graphs"),
             keeps=("benchmarks/results/host_overhead_zero2_graphs.json",
                    "benchmarks/results/host_overhead_zero2_graphs.md")),
        Step("finetune_tests", _pytest("tests/test_finetune.py", "-k", "bf16")),
        # what cuBLAS launches for each GEMM of a base layer (the memsets and split-K reductions of a step), with
        # torch's default BLAS, with cuBLASLt and with no workspace: a table in its log, no file of its own (in
        # headline up to 7dd4d54, whose throughput rows now time the step without a workspace)
        Step("gemm_probe", (PY, "scripts/gemm_probe.py")),
    )),
    Phase("large_kernels", 7, "the kernels at realistic shapes (up to 14 GB each)", (
        Step("kernel_tests_large", _pytest("-m", "large", "tests/kernels")),
    )),
    Phase("recipe", 7, "the recipes' micro-batch from measured memory; 50 steps of 3ml-base", (
        Step("micro_batch", (PY, "benchmarks/micro_batch.py", "--device-dir", "{results}/headline"),
             keeps=("benchmarks/results/micro_batch.json", "benchmarks/results/micro_batch.md"),
             needs=("{results}/headline/throughput_headline.json",)),
        Step("train_3ml_base", (PY, "-m", "fastmae.train", *RUN_3ML_BASE, "train.steps=50",
                                "train.tokens_per_step=131072", "eval.every=50", "eval.sequences=256",
                                "checkpoint.every=50", "log.every=5", "log.dir=runs/gpu-check/3ml-base"),
             keeps=tuple(f"runs/gpu-check/3ml-base/{name}" for name in
                         ("metrics.jsonl", "curves.png", "config.yaml", "run_info.json"))),
    )),
)


STUDY_OUT = "runs/gpu-study"
STUDY_KEEPS = tuple(f"{STUDY_OUT}/study/{name}" for name in ("study.json", "report.md", "loss_vs_flops.png",
                                                              "ranks.png"))


def _study(seeds: str) -> tuple[str, ...]:
    """The masking study at the preset's scale (issue 56): mlm at 15% and 30% and 3ml at 50%, each run under one
    FLOP budget, 3 trained at once on the one GPU, fine-tuned on word order and on the real task given."""
    return (PY, "-m", "fastmae.study", "--data", f"{STUDY_OUT}/data", "--budget", "{budget}", "--objectives",
            "{objectives}", "--seeds", seeds, "--parallel", "3", "--task", "generated",
            "--task", "{task}", "--out", f"{STUDY_OUT}/study")


# the study's per-run records as one archive, of whatever it wrote before it ended or was cut: the training logs and
# configs, each run's metrics, facts and seconds, its GLUE cells' summaries, analyze's records
PACK_RUNS = ("sh", "-c", f"cd {STUDY_OUT}/study && find . -name '*.log' -o -name '*.yaml' -o -name metrics.jsonl -o "
             "-name run_info.json -o -name study_run.json -o -name glue.json -o -name analysis.json | "
             "tar czf ../study_runs.tar.gz -T -")

PHASES += (
    Phase("study", 8, "does 3ml pay at 8e15 FLOPs a run? mlm 15% / 30% and 3ml 50% on real English text, "
                      "pretrained, evaluated, probed and fine-tuned in one command", (
        # the corpus's 32K-piece tokenizer on the machine's cores (lines sampled: sentencepiece's time grows with
        # them; 150,000 took 52 s of an H100 machine's 16 cores, 2026-11-27), held-out documents split off by document
        Step("prepare", (PY, "-m", "fastmae.prepare", "--input", "{corpus}", "--format", "jsonl", "--output",
                         f"{STUDY_OUT}/data", "--vocab-size", "{vocab}", "--valid-fraction", "0.02",
                         "--docs-per-shard", "500", "--input-sentence-size", "80000")),
        # one seed of each arm first: a result whatever the second costs
        Step("study_one_seed", _study("1"), keeps=STUDY_KEEPS),
        Step("study_two_seeds", _study("{seeds}"), keeps=STUDY_KEEPS, fits_after="study_one_seed"),
        # a cut study's runs come home too (the first lease's was cut in its analysis, 2026-11-27)
        Step("pack", PACK_RUNS, keeps=(f"{STUDY_OUT}/study_runs.tar.gz",), finally_s=20),
    ), timed=True, budget_s=9 * 60, arguments=("corpus", "task"),
        # --quick: the CPU's scale, two arms, its second step the first again (every run and cell reused: the suite's
        # budget; each arm's config at the GPU's scale is checked by the suite without running it)
        values=(("budget", "gpu-10min", "quick"), ("objectives", "mlm,mlm:mask_rate=0.3,3ml", "mlm,3ml"),
                ("vocab", "32000", "1000"), ("seeds", "2", "1"))),
)


# What a lent GPU should run for an issue but no lease holds: named by --plan, run on a machine held for hours.
MASK_MORE_OR_LATER = ("mlm,mlm:mask_rate=0.3,mlm:mask_rate=0.5,mlm:mask_rate=0.3:mask_rate_end=0.15,3ml,"
                      "3ml:mask_rate_end=0.3")
BEYOND_A_LEASE = (
    ("mask-more-or-later", "12 runs of about an hour each on one H100 (issue 49: cpu-1h's study at RoBERTa-base size, "
     "on a corpus of the user's prepared with `fastmae prepare`: the embedded one is far too small for it)",
     ("fastmae", "study", "--data", "DATASET_DIR", "--budget", "gpu-1h", "--task", "generated", "--out",
      "runs/study-mask-more-or-later-gpu", "--objectives", MASK_MORE_OR_LATER, "train.schedule=wsd",
      "train.decay_fraction=0.2", "train.decay_shape=1-sqrt")),
)
