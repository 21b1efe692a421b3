"""`fastmae analyze`: the effective rank of token representations per layer, with and without `<mask>` inputs, and the
neighbour probe (did the encoder learn context?).

    fastmae analyze --model RUN_OR_EXPORT --data TEXT_FILE_OR_DATASET_DIR --out DIR [--sequences 64]

MAE-LM's argument (Meng et al., ICLR 2024, Figures 1 and 5): when [MASK] tokens enter the encoder, some model
dimensions are spent on them, so the real tokens' representations span fewer dimensions than they could, and
fine-tuning (which never shows [MASK]) inherits the deficiency. This measures it on held-out text. The same
sequences run through the encoder twice: (a) with a share of their tokens replaced by `<mask>` (positions chosen as
held-out evaluation chooses them), (b) as they are. Per layer (0 = embeddings), for the rows of

    real_masked_input    real tokens of (a) (not `<mask>`, not `<s>`/`</s>`)
    mask                 the `<mask>` rows of (a)
    real_unmasked_input  the same real tokens in (b)
    all_unmasked_input   every token of (b) but `<s>`/`</s>` (what fine-tuning sees)

it reports two effective ranks of the (uncentred) row matrix X with singular values s_1 >= s_2 >= ...:
    epsilon rank   min k such that sum_{i<=k} s_i^2 >= (1 - epsilon) sum_i s_i^2      (MAE-LM's definition)
    entropy rank   exp(-sum_i p_i log p_i) with p_i = s_i / sum_j s_j                (Roy & Vetterli, 2007)
and both again for the centred rows X - mean(X) (`centred_epsilon_rank`, `centred_entropy_rank`): a pre-LN residual
stream shares one large mean direction, which alone can hold most of the uncentred energy. A pre-LN model's rows are
first standardised as a post-LN layer's output is (LayerNorm without affine; `normalised` in the record), so both
kinds of model are measured on what a layer hands on;
and, for (a), the dimensions whose variance (about the mean of all rows) comes mostly from `<mask>` rows:
share_j = mask rows' sum of squared deviations / all rows' in dimension j; a dimension is mask-dominated when
share_j >= --dominance (the share `<mask>` rows would have by their count alone is reported as `share_by_count`).
Accumulates X^T X per group in float64, so any number of sequences fits in memory.

and whether the encoder learned context at all, asked of the encoder alone (a held-out loss below the unigram
entropy can come from a decoder): a linear probe of each layer's states for the token's right neighbour, each layer
against the same probe of its own token-only part (each state replaced by its token's mean state: whatever the layer
computes from the token alone, no context), a test that counts the layers it chose the best among
(`fastmae.probe`: `neighbour_probe`, `context_verdict`).

    DIR/analysis.json   per layer: ranks, row counts, mask-dominated dimensions; the neighbour probe; the
                        definitions; the inputs
    DIR/ranks.png       effective ranks per layer (Figure 5 style)
    DIR/mask_dims.png   mask-dominated dimensions per layer and the last layer's shares (Figure 1 style)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .atomic import atomic_write_text
from .batch import PackedBatch
from .config import add_arguments, from_arguments, option
from .data.loader import PackedLoader
from .data.order import cut_by_budget
from .data.shards import ShardSet
from .errors import FastmaeError, run_command
from .evaluation import held_out_mask
from .plot import pyplot, save_figure
from .pretrained import MODEL_HELP, Pretrained, load_pretrained
from .probe import neighbour_probe

GROUPS = ("real_masked_input", "mask", "real_unmasked_input", "all_unmasked_input")


@dataclass
class AnalyzeConfig:
    """What to measure: how many sequences, the `<mask>` share and its seed, epsilon, the dominance threshold."""

    sequences: int = option(64, "sequences of --data to run")
    mask_rate: float = option(0.15, "share of maskable tokens replaced by <mask>")
    seed: int = option(0, "seed of the <mask> positions")
    epsilon: float = option(0.1, "epsilon of the epsilon rank")
    dominance: float = option(0.5, "a dimension is mask-dominated from this share of its variance on")
    tokens_per_batch: int = option(8192, "tokens per forward pass")


def effective_ranks(gram: np.ndarray, epsilon: float) -> tuple[int, float]:
    """(epsilon rank, entropy rank) of a row matrix X from its Gram matrix X^T X (see the module doc)."""
    squared = np.clip(np.linalg.eigvalsh(gram)[::-1], 0.0, None)  # s_i^2, largest first
    if squared.sum() <= 0:
        return 0, 0.0
    explained = np.cumsum(squared) / squared.sum()
    epsilon_rank = int(np.searchsorted(explained, 1.0 - epsilon - 1e-12) + 1)
    singular = np.sqrt(squared)
    p = singular[singular > 0] / singular.sum()
    return min(epsilon_rank, len(squared)), float(np.exp(-(p * np.log(p)).sum()))


class LayerStatistics:
    """Per layer and group: the row count, X^T X and the column sums (for centring); per layer for input (a):
    per-dimension squares of the real and `<mask>` rows (for the mask shares)."""

    def __init__(self, layers: int, hidden: int):
        self.rows = np.zeros((layers, len(GROUPS)), dtype=np.int64)
        self.gram = np.zeros((layers, len(GROUPS), hidden, hidden))
        self.sums = np.zeros((layers, len(GROUPS), hidden))
        self.squares = np.zeros((layers, 2, hidden))  # [real, mask] of input (a)

    def add(self, layer: int, group: int, x: torch.Tensor) -> None:
        x = x.double()
        self.rows[layer, group] += x.shape[0]
        self.gram[layer, group] += (x.T @ x).cpu().numpy()
        self.sums[layer, group] += x.sum(0).cpu().numpy()
        if group < 2:
            self.squares[layer, group] += (x * x).sum(0).cpu().numpy()

    def centred_gram(self, layer: int, group: int) -> np.ndarray:
        """(X - mean)^T (X - mean) = X^T X - s s^T / n, with s the column sums of the group's n rows."""
        n, total = max(1, self.rows[layer, group]), self.sums[layer, group]
        return self.gram[layer, group] - np.outer(total, total) / n

    def mask_shares(self, layer: int) -> np.ndarray:
        """[H] share of each dimension's squared deviation (about the mean of real and mask rows) from mask rows."""
        n = self.rows[layer, :2].astype(np.float64)[:, None]
        sums = self.sums[layer, :2]
        mean = sums.sum(0) / n.sum()
        deviation = self.squares[layer] - 2 * mean * sums + n * mean**2  # [2, H]
        total = deviation.sum(0)
        return np.divide(deviation[1], total, out=np.zeros_like(total), where=total > 0)


