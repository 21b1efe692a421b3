"""Static shapes for `doc` packing (fastmae/padding.py): padded micro-batches take the ladder's shapes, keep their own
masks, and train exactly as they would unpadded. Replayed by CUDA graphs: tests/test_graphs.py."""

import dataclasses

import pytest
import torch
from conftest import tiny_batch, tiny_model
from synthetic import prepare_word_dataset

from fastmae.batch import PackedBatch
from fastmae.config import SpecialTokens
from fastmae.data.loader import PackedLoader
from fastmae.flops import masked_training_flops
from fastmae.graphs import signature
from fastmae.masking import mask_batch
from fastmae.padding import IGNORED_LABEL, MAX_RUNGS, ShapeLadder, pad
from fastmae.pipeline import masked_ahead

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains

TOKENS_PER_BATCH = 384
PRESETS = [("mlm", {}), ("3ml", {}), ("mae-lm", {"relative_attention_bias": True}),
           ("mae-lm", {"decoder_kind": "cross", "position_embedding": "rotary"}),
           ("mlm", {"insert_layer": 1, "position_embedding": "rotary"})]  # some removed rows are not predicted


def doc_batch(seed: int, num_sequences: int, min_len: int, max_len: int, index: int = 0) -> PackedBatch:
    """A micro-batch as `doc` packing cuts them: sequences of document-dependent lengths, at most TOKENS_PER_BATCH."""
    return dataclasses.replace(tiny_batch(num_sequences, seed=seed, min_len=min_len, max_len=max_len), index=index)


BATCHES = [(0, 3, 100, 126), (1, 7, 5, 40), (2, 12, 1, 20), (3, 1, 126, 126), (4, 14, 1, 6)]


