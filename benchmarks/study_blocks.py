"""The results blocks of `fastmae study`'s committed studies (benchmarks/readme_table.py renders them): each study's
table and findings, the presets' costs, mae-lm's and 3ml's diagnoses, and the scale trend over every study."""

from __future__ import annotations

import re
from pathlib import Path

from common import RESULTS_DIR, read_json

from fastmae.probe import judged


def study() -> str:
    """The cpu-30min study's results table and the facts the README draws from it."""
    return _study("study_cpu_30min")


def study_base_depth() -> str:
    """The cpu-1h study's (base's depth) results table and the facts the README draws from it."""
    return _study("study_cpu_1h")


def study_mask_more_or_later() -> str:
    """The masking study's (issue 49: mlm at 15 / 30 / 50%, 30% -> 15%, 3ml at 50% and 50% -> 30%, all under WSD)
    results table and its setting; the README's prose draws on its findings, which stay in its report."""
    return _study("study_mask_more_or_later", findings=False)


def continued() -> str:
    """Continued pretraining from one mlm encoder with each objective (benchmarks/continued.py)."""
    return _study("continued_cpu")


def _study(directory: str, findings: bool = True) -> str:
    """A committed study's table, its setting and (with `findings`) the ranks at matched loss and every finding; else
    where the report holds them."""
    result = read_json(RESULTS_DIR / directory / "study.json")
    setup, objectives = result["setup"], result["objectives"]
    rows = ["| objective | steps | held-out loss (mean ± half range) | accuracy | % of mlm's compute to reach mlm's "
            "final loss | word-order accuracy (median) | encoder's neighbour probe: best layer vs what the token alone "
            "tells, per seed | "
            "last-layer "
            "epsilon rank, no `<mask>`: uncentred / centred |",
            "|---|---|---|---|---|---|---|---|"]
    for label, entry in objectives.items():
        spread = entry["final_eval_loss_spread"]
        loss = f"{entry['final_eval_loss']:.3f}" + (f" ± {spread / 2:.3f}" if spread is not None else "")
        percent = entry["percent_of_mlm_compute_to_match"]
        ranks = entry["effective_rank"]["real_unmasked_input"][-1]
        centred = entry["centred_effective_rank"]["real_unmasked_input"][-1]
        rows.append(f"| `{label}` | {', '.join(f'{s:,}' for s in entry['steps'])} | {loss} | "
                    f"{entry['final_eval_accuracy']:.3f} | "
                    f"{'not reached' if percent is None else f'{percent:.1f}%'} | "
                    f"{_finetuned(entry.get('finetune'))} | {_probes(entry.get('neighbour_probe'))} | "
                    f"{ranks:.1f} / {centred:.1f} |")
    first = next(iter(objectives.values()))["per_seed"][0]
    setting = ("\n".join(rows) + "\n\n"
               f"{setup['seeds']} seeds per objective, {setup['budget']:.3g} training FLOPs per run, width "
               f"{setup['hidden_size']}, {setup['encoder_layers']} encoder layers; held-out unigram baselines (on the "
               f"predicted tokens) {first['unigram_entropy']:.3f} nats / accuracy {first['unigram_accuracy']:.3f}; "
               f"device: {setup['device']}." + _lr_grid(result.get("lr_grid")))
    if not findings:
        return (setting + f" Artifact: `benchmarks/results/{directory}/`: `report.md` holds the ranks at matched loss "
                "and every finding, each held to the seed spread (`study.json`, `loss_vs_flops.png`, `ranks.png`).\n")
    return (setting + _matched(objectives)
            + " What the report concludes, each claim held to the seed spread:\n\n"
            + "\n".join(f"- {line}" for line in result["findings"]) + "\n\n"
            f"Artifact: `benchmarks/results/{directory}/` (`report.md`, `study.json`, `loss_vs_flops.png`, "
            "`ranks.png`).\n")


def _finetuned(finetune) -> str:
    """An objective's fine-tuned median (studies before several tasks held one dict), and how many fine-tunes did not
    train (studies that counted them)."""
    results = [finetune] if isinstance(finetune, dict) else finetune or []
    return "; ".join(f"{ft['median']:.3f}" + (f" ({len(ft['did_not_train'])} of {ft['runs']} did not train)"
                                              if ft.get("did_not_train") else "") for ft in results) or "-"


