"""Continued pretraining with each objective from one mlm encoder: does switching an mlm-trained encoder to 3ml or
mae-lm keep its quality at their cost? (issue 42's measurement)

    python benchmarks/continued.py [--budget 4.5e12] [--source-budget 9e12] [--seeds 2] [--work runs/continued]

1. The embedded corpus split by document into two halves (even documents: A, odd: B), each prepared with A's tokenizer.
2. The source: an mlm encoder of the cpu-30min study's shape (6 x 128, 64-token sequences) trained on A
   (`fastmae study --objectives mlm`, one seed, --source-budget FLOPs).
3. From that encoder, `fastmae study` on B with mlm, mae-lm and 3ml (`train.init_from`), each for --budget training
   FLOPs and --seeds seeds, evaluated on B's held-out split, fine-tuned on the word-order task made from B's text
   (through `fastmae glue`: the same learning-rate grid for every encoder), every claim held to the seed spread.

Writes benchmarks/results/continued_cpu/ (report.md, study.json, loss_vs_flops.png, ranks.png, run.md, source.md);
`python benchmarks/readme_table.py --write` puts its table into README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "continued_cpu"


def fastmae(*args: str) -> None:
    """Run a fastmae command, its output shown; stop on failure."""
    print("$ fastmae " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "fastmae.cli", *args], cwd=REPO, check=True)


def halves(work: Path) -> tuple[Path, Path]:
    """The embedded corpus's documents alternately into two JSONL files; (A, B)."""
    from fastmae.data.builtin import builtin_documents

    files = (work / "half_a.jsonl", work / "half_b.jsonl")
    documents = [text for _, text in builtin_documents()]
    for parity, path in enumerate(files):
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents[parity::2]))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=4.5e12, help="training FLOPs of each continued run")
    parser.add_argument("--source-budget", type=float, default=9e12, help="training FLOPs of the mlm source on A")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "continued")
    parser.add_argument("--task", default="generated", help="the studies' --task, or `none`: no fine-tuning")
    parser.add_argument("--reuse", action="store_true", help="keep --work: reuse finished data, runs and cells")
    args = parser.parse_args(argv)
    started = time.time()
    if not args.reuse:
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    half_a, half_b = halves(args.work)
    data_a, data_b = args.work / "data_a", args.work / "data_b"
    fastmae("prepare", "--input", str(half_a), "--format", "jsonl", "--output", str(data_a), "--vocab-size", "1000",
            "--valid-fraction", "0.1")
    fastmae("prepare", "--input", str(half_b), "--format", "jsonl", "--output", str(data_b), "--tokenizer",
            str(data_a / "tokenizer.model"), "--valid-fraction", "0.1")
    source_study = args.work / "source"
    fastmae("study", "--data", str(data_a), "--objectives", "mlm", "--seeds", "1", "--budget",
            f"{args.source_budget:g}", "--out", str(source_study))
    source = source_study / "runs" / "mlm-seed0"
    continued = args.work / "continued"
    fastmae("study", "--data", str(data_b), "--objectives", "mlm,mae-lm,3ml", "--seeds", str(args.seeds),
            "--budget", f"{args.budget:g}", *([] if args.task == "none" else ["--task", args.task]), "--out",
            str(continued), f"train.init_from={source}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in ("report.md", "study.json", "loss_vs_flops.png", "ranks.png"):
        shutil.copy(continued / name, RESULTS / name)
    shutil.copy(source_study / "report.md", RESULTS / "source.md")
    seconds = int(time.time() - started)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip()
    (RESULTS / "run.md").write_text(
        f"# {continued}\n\n{time.strftime('%Y-%m-%d', time.gmtime())}, git {sha}: `python benchmarks/continued.py "
        f"--budget {args.budget:g} --source-budget {args.source_budget:g} --seeds {args.seeds} --task {args.task}"
        f"{' --reuse' if args.reuse else ''}`; "
        f"{seconds // 60} min {seconds % 60} s from the command to its end. The source's own study report: "
        "source.md.\n")
    print(f"wrote {RESULTS}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