def read_sequences(path: Path, pretrained: Pretrained, count: int) -> list[np.ndarray]:
    """The first `count` sequences (with `<s>` ... `</s>`, at most max_seq_len) of a prepared dataset directory
    (its valid split, else train; it must share the model's tokenizer) or a UTF-8 text file (one document a line)."""
    max_len = pretrained.config.max_seq_len
    if path.is_dir():
        split = "valid" if (path / "valid").is_dir() and ShardSet(path, "valid").num_tokens else "train"
        data = PackedLoader(path, split, max_seq_len=max_len, packing="doc", tokens_per_batch=max_len)
        data.data.check_tokenizer(pretrained.tokenizer.sha256, str(pretrained.tokenizer.source))
        ids = np.arange(min(count, data.num_sequences))
        tokens, lengths = data.tokens_of(ids)
        return np.split(tokens, np.cumsum(lengths)[:-1])
    if not path.is_file():
        raise FastmaeError(f"--data {path}: no such file or directory")
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:count]
    except UnicodeDecodeError as err:
        raise FastmaeError(f"--data {path}: not UTF-8 ({err.reason} at byte {err.start})") from None
    if not lines:
        raise FastmaeError(f"--data {path}: no text")
    tokenizer = pretrained.tokenizer
    return [np.asarray(tokenizer.frame(ids[:max_len - 2])) for ids in tokenizer.encode(lines)]


