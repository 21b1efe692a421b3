"""Data pipeline: prepare (readers, tokenizer, shards), packing, the loader's exact resume, and bad input."""

import json
import subprocess
import sys

import numpy as np
import pytest
import warm_python

from fastmae.config import SpecialTokens
from fastmae.data import PackedLoader, ShardSet
from fastmae.data.loader import CURSORS_KEPT
from fastmae.data.order import EpochOrder, StepSizes, cut_by_budget
from fastmae.data.sequences import SequenceIndex
from fastmae.data.shards import shard_files
from fastmae.data.tokenizer import load_tokenizer
from fastmae.errors import FastmaeError
from fastmae.prepare import prepare

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon "
         "phi chi psi omega red green blue cyan magenta yellow black white").split()


def write_corpus(path, num_docs=300, seed=0, blank_line_docs=False):
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=rng.integers(3, 120))) for _ in range(num_docs)]
    sep = "\n\n" if blank_line_docs else "\n"
    path.write_text(sep.join(docs) + "\n")
    return docs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    docs = write_corpus(root / "corpus.txt")
    prepare([root / "corpus.txt"], root / "ds", vocab_size=56, valid_fraction=0.1, docs_per_shard=70, workers=2,
            progress=False)
    return root / "ds", docs


def test_prepare_writes_shards_tokenizer_and_metadata(dataset):
    directory, docs = dataset
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["vocab_size"] == 56 and meta["dtype"] == "uint16"
    assert meta["splits"]["train"]["shards"] == [f"shard_{i:05d}" for i in range(5)]  # 300 docs / 70 per shard
    assert meta["splits"]["train"]["documents"] + meta["splits"]["valid"]["documents"] == len(docs)
    assert 0 < meta["splits"]["valid"]["documents"] < 0.2 * len(docs)
    tokenizer = load_tokenizer(directory / "tokenizer.model")
    assert tokenizer.sha256 == meta["tokenizer_sha256"]
    assert tokenizer.sp.piece_to_id("<mask>") == FASTMAE.mask
    train = ShardSet(directory, "train", verify_checksum=True)
    # documents round-trip through the shards
    decoded = {tokenizer.decode(train.shards[0].tokens[a:b].tolist())
               for a, b in zip(train.shards[0].offsets[:-1], train.shards[0].offsets[1:])}
    assert decoded <= set(docs) and len(decoded) > 10


def test_a_micro_batch_shorter_than_a_sequence_is_refused_naming_both_settings(dataset, tmp_path):
    from fastmae.config import load_run_config

    config = load_run_config(None, [f"data.path={dataset[0]}", f"log.dir={tmp_path}", "model.preset=mlm",
                                    "model.max_seq_len=128", "data.tokens_per_micro_batch=64"])
    with pytest.raises(FastmaeError, match="data.tokens_per_micro_batch=64 is smaller than model.max_seq_len=128"):
        PackedLoader.for_run(config)


def test_prepare_is_idempotent(dataset, tmp_path):
    directory, _ = dataset
    tokens_file = shard_files(directory, "train", "shard_00002")[0]
    before = tokens_file.stat().st_mtime_ns
    prepare([directory.parent / "corpus.txt"], directory, vocab_size=56, valid_fraction=0.1, docs_per_shard=70,
            workers=1, progress=False)
    assert tokens_file.stat().st_mtime_ns == before


def test_prepare_rebuilds_damaged_shards_instead_of_skipping_them(tmp_path, capsys):
    write_corpus(tmp_path / "corpus.txt", num_docs=120)
    kwargs = dict(vocab_size=40, valid_fraction=0.1, docs_per_shard=30, workers=1)
    prepare([tmp_path / "corpus.txt"], tmp_path / "ds", progress=False, **kwargs)
    intact = {name: shard_files(tmp_path / "ds", "train", name)[0].read_bytes() for name in ("shard_00001",
                                                                                                "shard_00002")}
    truncated, flipped = (shard_files(tmp_path / "ds", "train", name)[0] for name in intact)
    truncated.write_bytes(truncated.read_bytes()[:-6])
    data = bytearray(flipped.read_bytes())
    data[10] ^= 0xFF
    flipped.write_bytes(bytes(data))
    capsys.readouterr()
    prepare([tmp_path / "corpus.txt"], tmp_path / "ds", progress=True, **kwargs)
    err = capsys.readouterr().err
    assert f"rebuilding shard_00001: {truncated}:" in err and "truncated or corrupt" in err
    assert f"rebuilding shard_00002: {flipped}: sha256 differs" in err
    assert "shard_00000" not in err and "shard_00003" not in err  # intact shards are kept
    ShardSet(tmp_path / "ds", "train", verify_checksum=True)
    assert {name: shard_files(tmp_path / "ds", "train", name)[0].read_bytes() for name in intact} == intact