def _probes(probes: list[dict] | None) -> str:
    """Each seed's neighbour probe: its best layer's accuracy against its control (the layer's token-only part, or in
    older records the embeddings' probe or the bigram table, whichever is higher), the gain's z against the threshold
    for the best of the layers, and the verdict (`fastmae.probe.context_verdict`, applied to every record however
    old)."""
    if not probes:
        return "-"
    judged_probes = [judged(p) for p in probes]
    return ", ".join(f"{p['probe_accuracy'][p['best_layer']]:.3f} vs {p['control_accuracy']:.3f} {p['control']} "
                     f"(z {p['context_z']:.1f} of {p['z_threshold']:.1f}: "
                     f"{'context' if p['learned_context'] else 'none shown'})" for p in judged_probes)


def _lr_grid(grid: dict | None) -> str:
    """The learning rate each objective trained at and the grid's held-out losses (--lr-grid), as a sentence."""
    if not grid:
        return ""
    first = next(iter(grid.values()))
    choices = [f"`{label}` {g['chosen']:g} (" + ", ".join(f"{lr}: {loss:.3f}" for lr, loss in g["losses"].items())
               + ")" for label, g in grid.items()]
    return (f" Learning rates, each chosen by held-out loss after {first['fraction']:g} of the budget (seed 0): "
            + "; ".join(choices) + ".")


def _matched(objectives: dict) -> str:
    """Last-layer ranks of each objective at the common held-out loss, as a sentence (absent before they existed)."""
    entries = {label: e.get("ranks_at_matched_loss") for label, e in objectives.items()}
    if not any(entries.values()):
        return ""
    level = next(e for e in entries.values() if e)["level"]
    parts = []
    for label, matched in entries.items():
        if matched is None or matched["excluded"]:
            parts.append(f"`{label}` left out ({matched['excluded'] if matched else 'not measured'})")
            continue
        last = {key: matched["ranks"][key]["real_unmasked_input"][-1] for key in ("epsilon_rank",
                                                                                  "centred_epsilon_rank")}
        with_mask = matched["ranks"]["epsilon_rank"]["real_masked_input"][-1]
        where = ", ".join(f"{step} ({loss - level:+.3f} nats from the level)"
                          for step, loss in zip(matched["steps"], matched["losses"]))
        parts.append(f"`{label}` {last['epsilon_rank']:.1f} / {last['centred_epsilon_rank']:.1f} (with `<mask>` "
                     f"{with_mask:.1f}; steps {where})")
    where = "no common level" if level is None else f"held-out loss {level:.3f}"
    return (f" Last-layer epsilon rank of real tokens without `<mask>` at matched {where}, uncentred / centred: "
            + "; ".join(parts) + ".")


def study_presets() -> str:
    """What each CPU study preset costs per step by objective, from the committed studies' own counts, beside the
    base recipes' (budget.json): the depth that decides whether a preset can show what the papers claim at base."""
    rows = ["| preset | encoder (layers x width) | FLOPs per run | a 3ml step / an mlm step | a mae-lm step / an mlm "
            "step | artifact |", "|---|---|---|---|---|---|"]
    for directory in ("study_cpu_30min", "study_cpu_1h"):
        result = read_json(RESULTS_DIR / directory / "study.json")
        models = result["models"]
        rows.append(f"| `{result['setup']['preset']}` | {models['mlm']['encoder_layers']} x "
                    f"{models['mlm']['hidden_size']} | {result['setup']['budget']:.2g} | "
                    f"{models['3ml']['flops_per_step_vs_mlm']:.2f} | {models['mae-lm']['flops_per_step_vs_mlm']:.2f} "
                    f"| `benchmarks/results/{directory}/` |")
    base = {r["objective"].split(" ")[0]: r for r in read_json(RESULTS_DIR / "budget.json")["results"]
            if r["size"] == "base" and "cross" not in r["objective"]}
    rows.append(f"| RoBERTa-base's recipes | 12 x 768 | - | {base['3ml']['x_roberta']:.2f} | "
                f"{base['mae-lm']['x_roberta']:.2f} | `benchmarks/results/budget.json` |")
    return "\n".join(rows) + "\n"


def plateau_table(directory: str) -> str:
    """A diagnosis study's runs (one seed each): where each ended and when it left the unigram plateau."""
    result = read_json(RESULTS_DIR / directory / "study.json")
    rows = ["| run | final held-out loss | first evaluation 0.1 nats below the unigram entropy |", "|---|---|---|"]
    for label, entry in result["objectives"].items():
        seed = entry["per_seed"][0]
        left = next((p["step"] for p in seed["curve"] if p["loss"] < seed["unigram_entropy"] - 0.1), None)
        rows.append(f"| `{label}` | {entry['final_eval_loss']:.3f} | "
                    + (f"step {left:,} of {seed['steps']:,}" if left else f"never ({seed['steps']:,} steps)") + " |")
    entropy = next(iter(result["objectives"].values()))["per_seed"][0]["unigram_entropy"]
    return ("\n".join(rows) + f"\n\nHeld-out unigram entropy {entropy:.3f} nats; {result['setup']['budget']:.2g} "
            f"training FLOPs per run, one seed each. Artifact: `benchmarks/results/{directory}/`.\n")


