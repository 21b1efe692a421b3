"""Training throughput and MFU of fastmae's objectives against Hugging Face RobertaForMaskedLM and
ModernBertForMaskedLM, in one run.

    python benchmarks/throughput.py [--size small|base|small,base] [--quick] [--dtype auto|fp32|bf16]

Every system trains on the same random tokens (sequences of 512 with <s> ... </s>, vocabulary 32,000) for full
steps through the engine fastmae trains with (fastmae.engine.build_engine: DeepSpeed ZeRO-2 in bf16, the recipes'
stage, or --zero-stage; ZeRO-0 in fp32; fp32 master weights and gradient accumulation, fused AdamW, clipping at
2.0). fastmae's systems run the trainer's own step (fastmae.step.train_step: masking, forward, the per-token
weighted backward, the optimizer step);
Hugging Face's runs forward, backward and the optimizer step.
Each system runs in a fresh process (its peak memory is its own); the GEMM peak that MFU divides by is measured
in the same run, in the training dtype, and again when a system beats it (fastmae.hardware.PeakFlops; ARCHITECTURE.md
sections 5 and 8). Model FLOPs are fastmae/flops.py's
count of what each system computes: Hugging Face runs its LM head on every row, fastmae on the predicted rows only. With
--backends (CUDA), `mlm` also runs with each attention backend present; with --compile every fastmae system also runs
with its layers compiled (train.compile). On CUDA fastmae's steps replay CUDA graphs of the forward and backward
(train.cuda_graphs=auto, fastmae/graphs.py; the `cuda_graphs` column counts the replayed micro-batches); --eager adds
each fastmae system without them, --no-cublas-workspace each with no cuBLAS workspace (train.cublas_workspace=none).
--real-data adds 3ml on the embedded corpus, packed `full` and packed `doc` (its
micro-batches padded to fixed shapes where graphs replay; tokens and FLOPs count its own sequences).
The `modern-*` systems are fastmae's objectives on ModernBERT's layers (GeGLU of 1.5 x the width, no biases, pre-LN,
a global layer every 3rd, the others over windows of 128 positions; mlm at ModernBERT's 30% masking) and
`hf-modernbert` is transformers' ModernBertForMaskedLM of the same shape at its best CPU/GPU settings (sdpa,
`sparse_prediction`: its head on the masked rows only), so both count the same model FLOPs.

A step's time is its steady-state time: steps issued back to back, the device drained once per run of
STEPS_PER_WINDOW (common.steady_time), as the trainer issues them. On CUDA every system's step is also profiled (3
steps after the timed ones): `gpu_busy` is the share of the step's wall time that the GPU spends in kernels (well
below 1: the host cannot keep up, or waits), and the busiest kernels are printed.

Writes benchmarks/results/throughput.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
from pathlib import Path

import torch
from common import RESULTS_DIR, gpu_kernel_profile, steady_time, write_results
from systems import (
    DOC_DATA,
    EAGER,
    HF_SYSTEMS,
    MODERN_SYSTEMS,
    NO_WORKSPACE,
    REAL_DATA,
    SEQ_LEN,
    SIZES,
    SYSTEMS,
    VOCAB_SIZE,
    ZERO_STAGE,
    attention_backend,
    default_run,
    doc_micro_batches,
    fastmae_step,
    hf_modernbert_step,
    hf_step,
    init_world_of_one,
    make_tokens,
    model_config,
    real_tokens,
)

from fastmae.hardware import DTYPES, PeakFlops, choose_precision, matmul_flops

# A step's time is taken over runs of this many steps issued back to back (common.steady_time): the host issues the
# next step while the device still runs the one before, as the trainer does. Timed one at a time (up to f6d59b9's
# runs), each step also paid for the host's work up to its first kernel, the device idle meanwhile.
STEPS_PER_WINDOW = 3


def _resident_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure_system(system: str, size: str, sequences: int, precision: str, warmup: int, repeats: int,
                   variant: str | None, zero_stage: int = ZERO_STAGE, trace: Path | None = None) -> dict:
    """Median step time, tokens/s, model FLOPs per step and peak memory of one system (run in its own process).
    variant: None, an attention backend, or "compiled". trace: where to write one more step's profile, host ops and
    GPU kernels on one timeline (a Chrome trace, gzipped: where the GPU waits and on what)."""
    init_world_of_one()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as the trainer does
    baseline_mib, _ = _resident_mib()
    torch.manual_seed(0)
    config = model_config(system, size)
    if variant == "torch_varlen":  # varlen_attn takes no attention dropout: this row measures the kernel without it
        config = dataclasses.replace(config, attention_dropout=0.0)
    tokens = real_tokens(sequences) if variant == REAL_DATA else make_tokens(sequences)
    run = default_run(zero_stage)
    if system in HF_SYSTEMS:
        make_step = hf_step if system == "hf-roberta" else hf_modernbert_step
        step, flops = make_step(config, tokens, device, precision, run)
        step.tokens = tokens.numel()
    else:
        step, flops = fastmae_step(config, doc_micro_batches(sequences) if variant == DOC_DATA else tokens, device,
                                    precision, variant, run)
    seconds = steady_time(step, warmup=warmup, windows=repeats, calls=STEPS_PER_WINDOW)
    result = {"step_s": seconds, "tokens_per_step": step.tokens, "tokens_per_s": step.tokens / seconds,
              "flops_per_step": flops,
              "attention": attention_backend(system, config, device, precision, variant)}
    graphs = getattr(step, "graphs", None)
    result["cuda_graphs"] = f"{graphs.replayed_batches} replayed" if graphs is not None else "no"
    if device.type == "cuda":
        result["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
        profile = gpu_kernel_profile(step, system if variant is None else f"{system} [{variant}]", top=25)
        result.update(gpu_kernels_per_step=profile["kernels"], gpu_kernel_kinds=profile["kinds"],
                      gpu_kernel_launchers=profile["launchers"], gpu_idle_ms=profile["idle"],
                      host_op_ms=profile["host"],
                      gpu_kernel_table=profile["table"],
                      gpu_busy=profile["busy_s"] / seconds)
    else:
        result["peak_memory_mib"] = _resident_mib()[1] - baseline_mib
    if trace is not None:
        write_trace(step, trace)
    return result


def write_trace(step, path: Path) -> None:
    """One call of step under torch's profiler, host and (on CUDA) device, written to `path` (.json.gz: a Chrome trace,
    for chrome://tracing or Perfetto)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    with profile(activities=activities) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def _run_isolated(*args) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure_system, args)