def test_prepare_command_line_is_its_options_dataclass():
    import argparse
    import dataclasses

    from fastmae.config import add_arguments, from_arguments, option
    from fastmae.prepare import PrepareOptions, build_parser

    args = build_parser().parse_args(["--output", "ds", "--format", "jsonl", "--field", "body", "--tokenizer",
                                      "t.model", "--workers", "2", "--valid-fraction", "0.1", "--model-type", "bpe"])
    assert from_arguments(PrepareOptions, args) == PrepareOptions(
        fmt="jsonl", text_field="body", tokenizer_path="t.model", workers=2, valid_fraction=0.1, model_type="bpe")
    assert from_arguments(PrepareOptions, build_parser().parse_args(["--output", "ds"])) == PrepareOptions()
    with pytest.raises(SystemExit):  # a value outside the field's choices
        build_parser().parse_args(["--output", "ds", "--on-decode-error", "ignore"])

    @dataclasses.dataclass
    class Toggle:
        verbose: bool = option(False, "say more")

    parser = argparse.ArgumentParser()
    add_arguments(parser, Toggle)
    assert from_arguments(Toggle, parser.parse_args(["--verbose"])).verbose is True
    assert from_arguments(Toggle, parser.parse_args(["--no-verbose"])).verbose is False


@pytest.mark.parametrize("fmt, mode", [("text", "paragraph"), ("jsonl", None)])
def test_other_input_formats(tmp_path, fmt, mode):
    if fmt == "jsonl":
        docs = [" ".join(WORDS[i:i + 9]) for i in range(25)] * 4
        (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
        meta = prepare([tmp_path / "in.jsonl"], tmp_path / "ds", fmt="jsonl", text_field="body", vocab_size=40,
                       valid_fraction=0.0, progress=False)
    else:
        docs = write_corpus(tmp_path / "in.txt", num_docs=50, blank_line_docs=True)
        meta = prepare([tmp_path / "in.txt"], tmp_path / "ds", text_mode="paragraph", vocab_size=40,
                       valid_fraction=0.0, progress=False)
    assert meta["splits"]["train"]["documents"] == len(docs)


def test_builtin_corpus_is_offline_and_substantial():
    from fastmae.data.builtin import builtin_documents

    docs = list(builtin_documents())
    assert len(docs) > 70 and sum(len(text) for _, text in docs) > 400_000


# ---------------------------------------------------------------------------------------------------- loader
def drain(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def epoch_plan(loader, epoch=0):
    """This rank's micro-batches (sequence ids) of every step of `epoch`, in order."""
    batches, position = [], 0
    while (bounds := loader.planner.plan_step(epoch, position)) is not None:
        batches += [sequences for _, sequences in loader.step_sequences(epoch, bounds)]
        position = int(bounds[-1])
    return batches


@pytest.mark.parametrize("packing", ["full", "doc"])
def test_packing_covers_every_token_once_and_respects_limits(dataset, packing):
    directory, _ = dataset
    loader = PackedLoader(directory, max_seq_len=32, packing=packing, tokens_per_batch=200, seed=1)
    for batch in drain(loader, loader.planner.steps_per_epoch()):
        tokens, cu = batch.tokens.numpy(), batch.cu_seqlens.numpy()
        assert batch.num_tokens <= 200 and batch.max_seqlen <= 32
        assert (tokens[cu[:-1]] == FASTMAE.bos).all() and (tokens[cu[1:] - 1] == FASTMAE.eos).all()
    # one rank: the epoch's micro-batches hold every sequence exactly once
    order = np.concatenate(epoch_plan(loader))
    assert np.array_equal(np.sort(order), np.arange(loader.num_sequences))
    # and the sequences, in index order and without <s> ... </s>, are exactly the token stream: every token once
    tokens, lengths = loader.tokens_of(np.arange(loader.num_sequences))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    bodies = np.concatenate([tokens[a + 1:b - 1] for a, b in zip(cu[:-1], cu[1:])])
    data = ShardSet(directory)
    separator = [FASTMAE.eos] if packing == "full" else []  # full packing joins documents with </s>
    stream = np.concatenate([np.concatenate([list(s.tokens[x:y]) + separator for x, y in zip(s.offsets[:-1],
                                                                                            s.offsets[1:])])
                             for s in data.shards])
    assert np.array_equal(bodies, stream)


def test_full_packing_gives_every_micro_batch_of_full_length_sequences_the_same_shapes(dataset):
    """Mask counts follow sequence lengths only: whatever document separators a full-length sequence holds, the
    micro-batch the trainer's pipeline masks (`masked_ahead`: selection and stream layouts, on the host) has the same
    device shapes. The exceptions: micro-batches with a shard's last piece (shorter) and the epoch's last micro-batch
    (partly filled)."""
    from conftest import tiny_config

    from fastmae.pipeline import masked_ahead

    directory, _ = dataset
    loader = PackedLoader(directory, max_seq_len=32, packing="full", tokens_per_batch=128, seed=1)
    config = tiny_config("3ml", vocab_size=loader.vocab_size, max_seq_len=32, decoder_kind="cross")
    shapes, separators, short = set(), set(), 0
    for masked in masked_ahead(drain(loader, loader.planner.steps_per_epoch()), config, seed=0):
        batch, selection = masked.batch, masked.selection
        if int(batch.seqlens.min()) < 32 or batch.num_tokens < 128:
            short += 1
            continue
        assert set(masked.layouts_read()) <= set(vars(masked))  # built on the host, ahead
        shapes.add(tuple(t.shape for t in masked.device_tensors()))
        separators.add(int((batch.tokens == FASTMAE.eos).sum()) - batch.num_sequences)  # </s> inside the sequences
        assert (selection.labels != FASTMAE.eos).all()  # never a separator
    assert len(shapes) == 1, shapes
    assert len(separators) > 3 and short <= len(ShardSet(directory).shards) + 1  # many separator counts, one shape


def _contains(doc, piece):
    n = len(piece)
    return any(doc[i:i + n] == piece for i in range(len(doc) - n + 1))


def test_doc_packing_never_truncates(dataset):
    directory, _ = dataset
    loader = PackedLoader(directory, max_seq_len=16, packing="doc", tokens_per_batch=10_000)
    data = ShardSet(directory)
    bodies = loader.index.lengths.astype(np.int64) - 2
    assert bodies.sum() == data.num_tokens and bodies.max() <= 14


def test_ranks_get_disjoint_equal_shares(dataset):
    directory, _ = dataset
    per_rank = [PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, rank=r, world_size=3, seed=2)
                for r in range(3)]
    counts = {len(epoch_plan(loader)) for loader in per_rank}
    assert len(counts) == 1
    seen = [set(np.concatenate(epoch_plan(loader)).tolist()) for loader in per_rank]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not seen[i] & seen[j], (i, j)
    # together they cover the epoch but for the dropped remainder: fewer than one step's 3 micro-batches
    whole = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, rank=0, world_size=1, seed=2)
    plan = epoch_plan(whole)
    assert len(plan) > 3 * counts.pop() - 1
    union = set().union(*seen)
    assert union <= set(range(whole.num_sequences))
    dropped = set(range(whole.num_sequences)) - union
    assert dropped == set(np.concatenate(plan[len(plan) - len(plan) % 3:]).tolist()) if len(plan) % 3 else not dropped


