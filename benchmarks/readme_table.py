"""Print the README's benchmark tables from the committed results (throughput.json, budget.json).

    python benchmarks/readme_table.py
"""

from __future__ import annotations

import json

from common import RESULTS_DIR


def throughput_table(result: dict) -> str:
    rows = ["| size | system | tokens/s | × HF | step (s) | model GFLOP / step | MFU | peak memory (MiB) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        x_hf = f"{r['x_hf']:.2f}" if r.get("x_hf") else "—"
        rows.append(f"| {r['size']} | {r['system']} | {r['tokens_per_s']:,.0f} | {x_hf} | {r['step_s']:.2f} | "
                    f"{r['flops_per_step'] / 1e9:,.0f} | {r['mfu']:.2f} | {r['peak_memory_mib']:,.0f} |")
    head = (f"sizes {', '.join(result['sizes'])}, {result['sequences']} × {result['seq_len']} tokens, vocab "
            f"{result['vocab_size']:,}, {result['dtype']}, on {result['device']} (CPU capability "
            f"{result['cpu_capability']}), GEMM peak {result['peak_flops'] / 1e9:,.0f} GFLOP/s, git "
            f"{result['git_sha']}:")
    return head + "\n\n" + "\n".join(rows)


def budget_table(result: dict) -> str:
    rows = ["| size | objective | decoder layers | mask rate | PFLOP / step | × RoBERTa |", "|---|---|---|---|---|---|"]
    for r in result["results"]:
        rows.append(f"| {r['size']} | {r['objective']} | {r['decoder_layers']} | {r['mask_rate']:.0%} | "
                    f"{r['pflops_per_step']:.2f} | {r['x_roberta']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    for name, table in (("throughput", throughput_table), ("budget", budget_table)):
        path = RESULTS_DIR / f"{name}.json"
        print(table(json.loads(path.read_text())) if path.exists() else f"({path} not found: run {name}.py)")
        print()


if __name__ == "__main__":
    main()
