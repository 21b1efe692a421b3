"""The measured figures of README.md and docs/*.md, generated from the committed results under benchmarks/results/.

    python benchmarks/readme_table.py            # print every block
    python benchmarks/readme_table.py --write    # put them into the documents
    python benchmarks/readme_table.py --check    # exit 1 naming each block that differs or is missing (tests run it)

Every figure README.md or a page under docs/ states as fastmae's measurement sits between `<!-- results: NAME -->`
and `<!-- /results -->`; each NAME appears once among the documents and is produced from one artifact that a
committed script regenerates: the studies' blocks in study_blocks.py (`fastmae study`, benchmarks/readme_runs.sh,
benchmarks/continued.py), throughput's and the GPU check's in throughput_blocks.py (benchmarks/throughput.py,
scripts/gpu_check.sh, scripts/flash_probe.py), the rest here:

    demo         benchmarks/results/demo/metrics.jsonl          bash benchmarks/readme_runs.sh demo
    throughput   benchmarks/results/throughput.json             python benchmarks/throughput.py [--size S] [--quick]
    budget       benchmarks/results/budget.json                 python benchmarks/budget.py
    attention    benchmarks/results/attention.json              python benchmarks/attention.py
    data_scale   benchmarks/results/data_scale.json             python benchmarks/data.py --only-scale
    data         benchmarks/results/data.json                   python benchmarks/data.py
    doc_padding  benchmarks/results/doc_padding.json            python benchmarks/doc_padding.py
    mask_schedule_shapes  benchmarks/results/mask_schedule_shapes.json  python benchmarks/mask_schedule_shapes.py
    chaos        benchmarks/results/chaos.json                  python benchmarks/chaos.py
    local_attention  benchmarks/results/local_attention.json    python benchmarks/local_attention.py
    host_overhead  benchmarks/results/host_overhead*.json       python benchmarks/host_overhead.py
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from common import RESULTS_DIR, measured_when, mfu_text, read_json
from study_blocks import GENERATORS as STUDY_GENERATORS
from throughput_blocks import GENERATORS as THROUGHPUT_GENERATORS

from fastmae.metrics import eval_table

README = RESULTS_DIR.parent.parent / "README.md"
DOCS = README.parent / "docs"


def documents() -> list[Path]:
    """Where results blocks live: README.md and every page under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]