def test_same_seed_same_stream_other_epoch_other_order(dataset):
    directory, _ = dataset
    a = drain(PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, seed=5), 4)
    b = drain(PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, seed=5), 4)
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    loader = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, seed=5)
    assert not np.array_equal(epoch_plan(loader, 0)[0], epoch_plan(loader, 1)[0])


@pytest.mark.parametrize("packing", ["full", "doc"])
def test_exact_resume(dataset, packing):
    directory, _ = dataset
    make = lambda: PackedLoader(directory, max_seq_len=32, packing=packing, tokens_per_batch=128, seed=3)  # noqa
    loader = make()
    n = loader.planner.steps_per_epoch() - 2  # resume across the epoch boundary
    it = iter(loader)
    for _ in range(n):
        next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(5)]
    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON round trip
    got = drain(fresh, 5)
    for e, g in zip(expected, got):
        assert np.array_equal(e.tokens, g.tokens) and np.array_equal(e.cu_seqlens, g.cu_seqlens)
    assert fresh.epoch == 1


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 65_537, 250_001])
def test_epoch_order_is_a_permutation_at_any_positions(n):
    order = EpochOrder(n, seed=7, epoch=0)
    ids = order[np.arange(n)]
    assert np.array_equal(np.sort(ids), np.arange(n))
    lo, hi = n // 3, min(n, n // 3 + 50)
    assert np.array_equal(order[np.arange(lo, hi)], ids[lo:hi])  # a slice costs only its positions
    if n >= 1000:
        # shuffled like a uniform permutation (bounds: 5 standard deviations of one): neighbours in the order lie a
        # third of the data apart on average, and position and id are uncorrelated
        assert abs(np.abs(np.diff(ids)).mean() / n - 1 / 3) < 5 * 0.236 / np.sqrt(n)
        assert abs(np.corrcoef(np.arange(n), ids)[0, 1]) < 5 / np.sqrt(n)
        other = EpochOrder(n, seed=7, epoch=1)[np.arange(n)]
        assert (other == ids).mean() < 0.01