# --------------------------------------------------------------------------------------------------------- report
def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{row['size']} {row['system']}" for row in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.barh(names, [row["tokens_per_s"] for row in rows], color="tab:blue")
    ax1.set_xlabel("training tokens / s")
    ax2.barh(names, [row["mfu"] or 0.0 for row in rows], color="tab:orange")  # none: no measured peak
    ax2.set_xlabel("MFU (model FLOPs / measured GEMM peak)")
    ax2.set_xlim(0, 1)
    for ax in (ax1, ax2):
        ax.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small", help=f"one of {sorted(SIZES)}, or several, comma-separated")
    parser.add_argument("--quick", action="store_true",
                        help="4 sequences, 1 warm-up + 3 timed steps a system (each in a fresh process; every "
                             "system at small size: about 6 minutes on 2 CPU cores)")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                        help="training dtype; auto: bf16 where the device multiplies it natively "
                             "(ARCHITECTURE.md section 5)")
    parser.add_argument("--sequences", type=int, default=None, help="sequences of 512 per step (default 8; quick 4)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--backends", action="store_true", help="CUDA: also mlm with each attention backend")
    parser.add_argument("--compile", action="store_true", help="also each fastmae system with compiled layers")
    parser.add_argument("--name", default="throughput", help="results file name under benchmarks/results/ "
                        "(gpu_check: throughput_recipe at the recipes' micro-batch)")
    parser.add_argument("--trace", default="", help="comma-separated systems whose step (as the first row runs it) "
                        "is also written as a Chrome trace, host and GPU: results/NAME_SYSTEM_trace.json.gz")
    parser.add_argument("--eager", action="store_true",
                        help="CUDA: also each fastmae system without CUDA graphs (train.cuda_graphs=never)")
    parser.add_argument("--no-cublas-workspace", action="store_true",
                        help="CUDA: also each fastmae system with no cuBLAS workspace (train.cublas_workspace=none: "
                             "one kernel a GEMM, no memset nor split-K reduction)")
    parser.add_argument("--zero-stage", type=int, choices=(1, 2), default=ZERO_STAGE,
                        help="DeepSpeed ZeRO stage of every system's bf16 engine (default: the recipes')")
    parser.add_argument("--real-data", action="store_true",
                        help="also 3ml on the embedded corpus packed `full` (separators inside, as training sees it) "
                             "and packed `doc` (4 micro-batches a step; padded to fixed shapes where graphs replay)")
    args = parser.parse_args(argv)
    systems, sizes = args.systems.split(","), args.size.split(",")
    if not set(sizes) <= set(SIZES):
        parser.error(f"--size: unknown {sorted(set(sizes) - set(SIZES))}; choose from {sorted(SIZES)}")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {SYSTEMS}")
    if set(HF_SYSTEMS) & set(systems):
        try:
            import transformers  # noqa: F401
        except ImportError:
            parser.error("hf-roberta and hf-modernbert need transformers: pip install -e '.[hf]' (or leave them out "
                         "with --systems)")
    sequences = args.sequences or (4 if args.quick else 8)
    warmup, repeats = (1, 3) if args.quick else (2, 5)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision, line = choose_precision(args.dtype, device)
    if line:
        print(line, flush=True)
    peak = PeakFlops(matmul_flops(device, DTYPES[precision]), lambda: matmul_flops(device, DTYPES[precision]),
                     log=lambda line: print(line, flush=True))
    print(f"{device} GEMM peak in {precision}: {peak.flops / 1e9:.1f} GFLOP/s", flush=True)

    runs = [(system, None) for system in systems]
    if args.backends and device.type == "cuda":
        from fastmae.attention import available_backends

        runs += [("mlm", b) for b in available_backends(device) if b != "reference"]
    if args.compile:
        runs += [(system, "compiled") for system in systems if system not in HF_SYSTEMS]
    if args.eager and device.type == "cuda":
        runs += [(system, EAGER) for system in systems if system not in HF_SYSTEMS]
    if args.no_cublas_workspace and device.type == "cuda":
        runs += [(system, NO_WORKSPACE) for system in systems if system not in HF_SYSTEMS]
    if args.real_data:
        runs += [("3ml", REAL_DATA), ("3ml", DOC_DATA)]
    rows = []
    for size in sizes:
        size_rows = []
        for system, variant in runs:
            note = ", no attn dropout" if variant == "torch_varlen" else ""
            name = system if variant is None else f"{system} [{variant}{note}]"
            trace = (RESULTS_DIR / f"{args.name}_{system}_trace.json.gz"
                     if variant is None and system in args.trace.split(",") else None)
            result = _run_isolated(system, size, sequences, precision, warmup, repeats, variant, args.zero_stage,
                                   trace)
            size_rows.append({"system": name, "size": size, "dtype": precision, **result})
            mfu = peak.mfu(result["flops_per_step"] / result["step_s"], name)
            print(f"{size:>5} {name:>16}: {result['tokens_per_s']:8.1f} tokens/s  step {result['step_s']:.3f} s  "
                  f"MFU {'-' if mfu is None else f'{mfu:.3f}'}  peak memory "
                  f"{result['peak_memory_mib']:.0f} MiB", flush=True)
        peers = {peer: next((row["tokens_per_s"] for row in size_rows if row["system"] == peer), None)
                 for peer in HF_SYSTEMS}
        for row in size_rows:  # each system against the peer of its layers
            modern = row["system"].split(" [")[0] in (*MODERN_SYSTEMS, "hf-modernbert")
            reference = peers["hf-modernbert" if modern else "hf-roberta"]
            row["x_hf"] = row["tokens_per_s"] / reference if reference else None
            row["gflops_per_step"] = row["flops_per_step"] / 1e9
        rows += size_rows
    for row in rows:  # against the final peak: one denominator for every row; none where no GEMM reached a row's rate
        row["mfu"] = None if peak.kind == "achieved" else row["flops_per_step"] / row["step_s"] / peak.flops
        row["peak_source"] = peak.kind
    unseen = graph_rows_without_kernels(rows)

    shapes = ", ".join(f"{size} = {SIZES[size]['encoder_layers']} x {SIZES[size]['hidden_size']}" for size in sizes)
    title = (f"{shapes}; {sequences} x {SEQ_LEN} tokens, vocab {VOCAB_SIZE}, {precision}, peak "
             f"{peak.flops / 1e9:.0f} GFLOP/s")
    stage = args.zero_stage if precision != "fp32" else 0
    notes = (f"{title}. Full training steps (DeepSpeed ZeRO-{stage} + AdamW) in steady state: the median over "
             f"{repeats} runs of {STEPS_PER_WINDOW} steps issued back to back, the device drained after each run "
             f"(after {warmup} warm-up steps), as the trainer issues its steps, none of which reads a device value "
             "back. "
             f"MFU = model FLOPs / (step time x the {peak.source}); Hugging Face RoBERTa's FLOPs include its LM "
             "head on every row; x_hf: against hf-modernbert for the modern-* rows, hf-roberta for the others. "
             "Peak memory: CUDA allocator peak, or resident-set growth of the system's process."
             + (f" gpu_busy left out for {', '.join(unseen)}: its profile saw under half the kernels of the same "
                "system's eager row, so it missed the replayed graphs' kernels." if unseen else ""))
    columns = ["size", "system", "attention", "tokens_per_s", "x_hf", "step_s", "gflops_per_step", "mfu",
               "peak_memory_mib"]
    if device.type == "cuda":
        columns += ["gpu_busy", "cuda_graphs"]
    header = {"dtype": precision, "peak_flops": peak.flops, "peak_source": peak.source, "sizes": sizes,
              "sequences": sequences, "seq_len": SEQ_LEN, "vocab_size": VOCAB_SIZE, "zero_stage": stage,
              "versions": _versions()}
    path = write_results(args.name, rows, columns, "Training throughput and MFU", notes, header)
    _plot(rows, RESULTS_DIR / f"{args.name}.png", title)
    print(f"wrote {path} and {args.name}.json, {args.name}.png")
    return 0


def graph_rows_without_kernels(rows: list[dict]) -> list[str]:
    """Rows whose CUDA graphs replayed but whose profile saw under half the kernels of the same system's eager row:
    the profiler counted the graph launches, not the kernels they ran. Their gpu_busy would read low, so it is set
    to None; returns their names."""
    eager = {(row["size"], row["system"].split(" [")[0]): row for row in rows if row["system"].endswith(f"[{EAGER}]")}
    unseen = []
    for row in rows:
        reference = eager.get((row["size"], row["system"].split(" [")[0]))
        replayed = row.get("cuda_graphs", "no") != "no" and not row["cuda_graphs"].startswith("0 ")
        if replayed and reference is not None and row is not reference and \
                row.get("gpu_kernels_per_step", 0) < 0.5 * reference.get("gpu_kernels_per_step", 0):
            row["gpu_busy"] = None
            unseen.append(row["system"])
    return unseen


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("deepspeed", "triton", "transformers", "flash-attn"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    from fastmae.malloc import restart_with_malloc_tunables

    restart_with_malloc_tunables()  # as fastmae's entry points do; the systems' processes inherit it
    sys.exit(main())
