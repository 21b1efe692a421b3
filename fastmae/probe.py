"""The neighbour probe (`fastmae analyze`'s test of whether an encoder learned context, asked of the encoder alone):
per layer, a linear probe of the states for each token's right neighbour against the same probe of the layer's
token-only part, and the verdict that pays for choosing the best layer (ARCHITECTURE.md section 10)."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np

CONTEXT_P_VALUE = 0.00135
"""One-sided false-alarm rate of the context test over all the layers it compares: 3 standard errors for one."""


def neighbour_probe(states: list[np.ndarray], tokens: np.ndarray, neighbours: np.ndarray, train: np.ndarray,
                    vocab_size: int, ridge: float = 1e-2) -> dict:
    """Whether an encoder learned context, asked of the encoder alone: does a layer's state tell more about a token's
    right neighbour than what the same layer computes from the token alone? Per layer, a ridge-regression linear
    probe from the states (rows of each of `states`, [N, H]; states[0] the embeddings) to the neighbour's one-hot id,
    fitted on the `train` rows and scored (argmax accuracy) on the others; and its control, the same probe of the
    layer's token-only part (each row replaced by the mean state of its token over the train rows: any function of
    the token alone, which a feed-forward stack computes, is kept whole, context is averaged away). The verdict
    compares each layer with its control (`context_verdict`). The bigram table (each token's most frequent neighbour
    in the train rows: the best a token alone tells) is reported beside them."""
    test = ~train
    fallback = int(np.bincount(neighbours[train], minlength=vocab_size).argmax())
    guess = bigram_table(tokens[train], neighbours[train], vocab_size, fallback)[tokens[test]]
    bigram = float((guess == neighbours[test]).mean())
    counts = np.bincount(tokens[train], minlength=vocab_size)[:, None]
    per_layer, controls = [], []
    for x in states:
        x = x.astype(np.float64)
        sums = np.zeros((vocab_size, x.shape[1]))
        np.add.at(sums, tokens[train], x[train])
        means = np.where(counts > 0, sums / np.maximum(counts, 1), x[train].mean(0))  # unseen: the overall mean
        per_layer.append(_probe_accuracy(x, neighbours, train, vocab_size, ridge))
        controls.append(_probe_accuracy(means[tokens], neighbours, train, vocab_size, ridge))
    accuracies, control = [round(a, 4) for a in per_layer], [round(a, 4) for a in controls]
    return {"probe_accuracy": accuracies, "token_only_accuracy": control, "bigram_accuracy": round(bigram, 4),
            "test_pairs": int(test.sum()), **context_verdict(accuracies, int(test.sum()), control)}


def _probe_accuracy(x: np.ndarray, neighbours: np.ndarray, train: np.ndarray, vocab_size: int, ridge: float) -> float:
    """Test accuracy of the ridge probe from rows `x` to the neighbours' ids, fitted on the `train` rows: a [V, H]
    accumulation and an [H, V] solve, nothing of [tokens, V] or [V, V] held."""
    test = ~train
    x = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    gram = x[train].T @ x[train]
    x_y = np.zeros((vocab_size, x.shape[1]))
    np.add.at(x_y, neighbours[train], x[train])  # x^T of the neighbours' one-hot targets, transposed
    weights = np.linalg.solve(gram + ridge * np.trace(gram) / len(gram) * np.eye(len(gram)), x_y.T)
    rows, wanted = x[test], neighbours[test]
    hits = sum(int(((rows[i:i + 1024] @ weights).argmax(1) == wanted[i:i + 1024]).sum())
               for i in range(0, len(rows), 1024))
    return hits / max(len(rows), 1)


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