def _greedy_reference(lengths, budget):
    """The greedy cut written as a plain loop over sequences."""
    parts, begin, used = [], 0, 0
    for i, length in enumerate(lengths.tolist()):
        if used + length > budget and i > begin:
            parts.append(slice(begin, i))
            begin, used = i, 0
        used += length
    parts.append(slice(begin, len(lengths)))
    return parts


@pytest.mark.parametrize("seed", range(5))
def test_cut_by_budget_is_the_greedy_cut(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        lengths = rng.integers(3, 70, size=rng.integers(1, 400))
        budget = int(rng.integers(3, 300))
        assert cut_by_budget(lengths, budget) == _greedy_reference(lengths, budget)


def test_sequence_index_locates_every_sequence():
    """Stream spans from the stored lengths and every 64th offset equal a cumulative sum over all sequences, with
    empty shards and empty documents in between."""
    rng = np.random.default_rng(3)
    shards = [rng.integers(0, 90, size=rng.integers(0, 200)) for _ in range(12)] + [np.zeros(0, dtype=np.int64)]
    for packing in ("full", "doc"):
        index = SequenceIndex(shards, max_seq_len=20, packing=packing)
        bodies = index.lengths.astype(np.int64) - 2
        starts = np.concatenate(([0], np.cumsum(bodies)[:-1]))
        shard = np.searchsorted(index.shard_starts, starts, side="right") - 1
        got_shard, got_start, got_stop = index.stream_spans(np.arange(len(index)))
        assert np.array_equal(got_shard, shard)
        assert np.array_equal(got_start, starts - index.shard_starts[shard])
        assert np.array_equal(got_stop - got_start, bodies)
        assert bodies.max() <= 18 and (bodies > 0).all()
        streams = [d.sum() + (len(d) if packing == "full" else 0) for d in shards]
        assert np.array_equal(np.diff(index.shard_starts), streams)


def _steps(loader, count):
    """`count` optimizer steps of `loader` as each step's sorted sequence ids (this rank's share)."""
    it = iter(loader)
    steps = []
    for _ in range(count):
        batches = [next(it) for _ in range(loader.micro_batches_per_step // loader.world_size)]
        steps.append(np.sort(np.concatenate([b.dataset_ids for b in batches])))
    return steps


def test_micro_batch_index_is_its_place_in_the_run_whatever_the_rank_count(dataset):
    """Masks are keyed by PackedBatch.index: on 1 or 3 ranks (6 micro-batches a step) the same index holds the same
    sequences, every index of the first steps appears once, and a resumed loader continues the count."""
    directory, _ = dataset

    def by_index(world, draws, state=None):
        found = {}
        for rank in range(world):
            loader = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, rank=rank, world_size=world,
                                  grad_accum=6 // world, seed=4)
            if state is not None:
                loader.load_state_dict(state)
            it = iter(loader)
            for _ in range(draws):
                batch = next(it)
                assert batch.index not in found
                found[batch.index] = batch.dataset_ids.tolist()
        return found

    one, three = by_index(1, 12), by_index(3, 4)
    assert sorted(one) == sorted(three) == list(range(12)) and one == three
    first = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, grad_accum=6, seed=4)
    drain(first, 6)
    resumed = by_index(3, 2, first.state_dict(1))  # as a checkpoint after step 1 saves it
    assert resumed == {i: one[i] for i in range(6, 12)}


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (3, 2)])
def test_elastic_resume_continues_the_same_sequences(dataset, before, after):
    """A step is the same micro-batches on 1, 2 or 3 ranks (6 a step: grad_accum 6 / 3 / 2); a cursor saved on
    `before` ranks resumes on `after`, across the epoch's end, without repeating or skipping a sequence."""
    directory, _ = dataset

    def loaders(world):
        return [PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, rank=r, world_size=world,
                             grad_accum=6 // world, seed=4) for r in range(world)]

    def union(per_rank):  # the steps of all ranks, merged
        return [np.sort(np.concatenate(parts)) for parts in zip(*per_rank)]

    reference = loaders(1)[0]
    per_epoch = reference.planner.steps_per_epoch()
    assert per_epoch >= 4
    straight = union([_steps(reference, per_epoch + 3)])
    first = loaders(before)
    cut = per_epoch - 2
    head = union([_steps(loader, cut) for loader in first])
    states = [loader.state_dict(cut) for loader in first]
    assert all(state == states[0] for state in states)  # the cursor does not depend on the rank
    resumed = loaders(after)
    for loader in resumed:
        loader.load_state_dict(json.loads(json.dumps(states[0])))
    tail = union([_steps(loader, 5) for loader in resumed])
    for got, expected in zip(head + tail, straight):
        assert np.array_equal(got, expected)
    epoch0 = np.concatenate(straight[:per_epoch])
    assert len(np.unique(epoch0)) == len(epoch0)  # no sequence twice in an epoch
    assert reference.num_sequences - len(epoch0) < 6 * 128  # at most one step's worth left out


def test_the_cursor_of_a_step_survives_batches_drawn_ahead(dataset):
    """The trainer asks for the cursor after the step it finished while the next micro-batch is already drawn."""
    directory, _ = dataset
    make = lambda: PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, grad_accum=2, seed=6)  # noqa
    loader = make()
    it = iter(loader)
    drawn = [next(it) for _ in range(7)]  # steps 1-3 and the first micro-batch of step 4
    fresh = make()
    fresh.load_state_dict(loader.state_dict(3))
    again = next(iter(fresh))
    assert np.array_equal(again.dataset_ids, drawn[6].dataset_ids)
    for _ in range(2 * CURSORS_KEPT):
        next(it)
    with pytest.raises(FastmaeError, match="no cursor for step 0"):  # long forgotten: an error, not a wrong cursor
        loader.state_dict(0)


