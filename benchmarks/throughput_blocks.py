"""The results blocks of throughput and of the GPU check (benchmarks/readme_table.py renders them): the ModernBERT
rows on CPU and GPU, the GPU headline and kernels, each GPU step's kernel time by kind, the recipes' micro-batch, and
torch's FlashAttention-2 kernels against cuDNN (scripts/flash_probe.py)."""

from __future__ import annotations

from pathlib import Path

from common import KERNEL_KINDS, RESULTS_DIR, measured_when, mfu_text, read_json


def throughput_modernbert() -> str:
    """fastmae's objectives on ModernBERT's layers against transformers' ModernBertForMaskedLM, one CPU run."""
    return _modernbert_rows(RESULTS_DIR / "throughput_modernbert.json")


def _modernbert_rows(path: Path) -> str:
    result = _gpu_result(path)
    rows = ["| system | tokens/s | × ModernBertForMaskedLM | model GFLOP / step | × its FLOPs | MFU "
            "| peak memory (MiB) |", "|---|---|---|---|---|---|---|"]
    by_system = {r["system"]: r for r in result["results"]}
    peer = by_system["hf-modernbert"]
    for r in result["results"]:
        rows.append(f"| {r['system']} | {r['tokens_per_s']:,.0f} | {r['x_hf']:.2f} | {r['gflops_per_step']:,.0f} | "
                    f"{r['flops_per_step'] / peer['flops_per_step']:.2f} | {mfu_text(r['mfu'])} | "
                    f"{r['peak_memory_mib']:,.0f} |")
    return (f"{', '.join(result['sizes'])} ({SIZE_SHAPES.get(result['sizes'][0], '')}), {result['sequences']} x "
            f"{result['seq_len']} tokens a step, vocabulary {result['vocab_size']:,}, {result['dtype']}, on "
            f"{result['device']} (CPU capability {result['cpu_capability']}), GEMM peak "
            f"{result['peak_flops'] / 1e9:,.0f} GFLOP/s, {measured_when(result)} "
            f"(`{path.relative_to(RESULTS_DIR.parent.parent).with_suffix('.md')}`):"
            "\n\n" + "\n".join(rows) + "\n")


SIZE_SHAPES = {"small": "6 x 512", "base": "12 x 768"}


def gpu() -> str:
    """The one GPU run so far: throughput and the fused cross-entropy, with the commit and date they measured."""
    blocks = []
    for directory in sorted((RESULTS_DIR / "gpu").iterdir()):
        result = _gpu_result(gpu_file(directory, "headline/throughput_headline.json", "throughput.json"))
        rows = ["| system | tokens/s | MFU | GPU busy | peak memory | CUDA graphs |", "|---|---|---|---|---|---|"]
        for r in result["results"]:
            name = "Hugging Face RoBERTa" if r["system"] == "hf-roberta" else f"fastmae {r['system']}"
            rows.append(f"| {name} | {r['tokens_per_s'] / 1e3:,.0f}K | {mfu_text(r['mfu'])} | {r['gpu_busy']:.2f} | "
                        f"{r['peak_memory_mib'] / 1024:.1f} GiB | {r.get('cuda_graphs', 'no')} |")
        block = (f"{result['device']}, {measured_when(result)} (`benchmarks/results/gpu/{directory.name}/`), torch "
                 f"{result['torch']}, base size, {result['sequences']} x {result['seq_len']} tokens, vocab "
                 f"{result['vocab_size']:,}, {result['dtype']}, MFU against the {result['peak_flops'] / 1e12:,.0f} "
                 "TFLOP/s GEMM peak measured in the run:\n\n" + "\n".join(rows) + "\n")
        kernels_path = gpu_file(directory, "kernels/kernels.json", "kernels.json")
        if kernels_path.is_file():
            ce = {r["op (fwd+bwd)"]: r for r in read_json(kernels_path)["results"]}["linear cross-entropy"]
            block += (f"\nThe fused cross-entropy (`linear cross-entropy` in `kernels.md`): {ce['triton GPU ms']:.1f} "
                      f"ms of GPU time, {ce['% of peak FLOP/s']:.0f}% of the data-sheet FLOP/s, {ce['speedup']:.1f}x "
                      f"torch's reference in wall time and {ce['torch MiB'] / ce['triton MiB']:.0f}x less memory.\n")
        blocks.append(block)
    return "\n".join(blocks)


