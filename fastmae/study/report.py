"""The study's report: report.md and its two plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..atomic import atomic_write_text
from ..plot import pyplot, save_figure
from .schema import ObjectiveResult


# ------------------------------------------------------------------------------------------------ the report
def plot_curves(summary: dict[str, ObjectiveResult], out: Path) -> Path:
    """loss_vs_flops.png: held-out loss and accuracy against cumulative training FLOPs (seed mean, min-max band)."""
    fig, (ax_loss, ax_acc) = pyplot().subplots(1, 2, figsize=(12, 4.5))
    for label, entry in summary.items():
        curves = [s.curve for s in entry.per_seed]
        points = min(len(c) for c in curves)
        flops = np.mean([[r.flops for r in c[:points]] for c in curves], axis=0)
        for ax, key in ((ax_loss, "loss"), (ax_acc, "accuracy")):
            values = np.array([[getattr(r, key) for r in c[:points]] for c in curves])
            line, = ax.plot(flops, values.mean(0), "o-", label=label)
            if len(curves) > 1:
                ax.fill_between(flops, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
    first = next(iter(summary.values())).per_seed[0]
    ax_loss.axhline(summary["mlm"].final_eval_loss, color="black", linestyle=":", label="mlm's final loss")
    ax_loss.axhline(first.unigram_entropy, color="gray", linestyle="--", label="unigram entropy")
    ax_acc.axhline(first.unigram_accuracy, color="gray", linestyle="--", label="most frequent token")
    ax_loss.set(xlabel="cumulative training FLOPs", ylabel="held-out masked-token loss (nats)",
                title="held-out loss vs compute (band: min-max over seeds)")
    ax_acc.set(xlabel="cumulative training FLOPs", ylabel="held-out masked-token accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out / "loss_vs_flops.png")


def plot_ranks(summary: dict[str, ObjectiveResult], hidden: int, out: Path) -> Path:
    """ranks.png: epsilon rank of real-token representations per layer, input with and without <mask>."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for label, entry in summary.items():
        without = entry.effective_rank["real_unmasked_input"]
        line, = ax.plot(range(len(without)), without, "o-", label=f"{label}: input without <mask>")
        ax.plot(range(len(without)), entry.effective_rank["real_masked_input"], "x--", color=line.get_color(),
                label=f"{label}: input with <mask>")
    ax.axhline(hidden, color="gray", linestyle=":", label="hidden size")
    ax.set(xlabel="encoder layer (0 = embeddings)", ylabel="epsilon rank (seed mean)",
           title="effective rank of real-token representations")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out / "ranks.png")