@pytest.mark.parametrize("preset, extra", PRESETS)
def test_a_padded_batch_has_its_shape_and_its_own_masks(preset, extra):
    config = tiny_model(preset, **extra).config
    ladder = ShapeLadder(config, TOKENS_PER_BATCH)
    first = -(-TOKENS_PER_BATCH // 128) + 2  # b0, 2 b0, 4 b0: no rung of tens of thousands of empty sequences
    assert [s.sequences for s in ladder.shapes] == [first, 2 * first, 4 * first] and len(ladder.shapes) == MAX_RUNGS
    assert all(s.tokens % 64 == 0 for s in ladder.shapes)
    many = mask_batch(doc_batch(9, 4 * first + 1, 1, 6), config, seed=5, step=9, host=True)
    assert ladder.shape_for(many) is None and ladder.pad(many) is many  # more documents than the top rung: eager
    for seed, count, low, high in BATCHES:
        masked = mask_batch(doc_batch(seed, count, low, high), config, seed=5, step=seed, host=True)
        shape = ladder.shape_for(masked)
        padded = pad(masked, shape)
        batch, sel, rows = padded.batch, padded.selection, masked.batch.num_tokens
        assert shape is not None and shape == ladder.shapes[[s.sequences for s in ladder.shapes].index(shape.sequences)]
        assert (batch.num_tokens, batch.num_sequences, sel.masked_index.numel(), sel.removed_index.numel(),
                sel.visible_index.numel()) == (shape.tokens, shape.sequences, shape.predicted, shape.removed,
                                               shape.tokens - shape.removed)
        # its own rows and masks as they were, the fillers after them
        for name in ("tokens", "positions", "seq_ids"):
            assert torch.equal(getattr(batch, name)[:rows], getattr(masked.batch, name))
        predicted = masked.num_predicted
        assert torch.equal(sel.masked_index[:predicted], masked.selection.masked_index)
        assert torch.equal(sel.labels[:predicted], masked.selection.labels)
        assert (sel.labels[predicted:] == IGNORED_LABEL).all() and (sel.masked_index[predicted:] >= rows).all()
        assert torch.equal(sel.input_tokens[:rows], masked.selection.input_tokens)
        assert (batch.seq_ids[rows:] >= masked.batch.num_sequences).all() and (batch.positions[rows:] < 128).all()
        # visible and removed rows partition the rows; every stream's layout adds up to its rows
        both = torch.cat([sel.visible_index, sel.removed_index]).sort().values
        assert torch.equal(both, torch.arange(shape.tokens, dtype=both.dtype))
        for name, stream_rows in (("full", shape.tokens), ("visible", sel.visible_index.numel()),
                                  ("masked", shape.predicted)):
            meta = getattr(padded, name)
            assert meta.max_seqlen == 128 and int(meta.cu_seqlens[-1]) == stream_rows
            assert meta.cu_seqlens.numel() == shape.sequences + 1
        # what the run counts is the batch's own work
        assert (padded.num_predicted, padded.num_tokens) == (masked.num_predicted, masked.num_tokens)
        assert masked_training_flops(config, padded) == masked_training_flops(config, masked)
        fillers = batch.seqlens[masked.batch.num_sequences:]
        assert fillers.numel() == padded.filler.sequences and int(fillers.sum()) == padded.filler.tokens


def test_batches_of_one_shape_share_one_signature_and_others_do_not():
    config = tiny_model("3ml").config
    ladder = ShapeLadder(config, TOKENS_PER_BATCH)
    padded = [ladder.pad(mask_batch(doc_batch(seed, 5, 40, 70), config, seed=0, step=seed, host=True)).packed()
              for seed in range(3)]
    assert len({p.batch.seqlens[:5].tolist().__repr__() for p in padded}) == 3  # different documents
    assert len({signature(p) for p in padded}) == 1
    many = ladder.pad(mask_batch(doc_batch(9, 40, 1, 6), config, seed=0, step=0, host=True)).packed()
    assert signature(many) != signature(padded[0])


def test_a_batch_whose_documents_cap_its_counts_fits_no_shape_and_stays_unpadded():
    # documents made mostly of <mask> ids: their maskable tokens cap the predicted rows far below the ladder's bound,
    # so the dummy rows need more spare rows than any rung has: the batch runs as it is (eagerly)
    config = tiny_model("3ml").config
    ladder = ShapeLadder(config, TOKENS_PER_BATCH)
    masks = PackedBatch.from_sequences([[1] + [FASTMAE.mask] * 120 + [5, 2]] * 3)
    masked = mask_batch(dataclasses.replace(masks, index=0), config, seed=0, step=0, host=True)
    assert masked.num_predicted == 3 and ladder.shape_for(masked) is None and ladder.pad(masked) is masked
    with pytest.raises(ValueError, match="does not fit"):
        pad(masked, ladder.shapes[-1])
    smaller = ShapeLadder(config, 128)  # micro-batches of at most 128 rows: this one is larger than every shape
    assert smaller.shape_for(masked) is None and smaller.pad(masked) is masked


@pytest.mark.parametrize("preset, extra", PRESETS)
@pytest.mark.parametrize("backend", ["padded", "math"])
def test_a_padded_batch_trains_as_it_would_unpadded(preset, extra, backend, batches=BATCHES[1:3],
                                                    tokens_per_batch=TOKENS_PER_BATCH):
    # losses and gradients of the batch's own rows, filler rows and zero-length sequences included: the fillers
    # attend only to themselves and their labels are ignored (a relative bias table's gradient stays finite)
    model = tiny_model(preset, **extra).train()
    model.set_attention_backend(backend)
    ladder = ShapeLadder(model.config, tokens_per_batch)
    zero_length = 0
    for seed, count, low, high in batches:
        masked = mask_batch(doc_batch(seed, count, low, high), model.config, seed=1, step=seed, host=True)
        padded = ladder.pad(masked).packed()
        zero_length += int((padded.batch.seqlens == 0).sum())
        results = []
        for batch in (masked, padded):
            model.zero_grad()
            out = model(batch, compute_accuracy=True)
            (out.loss * out.num_predicted).backward()
            results.append((out.loss.detach(), out.num_predicted, int(out.num_correct),
                            [p.grad.clone() for p in model.parameters()]))
        (loss, count_, correct, grads), (padded_loss, padded_count, padded_correct, padded_grads) = results
        assert (padded_count, padded_correct) == (count_, correct)
        torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=0)
        for (name, _), a, b in zip(model.named_parameters(), padded_grads, grads):
            # fp32 sums over more rows (the fillers add zeros): rounding at 1e-6 of the gradient's scale
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=name)
    assert zero_length > 0


def test_a_padded_batch_trains_as_it_would_unpadded_with_the_triton_kernels(triton_kernels):
    # the fused row kernels and loss the GPU runs (interpreted here): embedding, the insertion at k = 1 with filler
    # rows removed but not predicted, the loss with ignored labels
    # (its 12 documents padded to 256 rows, not 384: the interpreter's time goes with the rows)
    test_a_padded_batch_trains_as_it_would_unpadded(*PRESETS[4], "padded", batches=BATCHES[2:3], tokens_per_batch=256)


def test_every_micro_batch_of_a_doc_run_takes_a_ladder_shape(tmp_path):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    directory = prepare_word_dataset(tmp_path, words, 200, 150, vocab_size=40, valid_fraction=0.1)
    config = tiny_model("3ml").config
    loader = PackedLoader(directory, max_seq_len=128, packing="doc", tokens_per_batch=TOKENS_PER_BATCH, grad_accum=2)
    ladder = ShapeLadder(config, TOKENS_PER_BATCH)
    batches = iter(loader)
    stream = masked_ahead((next(batches) for _ in range(16)), config, seed=0, shapes=ladder)
    shapes = [(m.batch.num_tokens, m.batch.num_sequences, m.num_predicted + m.filler.predicted) for m in stream]
    assert len(shapes) == 16
    assert set(shapes) <= {(s.tokens, s.sequences, s.predicted) for s in ladder.shapes}
    assert len(set(shapes)) < len(shapes)  # shapes repeat, so a recording serves many