PROBE_TOKENS = 32768
"""At most this many (token, right neighbour) pairs feed the neighbour probe."""


@torch.no_grad()
def analyze(pretrained: Pretrained, sequences: list[np.ndarray], config: AnalyzeConfig,
            device: torch.device) -> dict:
    """Run the sequences with and without `<mask>` inputs and return the per-layer record (module doc), with the
    neighbour probe of the states without `<mask>` (`neighbour_probe`)."""
    model = pretrained.encoder().to(device).eval()
    normalise = pretrained.config.norm_position == "pre"
    layers, hidden = pretrained.config.encoder_layers + 1, pretrained.config.hidden_size
    specials = pretrained.config.special_tokens
    stats = LayerStatistics(layers, hidden)
    lengths = np.array([len(s) for s in sequences])
    plan = cut_by_budget(lengths, max(config.tokens_per_batch, int(lengths.max())))
    probe_states, probe_pairs = [[] for _ in range(layers)], []
    for part in tqdm(plan, desc="analyze", unit="batch", dynamic_ncols=True):
        ids = np.arange(len(sequences))[part]
        batch = PackedBatch.from_packed(np.concatenate([sequences[i] for i in ids]), lengths[ids], special=specials)
        masked = held_out_mask(batch.tokens.long(), batch.seqlens, torch.from_numpy(ids).long(), config.mask_rate,
                               config.seed, specials)
        special = (batch.tokens == specials.bos) | (batch.tokens == specials.eos)
        real = (~masked & ~special).nonzero()[:, 0].to(device)
        mask_rows, unmasked_rows = masked.nonzero()[:, 0].to(device), (~special).nonzero()[:, 0].to(device)
        masked_batch = PackedBatch.from_packed(np.where(masked.numpy(), specials.mask, batch.tokens.numpy()),
                                               lengths[ids], special=specials).to(device)
        with_mask = normalised(model.encode(masked_batch, all_layers=True), normalise)
        without_mask = normalised(model.encode(batch.to(device), all_layers=True), normalise)
        for layer, (a, b) in enumerate(zip(with_mask, without_mask)):
            for group, x in enumerate((a[real], a[mask_rows], b[real], b[unmasked_rows])):
                stats.add(layer, group, x)
        # (token, right neighbour) pairs of real tokens, the sequence's index telling the probe's halves apart
        tokens = batch.tokens.long()
        pair = (~special[:-1] & ~special[1:]).nonzero()[:, 0]
        if sum(len(p) for p in probe_pairs) < PROBE_TOKENS and len(pair):
            sequence = torch.repeat_interleave(torch.from_numpy(ids), batch.seqlens.long())[pair]
            probe_pairs.append(np.stack([tokens[pair].numpy(), tokens[pair + 1].numpy(), sequence.numpy()], 1))
            for layer, b in enumerate(without_mask):
                probe_states[layer].append(b[pair.to(device)].float().cpu().numpy())
    pairs = np.concatenate(probe_pairs)
    probe = neighbour_probe([np.concatenate(s) for s in probe_states], pairs[:, 0], pairs[:, 1], pairs[:, 2] % 2 == 0,
                            pretrained.config.vocab_size, device=device)
    return {**_record(stats, config, hidden), "normalised": normalise, "neighbour_probe": probe}


def normalised(states: list[torch.Tensor], normalise: bool) -> list[torch.Tensor]:
    """`states` as a post-LN layer outputs them: each row standardised (LayerNorm without its affine), when
    `normalise` (a pre-LN model, whose layers output the raw residual stream); else as they are."""
    return [F.layer_norm(x.float(), x.shape[-1:]) for x in states] if normalise else states