def _fmt(value, spec: str = ".4g", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _mean_step(result) -> float:
    """The FLOPs of an objective's average step: what its runs used over the steps they took."""
    return result.flops / (sum(result.steps) / len(result.steps))


def study_tasks(study: dict) -> dict[str, tuple[str, str]]:
    """{task label: (its GLUE directory, its table)} of a study (one before several tasks could be given)."""
    setup = study["setup"]
    if "tasks" in setup:
        return {t["name"]: (t["path"], study["glue_tables"][t["name"]]) for t in setup["tasks"]}
    return {setup["task_name"]: (setup["task"], study["glue_table"])} if setup.get("task") else {}


def _finetune_section(study: dict, rates: str) -> list[str]:
    """The report's fine-tuning paragraph and each task's GLUE table (none without a task)."""
    tasks, setup = study_tasks(study), study["setup"]
    if not tasks:
        return []
    lines = [f"Fine-tuning: {', '.join(f'{label} from `{path}`' for label, (path, _) in tasks.items())} through "
             f"`fastmae glue` (its cells in `glue*/`): per encoder a grid of learning rates {rates} "
             f"(RoBERTa's, scaled to the width), batch {setup['finetune']['batch_size']}, "
             f"{setup['finetune']['epochs']} epoch(s), {setup['finetune']['seeds']} seed(s) per cell; each "
             "encoder counts at its best cell on dev, and the score is the median over every (pretraining seed, "
             "fine-tuning seed) pair there, the range over the same runs. A fine-tune that predicted one class "
             "or kept its training loss at chance did not train: no claim is made from it.", ""]
    for label, (_, table) in tasks.items():
        lines += [f"{label}, per encoder (rows: runs), the median over fine-tuning seeds of its best cell:", "",
                  table, ""]
    return lines


def write_report(study: dict, out: Path) -> Path:
    """report.md from what study.json holds (its `objectives` as `ObjectiveResult`s)."""
    summary, setup = study["objectives"], study["setup"]
    rates = ", ".join(f"{lr:.3g}" for lr in setup["finetune"].get("lrs", []))
    lines = ["# fastmae study", "",
             f"Data `{setup['data']}`; budget **{setup['budget']:.4g} training FLOPs per run** "
             f"(fastmae/flops.py: forward + backward of every layer and the head, embeddings and norms ignored); "
             f"preset `{setup['preset']}`; {setup['seeds']} pretraining seed(s) per objective; held-out loss and "
             f"accuracy on {setup['eval_sequences']} sequences, 15% of their tokens hidden the same way for every "
             f"objective, every {setup['budget'] / setup['eval_points']:.4g} FLOPs. Device: {setup['device']}.", "",
             f"Shared by every run: {setup['shared']}.", "",
             "![held-out loss against compute](loss_vs_flops.png)", "",
             "## Results", "",
             "| objective | encoder / decoder layers; FLOPs per step | steps | FLOPs used | held-out loss | accuracy "
             "| % of mlm's compute to reach mlm's final loss | fine-tuned | last-layer rank, without / with `<mask>` |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, e in summary.items():
        model = study["models"][label]
        loss = f"{e.final_eval_loss:.3f}" + (f" ± {e.final_eval_loss_spread / 2:.3f}"
                                             if e.final_eval_loss_spread is not None else "")
        percent = ("not reached" if e.percent_of_mlm_compute_to_match is None
                   else f"{e.percent_of_mlm_compute_to_match:.1f}%")
        tuned = "; ".join(f"{ft.task} {ft.metric} {ft.median:.3f}" + (
            f" (range {ft.spread:.3f}, {ft.runs} runs)" if ft.spread is not None else "")
            + (f", {len(ft.did_not_train)} did not train" if ft.did_not_train else "") for ft in e.finetune) or "-"
        ranks = e.effective_rank
        layers = (f"{model['encoder_layers']} / {model['decoder_layers']} (k={model['insert_layer']}); a step costs "
                  f"{model['flops_per_step_vs_mlm']:.2f}x mlm's")
        if model.get("mask_rate_end", model["mask_rate"]) != model["mask_rate"]:  # a masking schedule: steps vary
            layers += f" at its first rate, {_mean_step(e) / _mean_step(summary['mlm']):.2f}x over its run"
        lines.append(f"| `{label}` | {layers} | {', '.join(map(str, e.steps))} | {e.flops:.4g} | {loss} "
                     f"| {e.final_eval_accuracy:.3f} | {percent} | {tuned} "
                     f"| {ranks['real_unmasked_input'][-1]:.1f} / {ranks['real_masked_input'][-1]:.1f} |")
    first = next(iter(summary.values())).per_seed[0]
    lines += ["", f"Loss: mean over seeds ± half the range between seeds. Held-out baselines: unigram entropy "
              f"{first.unigram_entropy:.3f} nats, most-frequent-token accuracy {first.unigram_accuracy:.3f}. "
              "Ranks: MAE-LM's epsilon rank (epsilon 0.1) of the real tokens' representations, mean over seeds, "
              f"of {setup['analyze_sequences']} held-out sequences with 15% of their tokens replaced by `<mask>` "
              f"and without; width {setup['hidden_size']}. Centred: the same rows minus their mean (a pre-LN "
              "residual stream's shared mean direction alone can hold most of the uncentred energy).", "",
              *_finetune_section(study, rates),
              "## What the numbers say", "",
              "A difference is claimed only when it exceeds the spread between seeds.", ""]
    lines += [f"- {line}" for line in study["findings"]]
    lines += ["", "## Effective rank per layer", "", "![ranks](ranks.png)", "",
              "| objective | input | " + " | ".join(f"layer {i}" for i in range(setup["encoder_layers"] + 1)) + " |",
              "|---|---|" + "---|" * (setup["encoder_layers"] + 1)]
    for label, e in summary.items():
        for key, group, what in (("effective_rank", "real_unmasked_input", "without `<mask>`"),
                                 ("effective_rank", "real_masked_input", "with `<mask>`"),
                                 ("centred_effective_rank", "real_unmasked_input", "without `<mask>`, centred")):
            lines.append(f"| `{label}` | {what} | " + " | ".join(f"{v:.1f}" for v in getattr(e, key)[group]) + " |")
    lines += _matched_section(summary, setup["encoder_layers"]) + _lr_grid_section(study.get("lr_grid") or {})
    lines += ["", "## Sizes, steps and seeds", "",
              "| objective | seed | steps | FLOPs | final loss | final accuracy | % of mlm's compute | seconds |",
              "|---|---|---|---|---|---|---|---|"]
    for label, e in summary.items():
        for s in e.per_seed:
            lines.append(f"| `{label}` | {s.seed} | {s.steps} | {s.flops:.4g} | {s.final_eval_loss:.4f} "
                         f"| {s.final_eval_accuracy:.4f} | {_fmt(s.percent_of_mlm_compute_to_match, '.1f')} | "
                         f"{_fmt(s.seconds, '.0f')} |")
    if setup.get("parallel", 1) > 1:
        lines += ["", f"Runs trained {setup['parallel']} at a time on the one device (`--parallel`): their seconds "
                  "overlap and say nothing of one run's speed."]
    sizes = [f"`{k}` {v['encoder_parameters']:,} / {v['parameters']:,}" for k, v in study["models"].items()]
    lines += ["", "Parameters (embeddings + encoder, what fine-tuning keeps / whole pretraining network): "
              + "; ".join(sizes),
              "", "## Exactly what ran", "", "    " + study["command"], ""]
    for label, commands in study["commands"].items():
        lines += [f"`{label}`:", ""] + [f"    {c}" for c in commands] + [""]
    lines += ["Run configs (every objective shares all but `model.preset`, its overrides, `train.seed` and "
              "`log.dir`): " + ", ".join(f"[`{Path(p).name}`]({p})" for p in study["configs"]), ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(lines))
    return path


def _matched_section(summary: dict[str, ObjectiveResult], encoder_layers: int) -> list[str]:
    """The ranks of every objective at one held-out loss, per layer, with and without `<mask>` in the input."""
    entries = {label: e.ranks_at_matched_loss for label, e in summary.items() if e.ranks_at_matched_loss is not None}
    if not entries:
        return []
    level = next(iter(entries.values())).level
    lines = ["", "## Ranks at matched held-out loss", "",
             "An encoder that has not learned has a low rank whatever its objective, so ranks are compared where every "
             "objective's encoders predict equally well: each seed's weights kept at its evaluation nearest held-out "
             + (f"loss {level:.3f} (the highest of the runs' lowest losses)" if level is not None else "loss -")
             + ". What each row bears on: the uncentred epsilon rank without `<mask>` is MAE-LM's measurement "
             "(Figure 5a: how many dimensions the real tokens' representations use); the drop from without to with "
             "`<mask>` in the input is its Figure 1 deficiency (dimensions that `<mask>` rows take from real tokens, "
             "which the paper expects in mlm and not in MAE-LM); the centred rank removes the mean direction every row "
             "shares, so a low uncentred rank that is only that direction shows up as a high centred one. Pre-LN "
             "models' rows are standardised first, as a post-LN layer outputs them.", "",
             "| objective | steps (held-out loss) | input | "
             + " | ".join(f"layer {i}" for i in range(encoder_layers + 1)) + " |",
             "|---|---|---|" + "---|" * (encoder_layers + 1)]
    for label, matched in entries.items():
        if matched.excluded:
            lines.append(f"| `{label}` | left out: {matched.excluded} |" + " |" * (encoder_layers + 2))
            continue
        where = ", ".join(f"{step} ({loss:.3f}, {loss - level:+.3f} from the level)"
                          for step, loss in zip(matched.steps, matched.losses))
        for key, group, what in (("epsilon_rank", "real_unmasked_input", "without `<mask>`"),
                                 ("epsilon_rank", "real_masked_input", "with `<mask>`"),
                                 ("centred_epsilon_rank", "real_unmasked_input", "without `<mask>`, centred")):
            lines.append(f"| `{label}` | {where} | {what} | "
                         + " | ".join(f"{v:.1f}" for v in getattr(matched.ranks, key)[group]) + " |")
    return lines


def _lr_grid_section(lr_grid: dict) -> list[str]:
    """The learning-rate grid (--lr-grid): each objective's held-out loss at each rate and the rate it trained at."""
    if not lr_grid:
        return []
    first = next(iter(lr_grid.values()))
    rates = list(first["losses"])
    lines = ["", "## Learning rate per objective", "",
             f"Each objective trained at each rate for {first['fraction']:g} of the budget ({first['flops']:.3g} "
             "FLOPs, seed 0, its own schedule over that budget); its study runs trained at the rate with the lowest "
             "held-out loss, from the start. Held-out loss at the end of each short run:", "",
             "| objective | " + " | ".join(f"lr {r}" for r in rates) + " | chosen |",
             "|---|" + "---|" * (len(rates) + 1)]
    for label, grid in lr_grid.items():
        plateau = grid.get("left_plateau", {})
        lines.append(f"| `{label}` | " + " | ".join(f"{grid['losses'][r]:.3f}" + ("" if plateau.get(r, True) else " ∘")
                                                    for r in rates)
                     + f" | {grid['chosen']:g} |")
    return lines + ["", "∘: the run had not left the unigram plateau; an objective whose every grid run is marked "
                    "had its rate chosen blind, and the study makes no claim about it."]


def shared_settings(resolved: dict, lr_per_objective: bool = False) -> str:
    """One line of the settings every run of the study shares, from a resolved run config (the learning rate not
    among them when a grid chose one per objective)."""
    model, data, train = resolved["model"], resolved["data"], resolved["train"]
    keys = ("hidden_size", "num_heads", "encoder_layers", "max_seq_len", "position_embedding", "norm_position",
            "dropout")
    return (", ".join(f"{k} {model[k]}" for k in keys if k in model)
            + f"; {data['packing']} packing, {data['tokens_per_micro_batch']} tokens per micro-batch x "
            f"{train['grad_accum']}; {train['optimizer']} "
            + ("lr per objective (below)" if lr_per_objective else f"lr {train['lr']:g}")
            + f", {train['warmup_steps']} warm-up steps, {_schedule(train)}, clip {train['clip']:g}, weight decay "
            f"{train['weight_decay']:g}, precision {train['precision']}, ZeRO-{train['zero_stage']}")


def _schedule(train: dict) -> str:
    """The learning rate's schedule after warm-up, in words (wsd: its decay's share and shape)."""
    if train["schedule"] != "wsd":
        return f"{train['schedule']} decay"
    decay = (f"the last {train['decay_steps']} steps" if train.get("decay_steps")
             else f"the last {train.get('decay_fraction', 0.1):.0%} of the steps")
    return f"warmup-stable-decay ({train.get('decay_shape', 'linear')} over {decay})"