BLOCK = re.compile(r"(<!-- results: (?P<name>[a-z0-9_]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def demo() -> str:
    """The demo's held-out curve, its baselines and its speed, from its metrics.jsonl and config."""
    records = [json.loads(line) for line in (RESULTS_DIR / "demo" / "metrics.jsonl").read_text().splitlines()]
    info = read_json(RESULTS_DIR / "demo" / "run_info.json")
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    last = evals[-1]
    speeds = sorted(r["tokens_per_s"] for r in train)
    mfus = sorted(r["mfu"] for r in train if r.get("mfu") is not None)
    no_mfu = len(train) - len(mfus)  # windows whose peak was a rate the run achieved (peak_source: achieved)
    return (f"On {info['ranks']} ranks of a {info['device']}, trained in {info['precision']} (`precision: auto` "
            "picks bf16 on a CPU that multiplies it natively and faster, fp32 elsewhere, so the figures depend on "
            "the CPU kind):\n\n" + eval_table(evals) + "\n\n"
            f"Held-out: the same {last['predicted_tokens']:,} hidden tokens of {last['sequences']} sequences at every "
            f"evaluation. Their unigram baselines: **{last['unigram_entropy']:.2f} nats** (entropy of these tokens' "
            f"own frequencies) and **{last['unigram_accuracy']:.3f}** (always guessing the most frequent of them): "
            f"the demo ends {last['unigram_entropy'] - last['loss']:.2f} nats below the first and at "
            f"{last['accuracy'] / last['unigram_accuracy']:.1f}x the second. Training ran at "
            f"{speeds[len(speeds) // 2]:,.0f} tokens/s (median of {len(train)} records; range {speeds[0]:,.0f}-"
            f"{speeds[-1]:,.0f}), MFU {mfus[0]:.2f}-{mfus[-1]:.2f}"
            + (f" ({no_mfu} records without one: no measured peak)" if no_mfu else "")
            + ". Artifact: `benchmarks/results/demo/` "
            "(`metrics.jsonl`, `curves.png`, `config.yaml`, `run.md` says on what machine).\n")


def throughput() -> str:
    """The CPU throughput table."""
    result = read_json(RESULTS_DIR / "throughput.json")
    rows = ["| size | system | attention | tokens/s | × HF | step (s) | model GFLOP / step | MFU | peak memory (MiB) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        x_hf = f"{r['x_hf']:.2f}" if r.get("x_hf") else "—"
        rows.append(f"| {r['size']} | {r['system']} | {r.get('attention', '—')} | {r['tokens_per_s']:,.0f} | {x_hf} "
                    f"| {r['step_s']:.2f} | {r['flops_per_step'] / 1e9:,.0f} | {mfu_text(r['mfu'])} | "
                    f"{r['peak_memory_mib']:,.0f} |")
    head = (f"Sizes {', '.join(result['sizes'])}, {result['sequences']} × {result['seq_len']} tokens, vocab "
            f"{result['vocab_size']:,}, {result['dtype']}, on {result['device']} (CPU capability "
            f"{result['cpu_capability']}), GEMM peak {result['peak_flops'] / 1e9:,.0f} GFLOP/s, "
            f"{measured_when(result)}:")
    return head + "\n\n" + "\n".join(rows) + "\n"


def budget() -> str:
    """FLOPs per step of each recipe against the mlm step on the same layers (RoBERTa's, or ModernBERT's at 30%)."""
    rows = ["| size | objective | decoder layers | mask rate | PFLOP / step | × mlm step |",
            "|---|---|---|---|---|---|"]
    for r in read_json(RESULTS_DIR / "budget.json")["results"]:
        rows.append(f"| {r['size']} | {r['objective']} | {r['decoder_layers']} | {r['mask_rate']:.0%} | "
                    f"{r['pflops_per_step']:.2f} | {r['x_roberta']:.2f} |")
    return ("\n".join(rows) + "\n\nPer step of RoBERTa's 4.2M tokens (8,192 x 512; ModernBERT's rows 4,096 x 1,024, "
            "its local windows of 128 and GeGLU layers); × mlm step: against RoBERTa for base and large, against "
            "ModernBERT's mlm at its 30% masking on the same layers for modernbert-*.\n")


def attention() -> str:
    """The CPU attention backends' ratios."""
    result = read_json(RESULTS_DIR / "attention.json")
    nested = [r["nested / padded"] for r in result["results"]]
    math = [r["padded / math, dropout"] for r in result["results"]]
    text = (f"On CPU ({result['cpu_capability']}, {measured_when(result)}, `benchmarks/results/attention.md`), "
            "padded SDPA "
            f"beat nested-jagged SDPA by {min(nested):.1f}x-{max(nested):.1f}x for forward + backward at every "
            f"shape, and with attention dropout the `math` backend ran {min(math):.1f}x-{max(math):.1f}x faster "
            "than padded SDPA with dropout.")
    for path in sorted((RESULTS_DIR / "gpu").glob("*/attention.json")):
        gpu = read_json(path)
        rows = gpu["results"]
        padded = [r["padded ms (dropout 0.1)"] for r in rows]
        nested_gpu = [r["nested ms (dropout 0.1)"] for r in rows]
        tokens = [r["tokens"] for r in rows]
        text += (f" On {gpu['device']} ({measured_when(gpu)}, torch {gpu['torch']}, "
                 f"`benchmarks/results/gpu/{path.parent.name}/attention.md`), with dropout, for "
                 f"{min(tokens):,}-{max(tokens):,} tokens: padded SDPA {min(padded):.1f}-{max(padded):.1f} ms "
                 f"forward + backward, nested-jagged {min(nested_gpu):.0f}-{max(nested_gpu):.0f} ms.")
    return text + "\n"


def data_scale() -> str:
    """The largest corpus the loader was measured on."""
    result = read_json(RESULTS_DIR / "data_scale.json")
    rows = ["| packing | sequences | tokens | index (MB) | peak RSS (MB) | first step (ms) | resume (ms) | "
            "per step (ms) | whole epoch (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        rows.append(f"| {r['packing']} | {r['sequences'] / 1e6:.0f} M | {r['tokens'] / 1e9:.0f} G | "
                    f"{r['index_mb']:.0f} | {r['peak_rss_mb']:.0f} | {1e3 * r['first_step_s']:.1f} | "
                    f"{1e3 * r['resume_s']:.1f} | {r['per_step_ms']:.2f} | {r['epoch_s']:.1f} |")
    return f"{result['device']} ({result['cpu_capability']}), {measured_when(result)}:\n\n" + "\n".join(rows) + "\n"


def data() -> str:
    """Tokenising and loading rates against what a model step consumes."""
    result = read_json(RESULTS_DIR / "data.json")
    tokenise = next(r for r in result["results"] if r["stage"].startswith("prepare JSONL"))
    loaders = [r for r in result["results"] if r["stage"].startswith("loader")]
    return (f"Measured on {result['device']} ({result['cpu_capability']}), {measured_when(result)} "
            f"(`benchmarks/results/data.md`): tokenising with a given tokenizer {tokenise['rate']:.0f} MB/s of text "
            f"({tokenise['detail']}); the loader {min(r['rate'] for r in loaders) / 1e6:.1f}-"
            f"{max(r['rate'] for r in loaders) / 1e6:.1f} M tokens/s, {min(r['x model'] for r in loaders):,.0f}-"
            f"{max(r['x model'] for r in loaders):,.0f}x what a small model's CPU training step consumes.\n")


def chaos() -> str:
    """Random kills and resumes per ZeRO stage: identical final weights, where the kills landed, what was left."""
    result = read_json(RESULTS_DIR / "chaos.json")
    rows = ["| ZeRO | trials | final weights identical | killed in start-up / training / a checkpoint write / after "
            "the end | fell back past a damaged checkpoint | processes left | half-written files left | "
            "checkpoint.keep honoured | time lost per kill (median) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        rows.append(f"| {r['zero_stage']} | {r['trials']} | {r['identical']} / {r['trials']} | "
                    f"{r['killed in start-up']} / {r['killed in training']} / {r['killed in checkpoint write']} / "
                    f"{r['killed in after the end']} | {r['fallbacks']} | {r['processes_left']} | "
                    f"{r['leftover_files']} | {r['keep_honoured']} / {r['trials']} | {r['median_lost_s']:.0f} s "
                    f"(uninterrupted run {r['reference_s']:.0f} s) |")
    return (f"{result['device']}, {measured_when(result)}, seed {result['seed']}, {result['steps']} steps "
            "(`benchmarks/results/chaos.md`, every trial in `chaos.json`):\n\n" + "\n".join(rows) + "\n")


def _count(value) -> str:
    """A count with thousands separators, or "-" where none was taken."""
    return "-" if value is None else f"{value:,}"


def host_overhead() -> str:
    """What the host issues per optimizer step: ZeRO-2 (the recipes'), ZeRO-2 replaying CUDA graphs (their CPU twin
    here) and ZeRO-1 side by side, then ZeRO-1 on ModernBERT's layers."""
    rows = ["| system | ZeRO | device ops | forward | backward | optimizer step | loss weights, sums | "
            "Triton launches | Python calls | syncs | model-sized passes | their bytes a parameter |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    names = ("host_overhead_zero2", "host_overhead_zero2_graphs", "host_overhead", "host_overhead_modern")
    results = [read_json(RESULTS_DIR / f"{name}.json") for name in names]
    for result in results:
        # the graphs' rows come from their CPU twin, which counts each replay as one launch: modelled, not measured
        setting = f"{result['zero_stage']}{' + CUDA graphs (modelled)' if result.get('cuda_graphs') else ''}"
        for r in result["results"]:
            rest = r["device_ops_per_step"] - r["forward"] - r["backward"] - r["optimizer"]
            rows.append(f"| {r['system']} | {setting} | {r['device_ops_per_step']:,} | {r['forward']} | "
                        f"{r['backward']} | {r['optimizer']} | {rest} | {r['triton_launches_per_step']} | "
                        f"{_count(r.get('python_calls_per_step'))} | {r['syncs_per_step']} | "
                        f"{r['model_passes_per_step']} | {r['model_bytes_per_parameter']} |")
    first = results[0]
    # a file regenerated alone (its stage's code changed) says its own commit
    later = "".join(f"; `{name}.md` at git {result['git_sha']}" for name, result in zip(names, results)
                    if result["git_sha"] != first["git_sha"])
    return (f"{first['sequences']} x {first['seq_len']} tokens in one micro-batch, bf16, base depth, vocabulary "
            f"32,000, width 96 (6 heads of 16), the CUDA code path emulated on {first['device']}, "
            f"{measured_when(first)} "
            "(`benchmarks/results/"
            + "`, `".join(f"{name}.md" for name in names) + f"`{later}). The CUDA-graph rows are modelled, not "
            "measured: the "
            "CPU twin counts each replay as one launch, as a captured graph would be; no GPU has counted them "
            "yet (nor their Python calls: a replay runs none of the step's Python):\n\n" + "\n".join(rows) + "\n")


def doc_padding() -> str:
    """What padding `doc` packing to the ladder's shapes costs over an epoch of the embedded corpus (3ml's masking)."""
    result = read_json(RESULTS_DIR / "doc_padding.json")
    rows = ["| max_seq_len | tokens per micro-batch | micro-batches | shapes used (of the ladder's) | "
            "in the commonest | filler rows | dummy predicted rows | host ms: masking / padding |",
            "|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        if r["objective"] == "3ml":
            rows.append(f"| {r['max_seq_len']} | {r['tokens_per_batch']:,} | {r['micro_batches']} | "
                        f"{r['shapes_used']} ({r['ladder_shapes']}) | {100 * r['most_common_share']:.0f}% | "
                        f"{r['filler_rows_pct']:.1f}% | {r['dummy_predicted_pct']:.1f}% | "
                        f"{r['mask_ms']:.2f} / {r['pad_ms']:.2f} |")
    return (f"One epoch of the embedded corpus under `doc` packing, 3ml's masking, {result['device']}, "
            f"{measured_when(result)} (`benchmarks/results/doc_padding.md`, mlm and mae-lm there too):\n\n"
            + "\n".join(rows) + "\n")


def mask_schedule_shapes() -> str:
    """The CUDA-graph shapes a run records while its masking rate moves, counted on the CPU twin."""
    result = read_json(RESULTS_DIR / "mask_schedule_shapes.json")
    rows = ["| objective | masking rate | packing | rates | shapes seen | recorded | replayed | eager |",
            "|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r['objective']} | {r['mask_rates']} | {r['packing']} | {r['rates']} | {r['signatures']} | "
             f"{r['recorded']} | {r['replayed_pct']:.1f}% | {r['eager_pct']:.1f}% |" for r in result["results"]]
    steps = result["results"][0]["steps"]
    return (f"{steps:,} one-micro-batch steps of the embedded corpus (512 tokens, sequences of 64), the host's "
            f"masking and padding and the graphs' recording policy only, {result['device']}, {measured_when(result)} "
            "(`benchmarks/results/mask_schedule_shapes.md`):\n\n" + "\n".join(rows) + "\n")


def local_attention() -> str:
    """A local layer's attention against a global one's on this CPU (benchmarks/local_attention.py)."""
    result = read_json(RESULTS_DIR / "local_attention.json")
    rows = ["| stream | dtype | local layers run | global ms | local ms | the window as a dense mask, ms | "
            "window's share of pairs | local / global | target (share x 1.2) | met | CUDA's kernel: tiles' products "
            "x global |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        share = r["window's share of pairs"]
        products = r.get("CUDA's kernel: tiles' products x global")
        rows.append(f"| {r['shape']} | {r['dtype']} | {r['local backend']} | {r['global ms']:.0f} | "
                    f"{r['local ms']:.0f} | {r['window as a dense mask ms']:.0f} | {share:.2f} | "
                    f"{r['local / global']:.2f} | {r['target: share x 1.2']:.2f} | {r['met']} | "
                    f"{'-' if products is None else f'{products:.2f}'} |")
    return (f"Forward + backward, median of repeats, {result['device']} (CPU capability {result['cpu_capability']}), "
            f"{measured_when(result)} (`benchmarks/results/local_attention.md`):\n\n" + "\n".join(rows) + "\n")


GENERATORS = {**STUDY_GENERATORS, **THROUGHPUT_GENERATORS, "demo": demo, "throughput": throughput, "budget": budget,
              "attention": attention, "data_scale": data_scale, "data": data, "host_overhead": host_overhead,
              "doc_padding": doc_padding, "chaos": chaos, "mask_schedule_shapes": mask_schedule_shapes,
              "local_attention": local_attention}


def render(text: str, where: str = "README.md") -> tuple[str, list[str]]:
    """`text` (a document, named `where`) with every results block regenerated, and the names of the blocks that
    changed. Raises ValueError for a block with an unknown name."""
    changed = []

    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise ValueError(f"{where}: unknown results block {name!r}; known: {sorted(GENERATORS)}")
        body = GENERATORS[name]()
        if body != match["body"]:
            changed.append(name)
        return match[1] + body + match[4]

    return BLOCK.sub(fill, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="regenerate the blocks in README.md and docs/*.md")
    action.add_argument("--check", action="store_true", help="exit 1 if a block differs, is missing or is repeated")
    args = parser.parse_args(argv)
    root = README.parent
    texts = {path: path.read_text() for path in documents()}
    rendered = {path: render(text, str(path.relative_to(root))) for path, text in texts.items()}
    changed = {str(path.relative_to(root)): names for path, (_, names) in rendered.items() if names}
    if args.write:
        for path, (text, names) in rendered.items():
            if names:
                path.write_text(text)
        print(f"readme_table: {sum(map(len, changed.values()))} block(s) rewritten: "
              + (", ".join(f"{doc}: {', '.join(names)}" for doc, names in changed.items()) or "none"))
    elif args.check:
        found = [m["name"] for text in texts.values() for m in BLOCK.finditer(text)]
        missing = sorted(set(GENERATORS) - set(found))
        twice = sorted({name for name in found if found.count(name) > 1})
        if changed or missing or twice:
            print(f"readme_table: blocks that differ from their artifacts: {changed or 'none'}; missing: "
                  f"{missing or 'none'}; in more than one place: {twice or 'none'} (python "
                  "benchmarks/readme_table.py --write)", file=sys.stderr)
            return 1
    else:
        for name, generate in GENERATORS.items():
            print(f"<!-- results: {name} -->\n{generate()}<!-- /results -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
