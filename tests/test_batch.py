import pytest
import torch

from fastmae import PackedBatch


def test_packing_layout():
    batch = PackedBatch.from_sequences([[1, 7, 8, 2], [1, 9, 2], [5]])
    assert batch.tokens.dtype == torch.int32 and batch.tokens.tolist() == [1, 7, 8, 2, 1, 9, 2, 5]
    assert batch.cu_seqlens.tolist() == [0, 4, 7, 8]
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert batch.seq_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 2]
    assert batch.max_seqlen == 4 and batch.seqlens.tolist() == [4, 3, 1]
    # pad, bos, eos and mask are never predicted; <unk> (3) and ordinary ids are
    assert batch.num_maskable.tolist() == [2, 1, 1]
    assert PackedBatch.from_sequences([[0, 1, 2, 4, 3]]).num_maskable.tolist() == [1]


def test_bad_sequences_are_named():
    with pytest.raises(ValueError, match="no sequences"):
        PackedBatch.from_sequences([])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        PackedBatch.from_sequences([[1, 2], []])
    with pytest.raises(ValueError, match="sequence 0 holds token id 50"):
        PackedBatch.from_sequences([[1, 50]], vocab_size=50)
    with pytest.raises(ValueError, match="-1"):
        PackedBatch.from_sequences([[1, -1]])
