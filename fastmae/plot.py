"""`fastmae plot RUN_DIR`: loss (train and held-out, with the learning rate behind them) and throughput curves of a
run, as RUN_DIR/curves.png.

    fastmae plot runs/tiny-cpu [--output FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .atomic import atomic_path
from .errors import FastmaeError, run_command
from .metrics import read_metrics


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay `fig` out, write it to `path` as a PNG atomically, close it, and return the path."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    pyplot().close(fig)
    return Path(path)


def plot_run(run_dir: Path, output: Path | None = None) -> Path:
    """Draw the run's curves to `output` (default RUN_DIR/curves.png) and return the path."""
    plt = pyplot()
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FastmaeError(f"{run_dir / 'metrics.jsonl'}: missing (is {run_dir} a training run directory?)")
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        raise FastmaeError(f"{run_dir / 'metrics.jsonl'}: no training records yet")
    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(11, 4))
    point = {"marker": "o"} if len(train) == 1 else {}  # a line through one record draws nothing
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train (masked tokens)", **point)
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-",
                     label=f"held-out at {evals[0].get('mask_rate', 0.15):.0%} mask")
        if "unigram_entropy" in evals[-1]:  # the loss of predicting token frequencies alone, ignoring context
            ax_loss.axhline(evals[-1]["unigram_entropy"], color="gray", linestyle="--",
                            label="held-out unigram entropy")
    ax_loss.set(xlabel="optimizer step", ylabel="cross-entropy (nats)", title=f"loss: {run_dir.name}")
    ax_lr = ax_loss.twinx()  # the schedule behind the loss: where a decay starts shows in both
    ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train], color="gray", linewidth=1, alpha=0.6,
               label="learning rate (right axis)", **point)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_ylim(bottom=0)
    handles = [h for ax in (ax_loss, ax_lr) for h in ax.get_legend_handles_labels()[0]]
    ax_loss.legend(handles=handles)
    ax_loss.grid(alpha=0.3)
    ax_speed.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], color="tab:green", **point)
    ax_speed.set(xlabel="optimizer step", ylabel="tokens / s (all ranks)", title="throughput")
    ax_speed.grid(alpha=0.3)
    if all("tokens_seen" in r for r in train):  # the global batch behind the rate: a batch warm-up shows here
        ax_batch = ax_speed.twinx()
        steps, seen = [0] + [r["step"] for r in train], [0] + [r["tokens_seen"] for r in train]
        per_step = [(seen[i] - seen[i - 1]) / max(steps[i] - steps[i - 1], 1) for i in range(1, len(steps))]
        ax_batch.plot(steps[1:], per_step, color="gray", linewidth=1, alpha=0.6, **point)
        ax_batch.set_ylabel("tokens a step (all ranks; right axis)")
        ax_batch.set_ylim(bottom=0)
    return save_figure(fig, Path(output) if output else run_dir / "curves.png")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--output", type=Path, help="PNG path (default RUN_DIR/curves.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command("fastmae plot", lambda: print(plot_run(args.run_dir, args.output)))


if __name__ == "__main__":
    sys.exit(main())
