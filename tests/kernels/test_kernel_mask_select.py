"""The Triton mask selection against the torch reference: bit for bit (a data-movement kernel)."""

import pytest
import torch
from conftest import KERNEL_DEVICE
from fastmae.kernels import mask_key, select_masked, select_masked_reference

from fastmae import PackedBatch
from fastmae.config import SpecialTokens
from fastmae.masking import MaskCounts

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains
BERT = SpecialTokens(pad=0, bos=101, eos=102, unk=100, mask=103)  # BERT's WordPiece: specials inside the vocabulary

SEQUENCES = {
    "edge": [[1, 10, 11, 12, 13, 14, 2], [1, 2], [20], [1, 3, 30, 31, 4, 2, 0, 0], [7]],
    "long": [list(range(5, 300)), [1] + list(range(40, 137)) + [2], list(range(5, 70))],
}


@pytest.mark.parametrize("name", SEQUENCES)
@pytest.mark.parametrize("rate, mask_p, random_p", [(0.15, 0.8, 0.1), (0.15, 1.0, 0.0), (0.5, 1.0, 0.0),
                                                     (0.4, 0.5, 0.3), (1.0, 1.0, 0.0)],
                         ids=["mlm", "mae-lm", "3ml", "mixed", "all-masked"])
@pytest.mark.parametrize("special", [FASTMAE, BERT], ids=["fastmae-ids", "bert-ids"])
def test_kernel_matches_reference_bit_for_bit(name, rate, mask_p, random_p, special, nan_empty):
    seed = len(SEQUENCES[name]) + int(100 * (rate + mask_p + random_p))  # a draw of its own for each case
    sequences = SEQUENCES[name]
    if special == BERT:  # the same sequences with BERT's ids in the special roles
        as_bert = dict(zip(FASTMAE.as_dict().values(), BERT.as_dict().values()))
        sequences = [[as_bert.get(t, t) for t in seq] for seq in sequences]
    batch = PackedBatch.from_sequences(sequences, special=special).to(KERNEL_DEVICE)
    counts = MaskCounts.compute(batch.num_maskable, rate, mask_p, random_p)
    maskable = ~torch.isin(batch.tokens, torch.tensor(special.unmaskable, dtype=torch.int32, device=KERNEL_DEVICE))
    ordinary = special.ordinary_ids(1000).to(KERNEL_DEVICE)
    args = (batch.tokens, batch.cu_seqlens, batch.seq_ids, maskable, counts.removed.to(KERNEL_DEVICE),
            counts.random.to(KERNEL_DEVICE), counts.predicted.to(KERNEL_DEVICE), int(counts.predicted.sum()),
            int(counts.removed.sum()), mask_key(seed, 7, 1), mask_key(seed, 7, 1, stream=1), special.mask, ordinary,
            batch.max_seqlen)
    expected = select_masked_reference(*args)
    got = select_masked(*args)
    for field, e, g in zip(expected._fields, expected, got):
        assert g.dtype == e.dtype and torch.equal(g, e), field
    randomised = (got.input_tokens != batch.tokens) & (got.input_tokens != special.mask)
    assert torch.isin(got.input_tokens[randomised], ordinary).all()  # random ids are never special
    if random_p and name == "long":
        assert randomised.any()
    if rate == 1.0:  # everything maskable is masked: the visible stream holds the specials only
        assert torch.isin(batch.tokens[got.visible_index.long()],
                          torch.tensor(special.unmaskable, dtype=torch.int32, device=KERNEL_DEVICE)).all()


@pytest.mark.parametrize("preset, extra", [("3ml", {}), ("mlm", {}),
                                           ("mae-lm", {"decoder_kind": "cross", "position_embedding": "rotary"})])
def test_masks_and_layouts_made_on_the_host_are_the_devices(preset, extra, monkeypatch):
    # the trainer masks on the host (masked_ahead: the reference, in a thread) and moves each micro-batch in one copy;
    # masking on the device (the Triton kernel) gives the same selection and stream layouts
    import dataclasses

    from conftest import tiny_batch, tiny_config

    from fastmae.attention import VarlenMeta
    from fastmae.batch import to_device_ahead
    from fastmae.masking import mask_batch
    from fastmae.pipeline import masked_ahead

    monkeypatch.setenv("FASTMAE_KERNELS", "triton")
    config = tiny_config(preset, **extra)
    batches = [dataclasses.replace(tiny_batch(seed=i), index=10 + i) for i in range(3)]
    moved = to_device_ahead(masked_ahead(iter(batches), config, seed=5), torch.device(KERNEL_DEVICE))
    for host, batch in zip(moved, batches, strict=True):
        device = mask_batch(batch.to(KERNEL_DEVICE), config, seed=5, step=batch.index)
        assert host.device == device.device
        for field, got, expected in zip(device.selection._fields, host.selection, device.selection):
            assert torch.equal(got, expected), field
        for layout in ("full", "visible", "masked"):
            if layout not in host.layouts_read():
                continue
            got, expected = getattr(host, layout), getattr(device, layout)
            for field in VarlenMeta._fields:
                a, b = getattr(got, field), getattr(expected, field)
                if isinstance(a, tuple):  # rotary tables (made on the device from the moved positions)
                    equal = all(map(torch.equal, a, b))
                else:
                    equal = a == b if a is None or isinstance(a, int) else torch.equal(a, b)
                assert equal, (layout, field)
