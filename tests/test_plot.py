"""fastmae plot: a run's curves drawn from its metrics.jsonl."""

from __future__ import annotations

import json

import pytest

import fastmae.plot
from fastmae.errors import FastmaeError
from fastmae.plot import plot_run


def write_metrics(run_dir, steps):
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [{"kind": "train", "step": s, "loss": 6.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 8000.0 + s,
                "tokens_seen": 512 * s + 16 * s * s} for s in steps]  # steps growing by 32 tokens: a batch warm-up
    records.append({"kind": "eval", "step": steps[-1], "loss": 5.9, "unigram_entropy": 5.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("steps", [[30], [10, 20, 30]])
def test_every_train_curve_shows_even_a_run_of_one_record(tmp_path, monkeypatch, steps):
    figures = []
    monkeypatch.setattr(fastmae.plot, "save_figure", lambda fig, path: figures.append(fig) or path)
    write_metrics(tmp_path / "run", steps)
    assert plot_run(tmp_path / "run") == tmp_path / "run" / "curves.png"
    train_lines = [line for ax in figures[0].axes for line in ax.get_lines()
                   if len(line.get_xdata()) == len(steps) and line.get_label() != "held-out at 15% mask"]
    assert len(train_lines) == 4  # loss, learning rate, tokens/s, tokens a step
    batch = next(ax for ax in figures[0].axes if ax.get_ylabel().startswith("tokens a step")).get_lines()[0]
    seen = [512 * s + 16 * s * s for s in steps]  # each record's tokens over its steps since the one before
    assert list(batch.get_ydata()) == [(b - a) / (t - u) for a, b, u, t in zip([0, *seen], seen, [0, *steps], steps)]
    # a line through one point draws nothing: a lone record is drawn as a marker
    assert all((line.get_marker() not in (None, "None", "", " ")) == (len(steps) == 1) for line in train_lines)


def test_a_directory_without_metrics_is_named(tmp_path):
    with pytest.raises(FastmaeError, match="metrics.jsonl: missing"):
        plot_run(tmp_path)