def _gpu_result(path: Path) -> dict:
    """A GPU benchmark's result, stamped with the commit its phase measured (phase.json beside it), where it has one:
    the stamp's own commit is whatever `git` found on the lent machine."""
    result = read_json(path)
    record = path.parent / "phase.json"
    return {**result, "git_sha": read_json(record)["commit"][:7]} if record.is_file() else result


def gpu_file(directory: Path, collected: str, first_run: str) -> Path:
    """A GPU result of `directory`: the phase's file as `scripts/gpu_check.sh --collect` lays it out, else the file of
    the first GPU run, which predates phases."""
    return directory / collected if (directory / collected).is_file() else directory / first_run


def throughput_modernbert_gpu() -> str:
    """The same rows from the GPU check's `modernbert` phase, on each device that ran it."""
    return "\n".join(_modernbert_rows(path) for path in
                     sorted((RESULTS_DIR / "gpu").glob("*/modernbert/throughput_modernbert_gpu.json")))


KIND_ORDER = (*(kind for kind, _ in KERNEL_KINDS), "other")  # benchmarks/common.kernel_kind's kinds


def gpu_kernel_kinds() -> str:
    """Each GPU step's kernel time by kind (benchmarks/common.kernel_kind), from every GPU throughput run that
    recorded it: where a step's non-GEMM time goes."""
    blocks = []
    for path in sorted((RESULTS_DIR / "gpu").rglob("throughput*.json")):  # rows without kinds predate them
        result = _gpu_result(path)
        rows = [r for r in result["results"] if r.get("gpu_kernel_kinds")]
        if not rows:
            continue
        lines = ["| system | backend | " + " | ".join(KIND_ORDER) + " | all kernels | step |",
                 "|---|---|" + "---|" * (len(KIND_ORDER) + 2)]
        for r in rows:
            kinds = r["gpu_kernel_kinds"]
            lines.append(f"| {r['system']} | {r['attention']} | "
                         + " | ".join(f"{kinds[k][0]:.1f}" if k in kinds else "-" for k in KIND_ORDER)
                         + f" | {sum(ms for ms, _ in kinds.values()):.1f} | {1e3 * r['step_s']:.1f} |")
        blocks.append(f"{result['device']}, {measured_when(result)}, {result['sequences']} x {result['seq_len']} "
                      f"tokens a step, {result['dtype']}, ms per step "
                      f"(`{path.relative_to(RESULTS_DIR.parent.parent)}`):\n\n"
                      + "\n".join(lines) + "\n")
    return "\n".join(blocks)


def micro_batch() -> str:
    """The recipes' micro-batch from measured GPU memory (benchmarks/micro_batch.py)."""
    result = read_json(RESULTS_DIR / "micro_batch.json")
    return ("Chosen per recipe (`benchmarks/results/micro_batch.md`, "
            f"{result['budget']:.0%} of the device's {result['device_gib']:.0f} GB): "
            + "; ".join(f"`{r['recipe']}` {r['chosen_tokens']:,} tokens ({r['slope_from']})" for r in result["results"])
            + ".\n")


