"""The study's numbers: compute to reach mlm's loss, spreads over seeds, the summary per objective and the findings
that survive the seed spread."""

from __future__ import annotations

import json

import numpy as np

from ..claims import compare, spread
from ..evaluation import PLATEAU_MARGIN, left_plateau
from ..probe import judged
from ..tasks import GLUE_TASKS
from .objectives import Objective
from .runs import Run, eval_curve
from .schema import EvalPoint, FinetuneResult, MatchedRanks, ObjectiveResult, Ranks, SeedResult


# ------------------------------------------------------------------------------------------------ the numbers
def flops_to_reach(curve: list[dict], target: float) -> float | None:
    """Training FLOPs at which the held-out loss first falls to `target`, linearly interpolated between
    evaluations (None if it never does)."""
    previous = None
    for record in curve:
        if record["loss"] <= target:
            if previous is None:
                return record["flops"]  # reached by the first evaluation: no earlier point to interpolate from
            share = (previous["loss"] - target) / (previous["loss"] - record["loss"])
            return previous["flops"] + share * (record["flops"] - previous["flops"])
        previous = record
    return None


NO_CONTEXT = ("a seed's encoder showed no context (no layer's neighbour probe beat what the token alone tells beyond "
              "chance, `fastmae analyze` at the end of the budget), so its held-out loss may have come from its "
              "decoder")


def matched_points(curves: dict[str, list[list[dict]]], encoder_learned: dict[str, list[bool]] | None = None
                   ) -> tuple[float | None, dict[str, list[dict] | str]]:
    """The held-out loss level every run that learned reached (the highest of their lowest losses), and per objective
    each seed's evaluation nearest that level, or why the objective is left out of the comparison. A run learned
    when its held-out loss left the unigram plateau and (`encoder_learned`, per seed) its encoder learned context."""
    plateau = {label: all(left_plateau(c) for c in runs) for label, runs in curves.items()}
    encoder = {label: all((encoder_learned or {}).get(label, [True])) for label in curves}
    learned = {label: plateau[label] and encoder[label] for label in curves}
    reached = [min(r["loss"] for r in c) for label, runs in curves.items() if learned[label] for c in runs]
    level = max(reached) if reached else None
    points: dict[str, list[dict] | str] = {}
    for label, runs in curves.items():
        if not plateau[label]:
            points[label] = (f"a seed never left the unigram plateau (its held-out loss never fell {PLATEAU_MARGIN} "
                             "nats below the unigram entropy)")
        elif not encoder[label]:
            points[label] = NO_CONTEXT
        else:
            points[label] = [min(c, key=lambda r: abs(r["loss"] - level)) for c in runs]
    return level, points


def ranks_of(records: list[dict]) -> Ranks:
    """The per-layer epsilon ranks of an objective's analysis records (one per seed)."""
    layers = range(len(records[0]["layers"]))
    groups = ("real_masked_input", "real_unmasked_input", "all_unmasked_input")

    def per_layer(key: str) -> dict[str, list[float]]:
        return {g: [float(np.mean([rec["layers"][i][key][g] for rec in records])) for i in layers] for g in groups}

    def last(key: str) -> dict[str, list[float]]:
        return {g: [rec["layers"][-1][key][g] for rec in records] for g in groups}

    return Ranks(per_layer("epsilon_rank"), per_layer("centred_epsilon_rank"), last("epsilon_rank"),
                 last("centred_epsilon_rank"))


def finetune_result(task: str, cells: list[list[dict]], seeds: list[int]) -> FinetuneResult:
    """An objective's scores on `task` from each of its encoders' best grid cells (`glue.best_cells`; one list per
    pretraining seed, in `seeds` order)."""
    metric = GLUE_TASKS[cells[0][0]["task"]].metrics[0]
    scores = [c["scores"][metric] for rows in cells for c in rows]
    failed = [f"pretraining seed {seed}, fine-tuning seed {c['seed']}: {c['did_not_train']}"
              for seed, rows in zip(seeds, cells) for c in rows if c.get("did_not_train")]
    return FinetuneResult(task=task, metric=metric, median=float(np.median(scores)), spread=spread(scores),
                          runs=len(scores), scores=scores, did_not_train=failed)


