"""The held-out protocol: the same tokens and masks for every objective, world size and micro-batch size, every
predicted token hidden from the encoder, and the unigram baselines over those predicted tokens."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_model
from synthetic import prepare_word_dataset

from fastmae.config import SpecialTokens
from fastmae.evaluation import HeldOutSet, unigram_baselines
from fastmae.masking import mask_rows

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return prepare_word_dataset(tmp_path_factory.mktemp("eval-data"), WORDS, 300, 80, vocab_size=40,
                                valid_fraction=0.3, seed=1)


def selected(dataset, world_size, tokens_per_batch, packing="full", sequences=10**6, seed=0):
    """{(sequence index in the split, position)} of every predicted token over all ranks, and the weights' total."""
    chosen, weight = set(), 0.0
    for rank in range(world_size):
        held_out = HeldOutSet(dataset, max_seq_len=32, packing=packing, tokens_per_batch=tokens_per_batch,
                              sequences=sequences, mask_rate=0.15, seed=seed, rank=rank, world_size=world_size)
        for item in held_out.micro_batches:
            cu = item.batch.cu_seqlens.tolist()
            if item.weight:
                for i, sequence in enumerate(item.sequence_ids):
                    rows = item.predicted[cu[i]:cu[i + 1]].nonzero()[:, 0].tolist()
                    chosen |= {(int(sequence), row) for row in rows}
            weight += item.weight * item.batch.num_sequences
    return chosen, weight


@pytest.mark.parametrize("packing", ["full", "doc"])
def test_selection_is_independent_of_world_size_and_micro_batch_size(dataset, packing):
    one, weight = selected(dataset, 1, 256, packing)
    assert len(one) > 100
    for world, budget in [(2, 256), (2, 64), (3, 128), (5, 32)]:
        other, other_weight = selected(dataset, world, budget, packing)
        assert other == one, (world, budget)
        assert other_weight == weight  # every sequence counted exactly once over the ranks
    assert selected(dataset, 1, 256, packing, seed=1)[0] != one  # the eval seed matters


def test_ranks_run_the_same_number_of_micro_batches(dataset):
    counts = {len(HeldOutSet(dataset, max_seq_len=32, packing="full", tokens_per_batch=64, sequences=7,
                             mask_rate=0.15, seed=0, rank=r, world_size=4).micro_batches) for r in range(4)}
    assert len(counts) == 1  # ZeRO-3 gathers parameters collectively: no rank may run fewer forwards


@pytest.mark.parametrize("preset", ["mlm", "mae-lm", "3ml"])
def test_every_objective_predicts_the_same_hidden_tokens(dataset, preset):
    held_out = HeldOutSet(dataset, max_seq_len=32, packing="full", tokens_per_batch=256, sequences=40,
                          mask_rate=0.15, seed=0)
    model = tiny_model(preset, vocab_size=40, max_seq_len=32)
    for item in held_out.micro_batches:
        out = model(mask_rows(item.batch, model.config, item.predicted))
        sel = out.masked.selection
        rows = item.predicted.nonzero()[:, 0]
        assert torch.equal(sel.masked_index.long(), rows) and out.num_predicted == len(rows)
        assert torch.equal(sel.labels, item.batch.tokens[rows])
        # no predicted token reaches the encoder: removed (k > 0) or replaced by <mask> (k = 0), never kept or random
        assert (sel.input_tokens[rows] == FASTMAE.mask).all()
        assert not set(sel.visible_index.tolist()) & set(rows.tolist())
        if model.config.insert_layer > 0:
            assert out.encoder_states.shape[0] == item.batch.num_tokens - len(rows)


def test_unigram_baselines():
    tokens = np.array([7, 7, 7, 9, 9])
    baselines = unigram_baselines(tokens)
    p = np.array([3, 2]) / 5
    assert math.isclose(baselines["unigram_entropy"], float(-(p * np.log(p)).sum()))
    assert math.isclose(baselines["unigram_accuracy"], 0.6)


def test_unigram_baselines_are_over_the_predicted_tokens_of_every_rank(dataset):
    """The baselines describe the tokens the loss is taken on (all ranks' predicted tokens), not all held-out ones."""
    sets = [HeldOutSet(dataset, max_seq_len=32, packing="full", tokens_per_batch=64, sequences=40, mask_rate=0.15,
                       seed=0, rank=r, world_size=2) for r in range(2)]
    predicted = np.concatenate([item.batch.tokens[item.predicted].numpy() for held_out in sets
                                for item in held_out.micro_batches if item.weight])
    assert sets[0].baselines == sets[1].baselines == unigram_baselines(predicted)
    every = np.concatenate([item.batch.tokens.numpy() for held_out in sets for item in held_out.micro_batches
                            if item.weight])
    assert sets[0].baselines != unigram_baselines(every[~np.isin(every, FASTMAE.unmaskable)])  # not the maskable ones


@pytest.mark.parametrize("loss, says", [(3.5, "0.50 nats below the entropy"), (5.25, "1.25 nats above the entropy")])
def test_the_closing_summary_says_which_side_of_the_entropy_the_loss_is(loss, says):
    from fastmae.trainer import held_out_summary

    record = {"kind": "eval", "step": 8, "loss": loss, "accuracy": 0.1, "predicted_tokens": 144,
              "unigram_entropy": 4.0, "unigram_accuracy": 0.05}
    assert says in held_out_summary([record])[-1] and "-" not in held_out_summary([record])[-1].split("(")[1]
    plateau = "; it never fell 0.1 nats below the entropy: still on the unigram plateau"  # within 0.1 nats, or above
    assert (plateau in held_out_summary([record])[-1]) == (loss > 3.9)
    assert plateau in held_out_summary([{**record, "loss": 3.95}])[-1]