def test_token_ids_outside_the_vocabulary_are_named(dataset, tmp_path):
    """A shard holding an id >= vocab_size: caught from its metadata when opened, or (bytes changed behind the
    metadata's back) when a batch holding it is drawn; both errors name the shard."""
    import shutil

    directory = tmp_path / "ds"
    shutil.copytree(dataset[0], directory)
    tokens_path, _, meta_path = shard_files(directory, "train", "shard_00001")
    data = np.fromfile(tokens_path, dtype=np.uint16)
    data[5] = 60_000
    data.tofile(tokens_path)
    loader = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128)
    with pytest.raises(FastmaeError, match=f"{tokens_path}: token id 60000 is outside the vocabulary of 56"):
        drain(loader, loader.planner.steps_per_epoch())
    meta = json.loads(meta_path.read_text())
    meta["max_id"] = 60_000  # what prepare records for such a shard
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(FastmaeError, match=f"{tokens_path}: token id 60000 is outside the vocabulary of 56"):
        ShardSet(directory)


def test_resume_into_other_data_is_an_error(dataset):
    directory, _ = dataset
    state = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128).state_dict()
    with pytest.raises(FastmaeError, match="does not match"):
        PackedLoader(directory, max_seq_len=64, tokens_per_batch=128).load_state_dict(state)