def summarize(objectives: list[Objective], runs: dict[str, list[Run]], finetuned: dict, analyses: dict,
              matched: dict[str, MatchedRanks] | None = None) -> dict[str, ObjectiveResult]:
    """Each objective's results over its seeds (means, per-seed values, spreads, ranks at the end of the budget and,
    with `matched`, at a common held-out loss, and `finetuned`: {label: {task: each run's best grid cells}})."""
    curves = {o.label: [eval_curve(r) for r in runs[o.label]] for o in objectives}
    mlm_final = [curve[-1] for curve in curves["mlm"]]
    out = {}
    for objective in objectives:
        per_seed = []
        for run, curve, reference in zip(runs[objective.label], curves[objective.label], mlm_final):
            final = curve[-1]
            info = run.dir / "study_run.json"  # absent when the run was trained before the study was pointed at it
            reached = flops_to_reach(curve, reference["loss"])
            per_seed.append(SeedResult(
                seed=run.seed, steps=final["step"], flops=final["flops"], final_eval_loss=final["loss"],
                final_eval_accuracy=final["accuracy"],
                percent_of_mlm_compute_to_match=None if reached is None else 100.0 * reached / reference["flops"],
                curve=[EvalPoint(*(r[k] for k in ("step", "flops", "loss", "accuracy"))) for r in curve],
                unigram_entropy=final["unigram_entropy"], unigram_accuracy=final["unigram_accuracy"],
                seconds=json.loads(info.read_text())["seconds"] if info.is_file() else None))
        losses = [s.final_eval_loss for s in per_seed]
        percents = [s.percent_of_mlm_compute_to_match for s in per_seed]
        records = analyses[objective.label]
        layers = range(len(records[0]["layers"]))
        finetune = [finetune_result(task, cells, [run.seed for run in runs[objective.label]])
                    for task, cells in finetuned.get(objective.label, {}).items()]
        probes = [judged(record["neighbour_probe"]) if "neighbour_probe" in record else {"learned_context": True}
                  for record in records]
        out[objective.label] = ObjectiveResult(
            flops=float(np.mean([s.flops for s in per_seed])),
            final_eval_loss=float(np.mean(losses)),
            final_eval_accuracy=float(np.mean([s.final_eval_accuracy for s in per_seed])),
            percent_of_mlm_compute_to_match=None if None in percents else float(np.mean(percents)),
            seeds_reaching_mlm_loss=sum(p is not None for p in percents),
            final_eval_loss_spread=spread(losses),
            steps=[s.steps for s in per_seed],
            model={"preset": objective.preset, **objective.overrides},
            per_seed=per_seed,
            effective_rank={group: [float(np.mean([rec["layers"][i]["epsilon_rank"][group] for rec in records]))
                                    for i in layers]
                            for group in ("real_masked_input", "real_unmasked_input", "all_unmasked_input")},
            centred_effective_rank={
                group: [float(np.mean([rec["layers"][i]["centred_epsilon_rank"][group] for rec in records]))
                        for i in layers]
                for group in ("real_masked_input", "real_unmasked_input")},
            effective_rank_last_layer_per_seed={group: [rec["layers"][-1]["epsilon_rank"][group] for rec in records]
                                                for group in ("real_masked_input", "real_unmasked_input")},
            ranks_at_matched_loss=(matched or {}).get(objective.label),
            finetune=finetune, neighbour_probe=probes)
    return out


