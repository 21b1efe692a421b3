"""The neighbour probe (`fastmae analyze`'s test of whether an encoder learned context, asked of the encoder alone):
per layer, a linear probe of the states for each token's right neighbour against the same probe of the layer's
token-only part, and the verdict that pays for choosing the best layer (ARCHITECTURE.md section 10)."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import torch

CONTEXT_P_VALUE = 0.00135
"""One-sided false-alarm rate of the context test over all the layers it compares: 3 standard errors for one."""


def neighbour_probe(states: list[np.ndarray], tokens: np.ndarray, neighbours: np.ndarray, train: np.ndarray,
                    vocab_size: int, ridge: float = 1e-2, device: torch.device | str = "cpu") -> dict:
    """Whether an encoder learned context, asked of the encoder alone: does a layer's state tell more about a token's
    right neighbour than what the same layer computes from the token alone? Per layer, a ridge-regression linear
    probe from the states (rows of each of `states`, [N, H]; states[0] the embeddings) to the neighbour's one-hot id,
    fitted on the `train` rows and scored (argmax accuracy) on the others; and its control, the same probe of the
    layer's token-only part (each row replaced by the mean state of its token over the train rows: any function of
    the token alone, which a feed-forward stack computes, is kept whole, context is averaged away). The verdict
    compares each layer with its control (`context_verdict`). The bigram table (each token's most frequent neighbour
    in the train rows: the best a token alone tells) is reported beside them. The probes run in float64 on `device`
    (scoring a 32K-piece vocabulary is 10^13 multiply-adds an encoder: minutes on a CPU, a second on a GPU)."""
    test = ~train
    fallback = int(np.bincount(neighbours[train], minlength=vocab_size).argmax())
    guess = bigram_table(tokens[train], neighbours[train], vocab_size, fallback)[tokens[test]]
    bigram = float((guess == neighbours[test]).mean())
    token_ids, neighbour_ids = torch.as_tensor(tokens, device=device), torch.as_tensor(neighbours, device=device)
    fit = torch.as_tensor(train, device=device)
    counts = torch.bincount(token_ids[fit], minlength=vocab_size)[:, None]
    per_layer, controls = [], []
    for x in states:
        x = torch.as_tensor(x).to(device, torch.float64)
        sums = x.new_zeros(vocab_size, x.shape[1]).index_add_(0, token_ids[fit], x[fit])
        means = torch.where(counts > 0, sums / counts.clamp(min=1), x[fit].mean(0))  # unseen: the overall mean
        per_layer.append(_probe_accuracy(x, neighbour_ids, fit, vocab_size, ridge))
        controls.append(_probe_accuracy(means[token_ids], neighbour_ids, fit, vocab_size, ridge))
    accuracies, control = [round(a, 4) for a in per_layer], [round(a, 4) for a in controls]
    return {"probe_accuracy": accuracies, "token_only_accuracy": control, "bigram_accuracy": round(bigram, 4),
            "test_pairs": int(test.sum()), **context_verdict(accuracies, int(test.sum()), control)}


SCORED_ROWS = 1024
"""Test rows scored at once ([1024, ids seen] float64: at most 262 MB at 32K pieces)."""


def _probe_accuracy(x: torch.Tensor, neighbours: torch.Tensor, fit: torch.Tensor, vocab_size: int,
                    ridge: float) -> float:
    """Test accuracy of the ridge probe from rows `x` to the neighbours' ids, fitted on the `fit` rows: a [V, H]
    accumulation and an [H, V] solve, nothing of [tokens, V] or [V, V] held. Only the ids some fitted row has for
    neighbour are scored: every other id's weights solve to exactly zero, its score 0, and a row's scores sum to the
    ridge fit of the constant 1 (the column of ones), so an id seen scores above them: the argmax over the whole
    vocabulary, at the cost of the ids seen (a few thousand of 32K pieces)."""
    x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)
    fitted = x[fit]
    gram = fitted.T @ fitted
    seen = torch.unique(neighbours[fit])  # sorted
    x_y = x.new_zeros(len(seen), x.shape[1]).index_add_(0, torch.searchsorted(seen, neighbours[fit]), fitted)
    ridged = gram + ridge * gram.trace() / len(gram) * torch.eye(len(gram), dtype=x.dtype, device=x.device)
    weights = torch.linalg.solve(ridged, x_y.T)  # [H + 1, ids seen]
    rows, wanted = x[~fit], neighbours[~fit]
    hits = sum((seen[(rows[i:i + SCORED_ROWS] @ weights).argmax(1)] == wanted[i:i + SCORED_ROWS]).sum()
               for i in range(0, len(rows), SCORED_ROWS))
    return int(hits) / max(len(rows), 1)


def context_verdict(accuracies: list[float], test_pairs: int, control: list[float] | None = None,
                    bigram: float | None = None) -> dict:
    """Did some layer learn context? Each layer l >= 1's probe accuracy against its control, scored on the same
    `test_pairs` pairs: the same layer's token-only part (`control`, per layer), or, for records from before it was
    measured, the best a token alone is known to tell: the embeddings' probe (layer 0) or the bigram table, whichever
    is higher (a layer must beat the bigram table to show context there: sufficient, not necessary). The gain over
    the standard error of a difference of two proportions (treated as independent, which overstates the error of two
    probes scored on the same pairs: the test errs towards 'no'). Choosing the best of L layers is paid for
    (Bonferroni): a layer counts when its z exceeds the one-sided threshold at CONTEXT_P_VALUE / L. `learned_context`
    false means no evidence of context, not evidence of none."""
    layers = accuracies[1:]
    if not layers or test_pairs <= 0:
        return {"best_layer": 0, "context_gain": 0.0, "context_z": 0.0, "z_threshold": None, "learned_context": False,
                "control": "none"}
    if control is not None:
        against, what = control[1:], "token-only"
    else:
        floor = max(accuracies[0], bigram if bigram is not None else 0.0)
        against = [floor] * len(layers)
        what = "bigram" if bigram is not None and bigram > accuracies[0] else "layer 0"
    z = [(a - c) / max(np.sqrt((c * (1 - c) + a * (1 - a)) / test_pairs), 1e-12) for a, c in zip(layers, against)]
    best = int(np.argmax(z))
    threshold = NormalDist().inv_cdf(1 - CONTEXT_P_VALUE / len(layers))
    return {"best_layer": best + 1, "context_gain": round(layers[best] - against[best], 4),
            "context_z": round(float(z[best]), 2), "z_threshold": round(threshold, 2),
            "learned_context": bool(z[best] > threshold), "control": what,
            "control_accuracy": round(against[best], 4)}


def judged(probe: dict) -> dict:
    """A neighbour-probe record (this version's or an older one's) with the verdict `context_verdict` gives now:
    against its token-only control where the record has one, else against the embeddings or the bigram table."""
    kept = {key: value for key, value in probe.items() if key != "standard_error"}  # the old test's, of the bigram
    return {**kept, **context_verdict(probe["probe_accuracy"], probe["test_pairs"],
                                      probe.get("token_only_accuracy"), probe.get("bigram_accuracy"))}


def bigram_table(tokens: np.ndarray, neighbours: np.ndarray, vocab_size: int, fallback: int) -> np.ndarray:
    """[vocab_size]: each token's most frequent right neighbour among the pairs (the smallest id among ties),
    `fallback` for a token never seen; counted over the distinct pairs only, never a [V, V] table."""
    pairs, counts = np.unique(tokens.astype(np.int64) * vocab_size + neighbours, return_counts=True)
    token, neighbour = np.divmod(pairs, vocab_size)
    order = np.lexsort((neighbour, -counts, token))  # by token, then the highest count, then the smallest id
    first = order[np.r_[True, token[order][1:] != token[order][:-1]]]
    table = np.full(vocab_size, fallback, dtype=np.int64)
    table[token[first]] = neighbour[first]
    return table