# ------------------------------------------------------------------------------------------------- bad input
def copy_dataset(directory, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(directory, target)
    return target


def test_truncated_shard_is_named(dataset, tmp_path):
    directory = copy_dataset(dataset[0], tmp_path)
    tokens_file = shard_files(directory, "train", "shard_00001")[0]
    tokens_file.write_bytes(tokens_file.read_bytes()[:-6])
    with pytest.raises(FastmaeError, match=r"shard_00001.tokens: .* truncated or corrupt"):
        PackedLoader(directory)


def test_corrupt_shard_content_is_caught_by_checksum(dataset, tmp_path):
    directory = copy_dataset(dataset[0], tmp_path)
    tokens_file = shard_files(directory, "train", "shard_00000")[0]
    data = bytearray(tokens_file.read_bytes())
    data[10] ^= 0xFF
    tokens_file.write_bytes(bytes(data))
    PackedLoader(directory)  # sizes still agree
    with pytest.raises(FastmaeError, match="sha256"):
        PackedLoader(directory, verify_checksum=True)


@pytest.mark.parametrize("change", ["vanished", "rewritten"])
def test_a_shard_that_vanishes_or_changes_mid_run_is_named(dataset, tmp_path, change):
    """A shard deleted (its map may still be open: the old bytes would still read) or rewritten with other ids after
    the loader checked it: the next batch that reads it stops with the file named, and a loader opened on the
    restored file draws the same batches as before."""
    directory = copy_dataset(dataset[0], tmp_path)
    tokens_file = shard_files(directory, "train", "shard_00002")[0]
    original = tokens_file.read_bytes()
    steps = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128).planner.steps_per_epoch()
    expected = [b.tokens.tolist() for b in drain(PackedLoader(directory, max_seq_len=32, tokens_per_batch=128), steps)]
    loader = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128)
    drain(loader, 1)
    if change == "vanished":
        tokens_file.unlink()
        message = f"{tokens_file}: vanished during the run"
    else:
        tokens_file.write_bytes(bytes(b ^ 0x01 for b in original))  # same size, other ids
        message = f"{tokens_file}: changed during the run"
    with pytest.raises(FastmaeError, match=message):
        drain(loader, steps)
    tokens_file.write_bytes(original)
    restored = drain(PackedLoader(directory, max_seq_len=32, tokens_per_batch=128), steps)
    assert [b.tokens.tolist() for b in restored] == expected


def test_corrupt_document_index_is_named(dataset, tmp_path):
    directory = copy_dataset(dataset[0], tmp_path)
    docs_file = shard_files(directory, "train", "shard_00003")[1]
    docs_file.write_bytes(b"not numpy")
    with pytest.raises(FastmaeError, match="shard_00003.docs.npy"):
        PackedLoader(directory)


def test_missing_dataset_and_vocab_or_tokenizer_mismatch(dataset, tmp_path):
    with pytest.raises(FastmaeError, match="meta.json: missing"):
        PackedLoader(tmp_path / "nothing")
    data = ShardSet(dataset[0])
    with pytest.raises(FastmaeError, match="vocab_size=100"):
        data.check_vocab(100)
    with pytest.raises(FastmaeError, match="does not match the shards"):
        data.check_tokenizer("0" * 64, "other.model")


def test_reusing_a_foreign_tokenizer_is_checked(tmp_path):
    import sentencepiece as spm

    write_corpus(tmp_path / "c.txt", num_docs=60)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "c.txt"), model_prefix=str(tmp_path / "plain"),
                                   vocab_size=40, minloglevel=2)
    with pytest.raises(FastmaeError, match="special token ids"):
        prepare([tmp_path / "c.txt"], tmp_path / "ds", tokenizer_path=tmp_path / "plain.model", progress=False)


def test_empty_input_and_undecodable_bytes(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n   \n")
    with pytest.raises(FastmaeError, match="no documents"):
        prepare([tmp_path / "empty.txt"], tmp_path / "a", progress=False)
    write_corpus(tmp_path / "bad.txt", num_docs=80)
    with (tmp_path / "bad.txt").open("ab") as handle:
        handle.write(b"caf\xe9 au lait\n")
    with pytest.raises(FastmaeError, match=r"bad.txt:81: undecodable"):
        prepare([tmp_path / "bad.txt"], tmp_path / "b", vocab_size=40, progress=False)
    assert not (tmp_path / "b" / "meta.json").exists() and not (tmp_path / "b" / "train").exists()
    meta = prepare([tmp_path / "bad.txt"], tmp_path / "c", vocab_size=40, on_decode_error="skip", progress=False)
    assert meta["skipped"]["undecodable"] == 1


def test_missing_jsonl_field_fails_the_cli_in_one_line(tmp_path):
    (tmp_path / "in.jsonl").write_text('{"text": "a b c"}\n{"body": "d e f"}\n')
    proc = subprocess.run([*warm_python.COMMAND, "-m", "fastmae.prepare", "--input", str(tmp_path / "in.jsonl"),
                           "--format", "jsonl", "--output", str(tmp_path / "ds"), "--vocab-size", "20"],
                          capture_output=True, text=True, env=warm_python.environment())
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"fastmae prepare: error: {tmp_path / 'in.jsonl'}:2: no field "
                                                "'text' (use --field to name the text field)"]
    assert not (tmp_path / "ds" / "meta.json").exists()


