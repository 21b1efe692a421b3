import pytest
import torch
from conftest import tiny_batch, tiny_config
from fastmae.kernels import hash32
from fastmae.kernels.hashing import hash32_int

from fastmae import PackedBatch
from fastmae.config import ROLES, SpecialTokens
from fastmae.masking import MaskCounts, mask_batch, select_rows

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains


def test_hash_matches_host_version_and_is_pinned():
    xs = [0, 1, 2, 12345, 0x7FFFFFFF, 0xFFFFFFFF]
    assert hash32(torch.tensor(xs)).tolist() == [hash32_int(x) for x in xs]
    # murmur3 fmix32 of 1: pinned so a change of the generator (and of every published mask) cannot go unnoticed
    assert hash32_int(1) == 0x514E28B7


def per_sequence(rows: torch.Tensor, batch: PackedBatch) -> list[int]:
    return torch.bincount(batch.seq_ids[rows.long()].long(), minlength=batch.num_sequences).tolist()


@pytest.mark.parametrize("preset, rate", [("mlm", 0.15), ("mae-lm", 0.15), ("3ml", 0.5), ("mlm", 0.4)])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_exact_counts_specials_excluded_and_partition(preset, rate, seed):
    sequences = [[1, 10, 11, 12, 13, 14, 2], [1, 2], [20], [1, 3, 30, 31, 4, 2, 0, 0], list(range(5, 95))]
    batch = PackedBatch.from_sequences(sequences)
    cfg = tiny_config(preset, mask_rate=rate)
    masked = mask_batch(batch, cfg, seed=seed, step=3)
    sel, counts = masked.selection, masked.counts
    # round(rate x (length - 2)), at most the maskable tokens (the second sequence has none, the third one)
    expected = [min(int(rate * max(n - 2, 0) + 0.5), m)
                for n, m in zip(batch.seqlens.tolist(), batch.num_maskable.tolist())]
    assert counts.predicted.tolist() == expected
    assert per_sequence(sel.masked_index, batch) == expected
    assert per_sequence(sel.removed_index, batch) == counts.removed.tolist()
    for special in FASTMAE.unmaskable:
        assert not (sel.labels == special).any()
    assert torch.equal(sel.labels, batch.tokens[sel.masked_index.long()])
    # visible and removed rows partition the batch, both ascending
    rows = torch.cat([sel.visible_index, sel.removed_index]).sort().values
    assert torch.equal(rows, torch.arange(batch.num_tokens, dtype=torch.int32))
    for index in (sel.masked_index, sel.visible_index, sel.removed_index):
        assert (index[1:] > index[:-1]).all()
    # removed rows are predicted rows; their input is <mask>
    assert torch.isin(sel.removed_index, sel.masked_index).all()
    assert (sel.input_tokens[sel.removed_index.long()] == FASTMAE.mask).all()
    # rows that are not predicted keep their id
    unpredicted = torch.ones(batch.num_tokens, dtype=torch.bool)
    unpredicted[sel.masked_index.long()] = False
    assert torch.equal(sel.input_tokens[unpredicted], batch.tokens[unpredicted])
    # replacements are ordinary ids
    assert ((sel.input_tokens >= len(ROLES)) | (sel.input_tokens == batch.tokens)
            | (sel.input_tokens == FASTMAE.mask)).all()


def test_corruption_split_is_exact():
    counts = MaskCounts.compute(torch.tensor([0, 1, 10, 100, 1000]), 0.15, 0.8, 0.1)
    assert counts.predicted.tolist() == [0, 0, 2, 15, 150]
    assert counts.removed.tolist() == [0, 0, 2, 12, 120]
    assert counts.random.tolist() == [0, 0, 0, 2, 15]
    batch = PackedBatch.from_sequences([list(range(5, 1005))])
    sel = mask_batch(batch, tiny_config("mlm", vocab_size=2000), seed=0, step=0).selection
    changed = sel.input_tokens != batch.tokens
    assert int((sel.input_tokens == FASTMAE.mask).sum()) == 120
    assert 14 <= int(changed.sum()) - 120 <= 15  # a random id may equal the original one by chance


def test_same_seed_same_masks_other_step_rank_seed_other_masks():
    batch = tiny_batch(num_sequences=8, seed=3)
    cfg = tiny_config("3ml")
    ref = mask_batch(batch, cfg, seed=11, step=5, rank=1).selection
    again = mask_batch(batch, cfg, seed=11, step=5, rank=1).selection
    for a, b in zip(ref, again):
        assert torch.equal(a, b)
    for other in (dict(seed=12, step=5, rank=1), dict(seed=11, step=6, rank=1), dict(seed=11, step=5, rank=0)):
        sel = mask_batch(batch, cfg, **other).selection
        assert sel.masked_index.shape == ref.masked_index.shape
        assert not torch.equal(sel.masked_index, ref.masked_index), other


def test_selection_is_uniform_over_positions():
    batch = PackedBatch.from_sequences([[1] + list(range(10, 30)) + [2]])
    cfg = tiny_config("3ml", mask_rate=0.25)
    hits = torch.zeros(batch.num_tokens)
    trials = 2000
    for step in range(trials):
        hits[mask_batch(batch, cfg, seed=0, step=step).selection.masked_index.long()] += 1
    freq = hits / trials
    assert freq[0] == 0 and freq[-1] == 0
    # 5 of 20 maskable rows each time: 0.25 each; binomial std over 2000 trials ~ 0.01
    assert (freq[1:-1] - 0.25).abs().max() < 0.04, freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,picked,width,seed", [(65, 17, 8, 0), (300, 150, 33, 1), (9, 9, 4, 2)])
def test_select_rows_matches_index_select_forward_and_backward(dtype, rows, picked, width, seed):
    """select_rows (a selection's rows; its backward writes where index_select's adds) computes what index_select
    computes, forward and backward, bit for bit, for an int32 or int64 index in any order."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=generator).to(dtype)
    index = torch.randperm(rows, generator=generator)[:picked]
    grad = torch.randn(picked, width, generator=generator).to(dtype)
    for index in (index, index.int()):
        ours, reference = (x.clone().requires_grad_() for _ in range(2))
        out, expected = select_rows(ours, index), reference.index_select(0, index)
        out.backward(grad), expected.backward(grad)
        assert torch.equal(out, expected) and torch.equal(ours.grad, reference.grad)