def flash_probe() -> str:
    """torch's FlashAttention-2 varlen kernels against cuDNN's (padded SDPA) on each GPU that ran
    scripts/flash_probe.py: forward + backward ms per stream, with and without attention dropout."""
    blocks = []
    for path in sorted((RESULTS_DIR / "gpu").glob("*/flash/flash_probe.json")):
        result = read_json(path)
        rows = ["| stream | attention dropout | cuDNN global | FlashAttention-2 global | FlashAttention-2 window of "
                "64 rows |", "|---|---|---|---|---|"]
        for key, timed in result.items():
            if not key.startswith("speed "):
                continue
            for dropout in ("0.1", "0.0"):
                ms = {form: timed.get(f"{name} dropout={dropout} {kind}", {}).get("fwd_bwd_ms")
                      for form, name, kind in (("cudnn", "sdpa (auto: cuDNN)", "global"),
                                               ("global", "flash2", "global"), ("local", "flash2", "local"))}
                rows.append(f"| {key.removeprefix('speed ')} | {dropout} | "
                            + " | ".join("-" if v is None else f"{v:.2f}" for v in ms.values()) + " |")
        blocks.append(f"{result['device']}, torch {result['torch']}, 12 heads of 64, bf16, forward + backward ms "
                      f"(`{path.relative_to(RESULTS_DIR.parent.parent)}`):\n\n" + "\n".join(rows) + "\n")
    return "\n".join(blocks)


def gpu_layer_kernels() -> str:
    """Each fused layer kernel against the stock torch ops it replaces, forward + backward at 65,536 rows, on each GPU
    whose `headline` phase ran `benchmarks/kernels.py --ops layers`: wall time per call and GPU time (what a
    replayed CUDA graph pays)."""
    blocks = []
    for path in sorted((RESULTS_DIR / "gpu").glob("*/headline/kernels_layers.json")):
        result = _gpu_result(path)
        rows = ["| op (forward + backward) | torch ms | fused ms | torch / fused | torch GPU ms | fused GPU ms | "
                "torch / fused, GPU time | torch MiB | fused MiB |", "|---|---|---|---|---|---|---|---|---|"]
        for r in result["results"]:
            rows.append(f"| {r['op (fwd+bwd)']} | {r['torch ms']:.3f} | {r['triton ms']:.3f} | {r['speedup']:.2f} | "
                        f"{r['torch GPU ms']:.3f} | {r['triton GPU ms']:.3f} | "
                        f"{r['torch GPU ms'] / r['triton GPU ms']:.2f} | {r['torch MiB']:.0f} | "
                        f"{r['triton MiB']:.0f} |")
        blocks.append(f"{result['device']}, torch {result['torch']}, {measured_when(result)}, bf16 "
                      f"(`{path.relative_to(RESULTS_DIR.parent.parent)}`):\n\n" + "\n".join(rows) + "\n")
    return "\n".join(blocks)


def gpu_local_attention() -> str:
    """A local layer's attention in every form tried against a global layer's, forward + backward at the throughput
    benchmark's micro-batch, on each GPU that ran `benchmarks/local_attention.py`."""
    blocks = []
    for path in sorted((RESULTS_DIR / "gpu").glob("*/*/local_attention_flex.json")):
        result = _gpu_result(path)
        rows = ["| shape | form | forward ms | forward + backward ms | forward GPU ms | forward + backward GPU ms | "
                "x global | tiles' products x global | window's share of pairs | error |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["results"]:  # GPU ms since 2026-11-27's second H200 run (x global from wall time before)
            timed = [f"{r[key]:.3f}" if isinstance(r.get(key), float) else "-"
                     for key in ("forward ms", "forward + backward ms", "forward GPU ms", "forward + backward GPU ms",
                                 "x global", "tiles' products x global")]
            share = r["window's share of pairs"]
            rows.append(f"| {r['shape']} | {r['form']} | {' | '.join(timed)} | {share:.3f} | "
                        f"{r['error'].split(':')[0]} |")
        blocks.append(f"{result['device']}, torch {result['torch']}, {measured_when(result)}, 128 sequences, bf16, "
                      f"median of repeats (`{path.relative_to(RESULTS_DIR.parent.parent)}`):\n\n"
                      + "\n".join(rows) + "\n")
    return "\n".join(blocks)


GENERATORS = {"gpu": gpu, "micro_batch": micro_batch, "throughput_modernbert": throughput_modernbert,
              "throughput_modernbert_gpu": throughput_modernbert_gpu, "gpu_kernel_kinds": gpu_kernel_kinds,
              "flash_probe": flash_probe, "gpu_layer_kernels": gpu_layer_kernels,
              "gpu_local_attention": gpu_local_attention}