def _compress(kind, data):
    import bz2
    import gzip

    import zstandard

    if kind == "zst":  # two frames, as concatenated .zst files are
        half = len(data) // 2
        return b"".join(zstandard.ZstdCompressor().compress(part) for part in (data[:half], data[half:]))
    return gzip.compress(data) if kind == "gz" else bz2.compress(data)


def _documents(directory):
    """Every document of a dataset's train split as a tuple of token ids, sorted."""
    return sorted(tuple(shard.tokens[a:b].tolist()) for shard in ShardSet(directory).shards
                  for a, b in zip(shard.offsets[:-1], shard.offsets[1:]))


def test_prepare_reads_directories_and_compressed_files(tmp_path):
    """A directory stands for its files at any depth matching --glob (hidden ones skipped); .gz, .bz2 and .zst
    (several frames) are read as streams and give the same dataset as the plain files."""
    docs = [" ".join(WORDS[i % 30:i % 30 + 6]) + f" {i}" for i in range(120)]
    parts = [docs[:30], docs[30:60], docs[60:90], docs[90:]]
    plain, packed = tmp_path / "plain", tmp_path / "corpus"
    plain.mkdir()
    for i, part in enumerate(parts):
        (plain / f"{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    for name, kind, part in [("a/0.jsonl.gz", "gz", parts[0]), ("a/b/1.jsonl.bz2", "bz2", parts[1]),
                             ("c/2.jsonl.zst", "zst", parts[2]), ("3.jsonl", None, parts[3])]:
        path = packed / name
        path.parent.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps({"text": d}) + "\n" for d in part).encode()
        path.write_bytes(_compress(kind, data) if kind else data)
    (packed / "README.md").write_text("not a corpus file")
    (packed / ".cache").mkdir()
    (packed / ".cache" / "9.jsonl").write_text(json.dumps({"text": "hidden"}) + "\n")
    kwargs = dict(fmt="jsonl", vocab_size=40, valid_fraction=0.0, workers=1, progress=False)
    prepare(sorted(plain.iterdir()), tmp_path / "want", **kwargs)
    got = prepare([packed], tmp_path / "got", glob="*.jsonl*", tokenizer_path=tmp_path / "want" / "tokenizer.model",
                  **kwargs)
    assert got["inputs"] == [str(packed / n) for n in ("3.jsonl", "a/0.jsonl.gz", "a/b/1.jsonl.bz2", "c/2.jsonl.zst")]
    assert got["splits"]["train"]["documents"] == 120
    assert _documents(tmp_path / "got") == _documents(tmp_path / "want")
    with pytest.raises(FastmaeError, match="no file matching --glob '[*].parquet'"):
        prepare([packed], tmp_path / "none", glob="*.parquet", **kwargs)


@pytest.mark.parametrize("kind", ["gz", "bz2", "zst"])
def test_a_truncated_archive_is_a_one_line_error_naming_it(tmp_path, kind):
    data = "".join(json.dumps({"text": f"{WORDS[i % 30]} {i}"}) + "\n" for i in range(3000)).encode()
    path = tmp_path / f"in.jsonl.{kind}"
    path.write_bytes(_compress(kind, data)[:-40])
    proc = subprocess.run([*warm_python.COMMAND, "-m", "fastmae.prepare", "--input", str(path), "--format", "jsonl",
                           "--output", str(tmp_path / "ds"), "--vocab-size", "30"], capture_output=True, text=True,
                          env=warm_python.environment())
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"fastmae prepare: error: {path}: corrupt or truncated")
    assert not (tmp_path / "ds" / "meta.json").exists()


def test_parquet_reads_the_named_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [" ".join(WORDS[i:i + 7]) for i in range(30)] * 3}), tmp_path / "x.parquet")
    with pytest.raises(FastmaeError, match="no column 'text'"):
        prepare([tmp_path / "x.parquet"], tmp_path / "ds", fmt="parquet", progress=False)
    meta = prepare([tmp_path / "x.parquet"], tmp_path / "ds", fmt="parquet", text_field="content", vocab_size=40,
                   valid_fraction=0.0, progress=False)
    assert meta["splits"]["train"]["documents"] == 90


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(FastmaeError, match="needs pyarrow"):
        prepare([tmp_path / "x.parquet"], tmp_path / "ds", fmt="parquet", progress=False)


def test_saved_hugging_face_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")  # optional: not in the dev extras
    texts = [" ".join(WORDS[i:i + 8]) for i in range(25)] * 4
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts})}).save_to_disk(str(tmp_path / "hf"))
    with pytest.raises(FastmaeError, match="no column 'text'"):
        prepare([tmp_path / "hf"], tmp_path / "ds", fmt="hf", progress=False)
    meta = prepare([tmp_path / "hf"], tmp_path / "ds", fmt="hf", text_field="body", vocab_size=40,
                   valid_fraction=0.0, progress=False)
    assert meta["splits"]["train"]["documents"] == 100


