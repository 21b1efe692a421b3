"""The held-out evaluation protocol (ARCHITECTURE.md section 5): one set of tokens and masks for every objective.

The held-out set is the first `eval.sequences` sequences of the validation split in file order. Each sequence
predicts round(rate * maskable) of its tokens, chosen by a hash of (eval seed, the sequence's index in the split,
the token's position), so the selection depends on nothing else: not the objective, the world size, the micro-batch
size or the step. Every selected token is hidden the same way (`masking.mask_rows`): removed from the encoder when
k > 0, replaced by `<mask>` when k = 0; never kept, never randomised.

Each record also carries the held-out unigram baselines over the same predicted tokens the loss is taken on (the
entropy of their own frequencies and the accuracy of always guessing the most frequent of them), so "it learned"
means "it beats them".
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from .batch import PackedBatch
from .config import ModelConfig, SpecialTokens
from .data.loader import PackedLoader
from .data.order import cut_by_budget
from .kernels import mask_key, rank_within_sequences, uniform_bits
from .masking import MaskCounts, mask_rows

EVAL_STREAM = 2  # training draws streams 0 (selection) and 1 (random replacements)


def held_out_mask(tokens: torch.Tensor, seqlens: torch.Tensor, sequence_ids: torch.Tensor, rate: float,
                  seed: int, special: SpecialTokens) -> torch.Tensor:
    """[T] bool: the predicted tokens of packed sequences (host tensors: tokens [T], seqlens [B], sequence_ids [B]
    int64, each sequence's index in the split), never one of `special.unmaskable`. A pure function of (seed,
    sequence id, position, tokens)."""
    cu = torch.zeros(seqlens.numel() + 1, dtype=torch.int64)
    torch.cumsum(seqlens, 0, out=cu[1:])
    seq = torch.repeat_interleave(torch.arange(seqlens.numel()), seqlens)
    positions = torch.arange(tokens.numel()) - cu[seq]
    maskable = ~torch.isin(tokens, torch.tensor(special.unmaskable, dtype=tokens.dtype))
    sequence_keys = uniform_bits(sequence_ids, mask_key(seed, step=0, rank=0, stream=EVAL_STREAM))
    rank = rank_within_sequences(uniform_bits(positions, sequence_keys[seq]), seq, maskable, cu)
    num_maskable = torch.zeros(seqlens.numel(), dtype=torch.int64).index_add_(0, seq, maskable.long())
    count = MaskCounts.compute(num_maskable, rate, 1.0, 0.0).predicted
    return rank < count[seq]


def unigram_baselines(predicted_tokens: np.ndarray) -> dict:
    """The loss and accuracy of a model that ignores context, on the predicted tokens ([T_m] ids): the entropy (nats)
    of their own frequencies, and the share of the most frequent one."""
    if predicted_tokens.size == 0:
        return {"unigram_entropy": float("nan"), "unigram_accuracy": float("nan")}
    p = np.bincount(predicted_tokens)
    p = p[p > 0] / predicted_tokens.size
    return {"unigram_entropy": float(-(p * np.log(p)).sum()), "unigram_accuracy": float(p.max())}


PLATEAU_MARGIN = 0.1
"""nats: an encoder has left the unigram plateau once its held-out loss fell this far below the unigram entropy (an
encoder still on it predicts token frequencies, not from context, and has a low rank whatever its objective)."""


def left_plateau(curve: list[dict]) -> bool:
    """Whether a run's held-out loss (its eval records, `curve`) ever fell PLATEAU_MARGIN below the held-out unigram
    entropy."""
    return min(r["loss"] for r in curve) < curve[-1]["unigram_entropy"] - PLATEAU_MARGIN


def plateau_note(curve: list[dict]) -> str:
    """What a run's summary and model card add where its held-out loss never left the unigram plateau ('' where it
    did, or without evaluations)."""
    if not curve or left_plateau(curve):
        return ""
    return (f"; it never fell {PLATEAU_MARGIN} nats below the entropy: still on the unigram plateau, predicting token "
            "frequencies, not yet from context")


class EvalBatch(NamedTuple):
    """One held-out micro-batch (host): the packed batch, its predicted rows [T] bool, the split indices of its
    sequences, and its weight in the totals (0 for a filler that only keeps ranks in step)."""

    batch: PackedBatch
    predicted: torch.Tensor
    sequence_ids: np.ndarray
    weight: float


class HeldOutSet:
    """This rank's share of the held-out set, cut into micro-batches, with its masks fixed once.

    The micro-batches are planned for the whole set (greedy by `tokens_per_batch`) and dealt round-robin; every rank
    runs the same number of them (ZeRO-3 gathers parameters collectively), so a rank short of one repeats its first
    micro-batch with weight 0. The totals summed over ranks are therefore the same for any world size.
    """

    def __init__(self, data_path: str | Path, *, max_seq_len: int, packing: str, tokens_per_batch: int,
                 sequences: int, mask_rate: float, seed: int, rank: int = 0, world_size: int = 1,
                 verify_checksum: bool = False):
        split = PackedLoader(data_path, "valid", max_seq_len=max_seq_len, packing=packing,
                             tokens_per_batch=max(tokens_per_batch, max_seq_len), verify_checksum=verify_checksum)
        ids = np.arange(min(sequences, split.num_sequences))
        tokens, lengths = split.tokens_of(ids)
        self.num_sequences, self.num_tokens = len(ids), len(tokens)
        # every rank's predicted tokens (the mask is a pure function of the sequence), so all ranks agree
        predicted = held_out_mask(torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(lengths.astype(np.int64)),
                                  torch.from_numpy(ids).long(), mask_rate, seed, split.data.special_tokens)
        self.baselines = unigram_baselines(tokens[predicted.numpy()])
        self.mask_rate, self.seed = mask_rate, seed
        plan = cut_by_budget(split.sequence_lengths(ids), max(tokens_per_batch, max_seq_len))
        mine = [self._micro_batch(split, ids[part], mask_rate, seed, 1.0) for part in plan[rank::world_size]]
        per_rank = math.ceil(len(plan) / world_size)
        filler = mine[0] if mine else self._micro_batch(split, ids[plan[0]], mask_rate, seed, 0.0)
        self.micro_batches = mine + [filler._replace(weight=0.0)] * (per_rank - len(mine))

    @staticmethod
    def _micro_batch(split: PackedLoader, ids: np.ndarray, rate: float, seed: int, weight: float) -> EvalBatch:
        tokens, lengths = split.tokens_of(ids)
        special = split.data.special_tokens
        batch = PackedBatch.from_packed(tokens, lengths, special=special)
        predicted = held_out_mask(batch.tokens.long(), batch.seqlens, torch.from_numpy(ids).long(), rate, seed,
                                  special)
        return EvalBatch(batch, predicted, ids, weight)


class Evaluator:
    """A run's held-out evaluation and its schedule: every `every` steps (0: never), or at the steps a FLOP budget
    planned (`steps`), and always at the last step."""

    def __init__(self, held_out: HeldOutSet, model_config: ModelConfig, every: int, steps: set[int] | None,
                 last_step: int, device: torch.device):
        self.held_out, self.model_config, self.device = held_out, model_config, device
        self.every, self.steps, self.last_step = every, steps, last_step

    def due(self, step: int) -> bool:
        if step == self.last_step:
            return True
        if self.steps is not None:
            return step in self.steps
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def run(self, engine, step: int, flops_done: int) -> dict:
        """Collective: the held-out record at `step` (masked-token loss and accuracy under the fixed protocol, with
        the unigram baselines of the same tokens); `flops_done` is this rank's share of the run's FLOPs."""
        device = self.device
        engine.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, correct
        predicted = 0.0
        for item in self.held_out.micro_batches:
            batch = item.batch.to(device)
            out = engine(mask_rows(batch, self.model_config, item.predicted), compute_accuracy=True)
            sums += item.weight * torch.stack([out.loss.double() * out.num_predicted, out.num_correct.double()])
            predicted += item.weight * out.num_predicted
        totals = torch.cat([sums, torch.tensor([predicted, float(flops_done)], dtype=torch.float64, device=device)])
        dist.all_reduce(totals)
        loss_sum, correct, predicted, flops = totals.tolist()
        engine.train()
        return {"kind": "eval", "step": step, "flops": flops, "loss": loss_sum / max(predicted, 1),
                "accuracy": correct / max(predicted, 1), "mask_rate": self.held_out.mask_rate,
                "predicted_tokens": int(predicted), "sequences": self.held_out.num_sequences,
                **self.held_out.baselines}