def findings(summary: dict[str, ObjectiveResult], chosen_on_plateau: dict[str, bool] | None = None) -> list[str]:
    """The report's claims, each held to the seed spread. An objective whose learning rate the grid chose among runs
    that had all stayed on the unigram plateau (`chosen_on_plateau`) gets no comparison: its rate is not shown to
    suit it, and a comparison would hold it to a rate chosen blind."""
    lines = []
    mlm = summary["mlm"]
    no_context = {label: [s.seed for s, probe in zip(entry.per_seed, entry.neighbour_probe)
                          if not probe["learned_context"]] for label, entry in summary.items()}
    blind_grid = sorted(label for label, flag in (chosen_on_plateau or {}).items() if flag)
    for label in blind_grid:
        lines.append(f"`{label}`'s learning rate was chosen among grid runs that all stayed on the unigram plateau: "
                     "no rate was shown to suit it, so no claim is made about it"
                     + (" (nor about any objective against it)" if label == "mlm" else "") + ".")
    for label, entry in summary.items():
        entropy = entry.per_seed[0].unigram_entropy
        if entry.final_eval_loss >= entropy:
            lines.append(f"`{label}` ended at or above the held-out unigram entropy ({entropy:.3f} nats): it had not "
                         "learned from context within the budget, so its other numbers (ranks, fine-tuning) say "
                         "little.")
        if no_context[label]:
            seeds = ", ".join(map(str, no_context[label]))
            lines.append(f"`{label}`'s encoder (seed(s) {seeds}) showed no context: no layer's linear probe for a "
                         "token's right neighbour beat what the token alone tells (the same probe of the layer's "
                         "token-only part; in records from before it, the embeddings' probe or the bigram table) "
                         "beyond chance, the choice of the best layer counted (the neighbour probe). That is no "
                         "evidence of context, not evidence of none; no claim about its encoder is made from it.")
    for label, entry in summary.items():
        if label == "mlm" or label in blind_grid or "mlm" in blind_grid:
            continue
        lines.append(compare(f"`{label}` final held-out loss", [s.final_eval_loss for s in entry.per_seed],
                             [s.final_eval_loss for s in mlm.per_seed], "nats", "lower"))
        percents = [s.percent_of_mlm_compute_to_match for s in entry.per_seed]
        if None in percents:
            lines.append(f"`{label}` did not reach mlm's final held-out loss within the budget in "
                         f"{percents.count(None)} of {len(percents)} seed(s).")
        else:
            text = ", ".join(f"{p:.1f}%" for p in percents)
            width = spread(percents)
            claim = ""
            target = {"loss": mlm.final_eval_loss, "unigram_entropy": mlm.per_seed[0].unigram_entropy}
            if not left_plateau([target]):  # mlm's loss is a plateau's: nothing to reach
                claim = (f"; mlm's final loss is not {PLATEAU_MARGIN} nats below the unigram entropy (the plateau), "
                         "so reaching it says nothing about learning from context: no claim")
            elif width is not None and max(percents) < 100.0 and 100.0 - np.mean(percents) > width:
                claim = f": less compute than mlm, beyond the spread between seeds ({width:.1f} points)"
            elif width is not None:
                claim = f"; the seed spread ({width:.1f} points) does not separate it from 100%"
            else:
                claim = "; one seed, so this is not separated from seed noise"
            lines.append(f"`{label}` reached mlm's final held-out loss with {text} of mlm's compute{claim}.")
        ranks, reference = entry.effective_rank_last_layer_per_seed, mlm.effective_rank_last_layer_per_seed
        what = f"`{label}` last-layer epsilon rank of real tokens, input without <mask>, at the end of the budget"
        without_context = [name for name in (label, "mlm") if no_context[name]]
        if without_context:  # an encoder that learned nothing has a low rank whatever its objective
            lines.append(f"{what}: not compared, because {' and '.join(f'`{n}`' for n in without_context)}'s "
                         "encoder showed no context (the neighbour probe).")
        else:
            lines.append(compare(what, ranks["real_unmasked_input"], reference["real_unmasked_input"], "dimensions",
                                 "higher"))
        lines += _matched_findings(label, entry.ranks_at_matched_loss, mlm.ranks_at_matched_loss)
        for ft, reference in zip(entry.finetune, mlm.finetune):
            lines.append(_finetune_finding(label, ft, reference))
    return lines


def _finetune_finding(label: str, ft: FinetuneResult, mlm: FinetuneResult) -> str:
    """The fine-tuning comparison, or why none is made: a fine-tune that did not train (one class predicted, or
    its training loss at chance) scores the classifier's failure, not the encoder."""
    parts = [f"`{name}`: {len(result.did_not_train)} of its {result.runs} ({result.did_not_train[0]})"
             for name, result in ((label, ft), ("mlm", mlm)) if result.did_not_train]
    if parts:
        return (f"`{label}` fine-tuned {ft.task} {ft.metric}: no comparison is made, because fine-tunes did not "
                f"train - {'; '.join(parts)}.")
    return compare(f"`{label}` fine-tuned {ft.task} {ft.metric} (mean of every pretraining x fine-tuning seed)",
                   ft.scores, mlm.scores, "", "higher")


def _matched_findings(label: str, matched: MatchedRanks | None, reference: MatchedRanks | None) -> list[str]:
    """The rank claims at the common held-out loss: `label`'s encoders against mlm's, each held to the seed spread."""
    if matched is None or reference is None:
        return []
    for name, entry in ((label, matched), ("mlm", reference)):
        if entry.excluded:
            return [f"Ranks at matched held-out loss: `{name}` is left out ({entry.excluded}), so no rank comparison "
                    f"of `{label}` with mlm means anything about the objectives."]
    lines = []
    where = f"at held-out loss {matched.level:.3f} (steps {', '.join(map(str, matched.steps))})"
    for key, what in (("last_layer_per_seed", "epsilon rank"), ("centred_last_layer_per_seed", "centred epsilon rank")):
        ours, theirs = getattr(matched.ranks, key), getattr(reference.ranks, key)
        lines.append(compare(f"`{label}` last-layer {what} of real tokens, input without <mask>, {where}",
                             ours["real_unmasked_input"], theirs["real_unmasked_input"], "dimensions", "higher"))
    gaps = {name: [a - b for a, b in zip(entry.ranks.last_layer_per_seed["real_unmasked_input"],
                                         entry.ranks.last_layer_per_seed["real_masked_input"])]
            for name, entry in ((label, matched), ("mlm", reference))}
    lines.append(compare(f"`{label}` rank lost by real tokens when <mask> is in the input (last layer, without - "
                         f"with; MAE-LM's Figure 1 deficiency), {where}", gaps[label], gaps["mlm"], "dimensions",
                         "lower"))
    return lines