def test_more_shards_than_open_files_stay_within_the_open_file_limit(tmp_path):
    """350 one-document shards (two files each: 5x the limit), read under `ulimit -n 128`: token maps are opened on
    use and at most MAX_OPEN_SHARDS of them stay open, document offsets live in memory."""
    rng = np.random.default_rng(0)
    words = list(WORDS)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(" ".join(rng.choice(words, size=12)) + "\n" for _ in range(350)))
    prepare([corpus], tmp_path / "ds", vocab_size=40, valid_fraction=0.05, docs_per_shard=1, workers=1,
            progress=False)
    assert len(ShardSet(tmp_path / "ds").shards) >= 320
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from fastmae.data import PackedLoader

for split in ("train", "valid"):
    loader = PackedLoader({str(tmp_path / "ds")!r}, split=split, max_seq_len=32, tokens_per_batch=256)
    batches = iter(loader)
    tokens = sum(next(batches).num_tokens for _ in range(loader.planner.steps_per_epoch() + 3))  # past an epoch's end
    assert tokens > 0
print("ok")
"""
    done = subprocess.run([*warm_python.COMMAND, "-c", code], capture_output=True, text=True, timeout=600,
                          env=warm_python.environment())
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_batch_warm_up_grows_each_step_one_micro_batch_a_rank_at_a_time_and_resumes_mid_way(dataset):
    """train.batch_warmup_tokens (ModernBERT's batch-size warm-up): each step's micro-batches on every rank are
    `StepSizes.per_rank(step)`, growing by one from the start's to the full step's, each size held for the same
    number of steps (to a step) and the warm-up's steps holding its tokens (to one step's worth); the run indices that
    key the masks are each step's place in a full step's run (step x full + place: the same on any rank count, the
    warm-up's smaller steps leaving gaps), and a loader resumed mid-way draws what the uninterrupted one drew."""
    directory, _ = dataset
    sizes = StepSizes.warming_up(world=2, grad_accum=4, micro_tokens=128, warmup_tokens=6_000, warmup_from=300)
    counts = [sizes.per_rank(step) for step in range(sizes.ends[-1] + 3)]
    assert counts[0] == 1 and counts[-1] == 4 and sorted(counts) == counts
    held = [counts.count(size) for size in (1, 2, 3)]
    assert max(held) - min(held) <= 1
    warmup = sum(2 * 128 * count for count in counts[:sizes.ends[-1]])
    assert 6_000 <= warmup < 6_000 + 2 * 128 * 3
    assert sizes.describe(128, 100).endswith("(3 sizes below the full one), the full step from step 12")
    assert sizes.describe(128, 5).endswith("from step 12, cut by the run's end at step 5: the last step at 2 a rank, "
                                           "never the full batch")  # a continued run given the recipe's warm-up
    assert StepSizes(8, 2).describe(128, 100) == ""
    with pytest.raises(FastmaeError, match=r"train.batch_warmup_from=1024 is not below the full step's 4"):
        StepSizes.warming_up(world=2, grad_accum=4, micro_tokens=128, warmup_tokens=6_000, warmup_from=1024)

    def loader(rank, state=None):
        made = PackedLoader(directory, max_seq_len=32, tokens_per_batch=128, rank=rank, world_size=2, grad_accum=4,
                            seed=1, step_sizes=sizes)
        if state is not None:
            made.load_state_dict(state)
        return made

    def steps(rank, count, state=None):
        it = iter(loader(rank, state))
        start = 0 if state is None else state["step"]
        return [[next(it) for _ in range(sizes.per_rank(step))] for step in range(start, start + count)]

    drawn = {rank: steps(rank, 12) for rank in range(2)}
    indices = sorted(batch.index for rank in drawn for step in drawn[rank] for batch in step)
    assert indices == [8 * step + place for step in range(12) for place in range(sizes.count(step))]
    halfway = loader(0)
    drain(halfway, sum(counts[:5]))
    for rank in range(2):
        resumed = steps(rank, 7, halfway.state_dict(5))
        assert [[b.dataset_ids.tolist() for b in step] for step in resumed] == [
            [b.dataset_ids.tolist() for b in step] for step in drawn[rank][5:]]