def _record(stats: LayerStatistics, config: AnalyzeConfig, hidden: int) -> dict:
    per_layer = []
    for layer in range(stats.rows.shape[0]):
        ranks = {GROUPS[g]: effective_ranks(stats.gram[layer, g], config.epsilon) for g in range(len(GROUPS))}
        centred = {GROUPS[g]: effective_ranks(stats.centred_gram(layer, g), config.epsilon)
                   for g in range(len(GROUPS))}
        shares = stats.mask_shares(layer)
        order = np.argsort(-shares)
        dominated = [int(j) for j in order if shares[j] >= config.dominance]
        per_layer.append({
            "layer": layer,
            "epsilon_rank": {g: r[0] for g, r in ranks.items()},
            "entropy_rank": {g: round(r[1], 3) for g, r in ranks.items()},
            "centred_epsilon_rank": {g: r[0] for g, r in centred.items()},
            "centred_entropy_rank": {g: round(r[1], 3) for g, r in centred.items()},
            "rows": {g: int(stats.rows[layer, i]) for i, g in enumerate(GROUPS)},
            "mask_dominated_dims": dominated,
            "top_mask_shares": [[int(j), round(float(shares[j]), 4)] for j in order[:10]],
            "mask_shares": [round(float(v), 4) for v in shares],
        })
    rows = stats.rows[0]
    return {
        "hidden_size": hidden, "layers": per_layer,
        "share_by_count": float(rows[1] / max(1, rows[0] + rows[1])),
        "definitions": {
            "epsilon_rank": f"min k with sum_(i<=k) s_i^2 >= (1 - {config.epsilon}) sum_i s_i^2 (MAE-LM)",
            "entropy_rank": "exp(entropy of s_i / sum_j s_j) (Roy & Vetterli 2007)",
            "rows": "rows of each group (uncentred for epsilon_rank / entropy_rank, minus the group's mean for the "
                    "centred_ ranks); <s> and </s> excluded; layer 0 is the embeddings' output",
            "normalised": "for a pre-LN model every row is first standardised (LayerNorm without affine), as a "
                          "post-LN layer outputs it: its layers output the raw residual stream",
            "mask_share": "share of a dimension's squared deviation about the mean of input (a)'s rows that comes "
                          f"from <mask> rows; mask-dominated when >= {config.dominance}",
        },
    }


def plot(record: dict, out: Path) -> list[Path]:
    """ranks.png and mask_dims.png of an analysis record."""
    plt = pyplot()
    layers = [entry["layer"] for entry in record["layers"]]
    labels = {"real_masked_input": "real tokens, input with <mask>", "mask": "<mask> tokens",
              "real_unmasked_input": "real tokens, input without <mask>",
              "all_unmasked_input": "all tokens, input without <mask>"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "epsilon_rank", "epsilon rank"), (axes[1], "entropy_rank", "entropy rank")):
        for group in GROUPS:
            ax.plot(layers, [entry[key][group] for entry in record["layers"]], "o-", label=labels[group])
        ax.axhline(record["hidden_size"], color="gray", linestyle="--", label="hidden size")
        ax.set(xlabel="layer (0 = embeddings)", ylabel=title, title=f"{title}: {record['model']}")
    axes[0].legend(fontsize=8)
    ranks_png = save_figure(fig, out / "ranks.png")

    fig, (ax_count, ax_share) = plt.subplots(1, 2, figsize=(11, 4))
    ax_count.bar(layers, [len(entry["mask_dominated_dims"]) for entry in record["layers"]])
    ax_count.set(xlabel="layer (0 = embeddings)", ylabel="dimensions", xticks=layers,
                 ylim=(0, max(1, *(len(entry["mask_dominated_dims"]) for entry in record["layers"])) * 1.1),
                 title=f"dimensions whose variance is >= {record['dominance']:.0%} from <mask> rows")
    last = np.sort(np.asarray(record["layers"][-1]["mask_shares"]))[::-1]
    ax_share.plot(np.arange(len(last)), last, label="share of each dimension (sorted)")
    ax_share.axhline(record["share_by_count"], color="gray", linestyle="--", label="share by row count alone")
    ax_share.set(xlabel="dimension (sorted)", ylabel="<mask> rows' share of variance", title="last layer", ylim=(0, 1))
    ax_share.legend(fontsize=8)
    return [ranks_png, save_figure(fig, out / "mask_dims.png")]


