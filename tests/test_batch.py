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


def test_tensors_packed_into_one_buffer_come_back_with_their_dtypes_shapes_and_values():
    from fastmae.batch import COPY_ALIGNMENT, pack_bytes, unpack_bytes

    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-9, 9, (7,), generator=gen, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
               torch.randint(0, 2**40, (3, 5), generator=gen), torch.rand(4, 3, generator=gen) > 0.5,
               torch.randn(2, 3, generator=gen)[:, 1]]  # non-contiguous
    buffer, starts = pack_bytes(tensors)
    assert all(start % COPY_ALIGNMENT == 0 for start in starts) and buffer.dtype == torch.uint8
    for original, view in zip(tensors, unpack_bytes(buffer.clone(), tensors, starts)):
        assert view.dtype == original.dtype and view.shape == original.shape and torch.equal(view, original)


def test_ahead_in_thread_keeps_order_and_raises_where_production_failed():
    from fastmae.batch import ahead_in_thread

    assert list(ahead_in_thread(iter(range(50)), depth=3)) == list(range(50))

    def failing():
        yield from range(3)
        raise OSError("shard 7 unreadable")

    items = ahead_in_thread(failing())
    assert [next(items) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(OSError, match="shard 7"):
        next(items)
    early = ahead_in_thread(iter(range(10**6)), depth=2)  # a consumer that stops early lets the thread go
    assert next(early) == 0
    early.close()