def studies() -> list[Path]:
    """Every committed study's directory: the CPU studies, then each GPU's (`scripts/gpu_check.sh study`)."""
    return [*sorted(p.parent for p in RESULTS_DIR.glob("study_*/study.json")),
            *sorted(p.parent for p in (RESULTS_DIR / "gpu").glob("*/study/study.json"))]


MLM_30 = "mlm:mask_rate=0.3"


def _shape(setup: dict) -> tuple[int, int]:
    """(sequence length, tokens per optimizer step) of a study (studies before they were kept: from its settings)."""
    if "tokens_per_step" in setup:
        return setup["max_seq_len"], setup["tokens_per_step"]
    length = re.search(r"max_seq_len (\d+)", setup["shared"])
    micro, accumulated = re.search(r"(\d+) tokens per micro-batch x (\d+)", setup["shared"]).groups()
    return int(length.group(1)), int(micro) * int(accumulated)


def _corpus(setup: dict) -> str:
    corpus = setup.get("corpus")
    if corpus is None:  # studies before the corpus was kept name their dataset directory
        return f"`{setup['data']}`" + (" (the embedded corpus)" if "builtin" in setup["data"] else "")
    return (f"{', '.join(corpus['inputs'])}: {corpus['tokens']['train'] / 1e6:.1f}M tokens, "
            f"{corpus['vocab_size']:,} pieces")


def _gap(objectives: dict, label: str, reference: str) -> str:
    """`label`'s final held-out loss minus `reference`'s, ± the sum of their half ranges between seeds."""
    if label not in objectives or reference not in objectives:
        return "no such arm"
    a, b = objectives[label], objectives[reference]
    gap = a["final_eval_loss"] - b["final_eval_loss"]
    if a["final_eval_loss_spread"] is None or b["final_eval_loss_spread"] is None:
        return f"{gap:+.3f} (one seed)"
    return f"{gap:+.3f} ± {(a['final_eval_loss_spread'] + b['final_eval_loss_spread']) / 2:.3f}"


def _finetune_gaps(objectives: dict, label: str, reference: str) -> str:
    """Per task, `label`'s fine-tuned median minus `reference`'s, ± the sum of their half ranges; both medians and how
    many did not train where either arm had fine-tunes that did not (no difference is read from them)."""
    if label not in objectives or reference not in objectives:
        return "no such arm"
    references = {ft["task"]: ft for ft in objectives[reference].get("finetune", [])}
    parts = []
    for ft in objectives[label].get("finetune", []):
        other = references.get(ft["task"])
        if other is None:
            continue
        failed = [f"{name} {len(f['did_not_train'])} of {f['runs']}" for name, f in ((label, ft), (reference, other))
                  if f.get("did_not_train")]
        if failed:  # no difference is read from a fine-tune that did not train
            parts.append(f"{ft['task']} {ft['median']:.3f} vs {other['median']:.3f} (did not train: "
                         f"{', '.join(failed)})")
            continue
        gap = ft["median"] - other["median"]
        spread = ("" if ft["spread"] is None or other["spread"] is None
                  else f" ± {(ft['spread'] + other['spread']) / 2:.3f}")
        parts.append(f"{ft['task']} {gap:+.3f}{spread}")
    return "; ".join(parts) or "-"


def study_scale() -> str:
    """Every committed study, smallest budget first: its FLOPs per run, shape, tokens seen, corpus and seeds, and 3ml
    against mlm at 30% (and at 15%) in held-out loss and fine-tuned score: the trend with scale (issue 56)."""
    rows = ["| study | FLOPs per run | encoder (layers x width), sequence | tokens seen per run: mlm / 3ml | corpus | "
            "seeds | 3ml - mlm-30%: held-out loss | 3ml - mlm-30%: fine-tuned | 3ml - mlm-15%: held-out loss | "
            "device |", "|---|---|---|---|---|---|---|---|---|---|"]
    for directory in sorted(studies(), key=lambda d: read_json(d / "study.json")["setup"]["budget"]):
        result = read_json(directory / "study.json")
        setup, objectives, models = result["setup"], result["objectives"], result["models"]
        length, per_step = _shape(setup)
        seen = " / ".join(f"{sum(objectives[label]['steps']) / len(objectives[label]['steps']) * per_step / 1e6:.1f}M"
                          if label in objectives else "-" for label in ("mlm", "3ml"))
        rows.append(f"| `{directory.relative_to(RESULTS_DIR.parent.parent)}/` | {setup['budget']:.2g} | "
                    f"{models['mlm']['encoder_layers']} x {models['mlm']['hidden_size']}, {length} | {seen} | "
                    f"{_corpus(setup)} | {setup['seeds']} | {_gap(objectives, '3ml', MLM_30)} | "
                    f"{_finetune_gaps(objectives, '3ml', MLM_30)} | {_gap(objectives, '3ml', 'mlm')} | "
                    f"{setup['device'].split(',')[0]} |")
    return ("\n".join(rows) + "\n\nA gap is the first arm's mean (fine-tuned: median) less the second's, ± the sum of "
            "their half ranges between pretraining seeds: positive means 3ml is worse in loss, better in a "
            "fine-tuned score. A study of one seed has no spread, and its gap is one seed's. Each row's losses come "
            "from its own held-out protocol (15% of the tokens hidden the same way for every arm) on its own corpus "
            "and vocabulary: a gap is exact within its row, and rows set side by side show a direction, not a "
            "calibrated trend.\n")