def run(model_path: str | Path, data: str | Path, out: str | Path, config: AnalyzeConfig) -> dict:
    """Load, measure, write DIR/analysis.json and the PNGs; return the record. Inputs are checked first."""
    if not 0 < config.mask_rate < 1:
        raise FastmaeError(f"--mask-rate {config.mask_rate}: must be in (0, 1)")
    if not 0 < config.epsilon < 1 or not 0 < config.dominance <= 1 or config.sequences < 1:
        raise FastmaeError("--epsilon must be in (0, 1), --dominance in (0, 1], --sequences positive")
    pretrained = load_pretrained(model_path)
    sequences = read_sequences(Path(data), pretrained, config.sequences)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = analyze(pretrained, sequences, config, device)
    if record["layers"][0]["rows"]["mask"] == 0:
        raise FastmaeError(f"--data {data}: too little text for any <mask> at rate {config.mask_rate}")
    record.update(model=str(model_path), weights=str(pretrained.weights_file), step=pretrained.step,
                  objective=pretrained.config.objective, insert_layer=pretrained.config.insert_layer,
                  data=str(data), sequences=len(sequences), tokens=int(sum(len(s) for s in sequences)),
                  mask_rate=config.mask_rate, seed=config.seed, epsilon=config.epsilon,
                  dominance=config.dominance)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot(record, out)
    atomic_write_text(out / "analysis.json", json.dumps(record, indent=1) + "\n")
    return record


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae analyze", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--data", required=True, help="a UTF-8 text file (a document per line) or dataset directory")
    parser.add_argument("--out", required=True, help="output directory (analysis.json, ranks.png, mask_dims.png)")
    add_arguments(parser, AnalyzeConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = from_arguments(AnalyzeConfig, args)

    def go():
        record = run(args.model, args.data, args.out, config)
        last = record["layers"][-1]
        print(f"fastmae analyze: last layer epsilon rank {last['epsilon_rank']['real_masked_input']} (real tokens, "
              f"with <mask>) vs {last['epsilon_rank']['real_unmasked_input']} (without), "
              f"{len(last['mask_dominated_dims'])} mask-dominated dims of {record['hidden_size']}; "
              f"wrote {Path(args.out) / 'analysis.json'}", file=sys.stderr)
        probe = record["neighbour_probe"]
        verdict = "context learned" if probe["learned_context"] else "no evidence of context (not evidence of none)"
        if probe["z_threshold"] is None:  # no test pairs (or no layer) to judge by
            verdict += f": nothing to judge by ({probe['test_pairs']:,} test pairs)"
        else:
            verdict += (f": best layer {probe['best_layer']}, {probe['context_gain']:+.3f} over its {probe['control']} "
                        f"control, z {probe['context_z']} against {probe['z_threshold']}, {probe['test_pairs']:,} "
                        "test pairs")
        print(f"fastmae analyze: neighbour probe: {verdict}", file=sys.stderr)
        rows, hidden = last["rows"], record["hidden_size"]
        if min(rows["real_masked_input"], rows["mask"]) < hidden:  # the rank's bound binds: the ranks say little
            print(f"fastmae analyze: only {rows['real_masked_input']:,} real-token rows and {rows['mask']:,} <mask> "
                  f"rows for {hidden} dimensions: no rank exceeds its row count, and the <mask> shares rest on those "
                  "rows; give --data more text, or raise --sequences", file=sys.stderr)

    return run_command("fastmae analyze", go)


if __name__ == "__main__":
    sys.exit(main())