def study_scale_summary() -> str:
    """README's line per study: the loss gap between 3ml and mlm at 30% (or 15%) at its scale."""
    lines = []
    for directory in sorted(studies(), key=lambda d: read_json(d / "study.json")["setup"]["budget"]):
        result = read_json(directory / "study.json")
        objectives, models = result["objectives"], result["models"]
        reference = MLM_30 if MLM_30 in objectives else "mlm"
        lines.append(f"- {result['setup']['budget']:.2g} FLOPs a run, {models['mlm']['encoder_layers']} x "
                     f"{models['mlm']['hidden_size']}, {result['setup']['seeds']} seed(s): 3ml's held-out loss "
                     f"{_gap(objectives, '3ml', reference)} nats against `{reference}` "
                     f"(`{directory.relative_to(RESULTS_DIR.parent.parent)}/`)")
    return "\n".join(lines) + "\n"


GENERATORS = {"study": study, "study_base_depth": study_base_depth, "continued": continued,
              "study_mask_more_or_later": study_mask_more_or_later, "study_presets": study_presets,
              "mae_lm_diagnosis": lambda: plateau_table("mae_lm_diagnosis"),
              "diagnosis_3ml_positions": lambda: plateau_table("diagnosis_3ml_positions"), "study_scale": study_scale,
              "study_scale_summary": study_scale_summary}


def mask_more_or_later_findings() -> str:
    """README's reading of the masking study (its study.json): what masking more bought mlm, and 3ml at the same 50%
    against mlm at 50%, each figure the study's own."""
    result = read_json(RESULTS_DIR / "study_mask_more_or_later" / "study.json")
    arms, models = result["objectives"], result["models"]
    mlm, more = arms["mlm"], [arms["mlm:mask_rate=0.3"], arms["mlm:mask_rate=0.5"]]
    ml3, mlm50, ramp = arms["3ml"], arms["mlm:mask_rate=0.5"], arms["mlm:mask_rate=0.3:mask_rate_end=0.15"]
    percents = sorted(arm["percent_of_mlm_compute_to_match"] for arm in more)
    lower = min(mlm["final_eval_loss"] - arm["final_eval_loss"] for arm in more)
    tuned = [arm["finetune"][0]["median"] for arm in more]

    def loss(arm: dict) -> str:
        return f"{arm['final_eval_loss']:.3f} ± {arm['final_eval_loss_spread'] / 2:.3f}"

    failed = len(ml3["finetune"][0]["did_not_train"])
    return (f"mlm at 30% or 50% reaches mlm-15%'s final held-out loss with {percents[0]:.0f}-{percents[-1]:.0f}% "
            f"of its compute, ends at least {lower:.2f} nats lower and fine-tunes to {min(tuned):.2f}-"
            f"{max(tuned):.2f} against {mlm['finetune'][0]['median']:.2f} word-order accuracy. 3ml at the same 50% "
            f"ends {ml3['final_eval_loss'] - mlm50['final_eval_loss']:.2f} nats above mlm at 50% ({loss(ml3)} "
            f"against {loss(mlm50)}) although its cheaper steps ({models['3ml']['flops_per_step_vs_mlm']:.2f}x "
            f"mlm's) bought it {100 * (ml3['steps'][0] / mlm50['steps'][0] - 1):.0f}% more of them, and {failed} of "
            f"its {ml3['finetune'][0]['runs']} fine-tunes did not train (chance is 0.5). The 30% -> 15% schedule ends "
            f"at {loss(ramp)}. Each difference is held to the seed spread in the study's report "
            "(`benchmarks/results/study_mask_more_or_later/report.md`).\n")


GENERATORS["mask_more_or_later_findings"] = mask_more_or_later_findings
