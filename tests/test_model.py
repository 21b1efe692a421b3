"""Tests that pin the method down (DESIGN.md section 1); each compares against an independent computation."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_batch, tiny_model
from reference_model import embed, encoder_forward, layer_forward

from fastmae import PackedBatch
from fastmae.config import SpecialTokens
from fastmae.masking import mask_batch

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains


def per_sequence(batch: PackedBatch, values: torch.Tensor):
    cu = batch.cu_seqlens.tolist()
    return [values[cu[i]:cu[i + 1]] for i in range(batch.num_sequences)]


VARIANTS = [
    pytest.param(dict(), id="learned-post"),
    pytest.param(dict(position_embedding="rotary"), id="rotary-post"),
    pytest.param(dict(norm_position="pre"), id="learned-pre"),
]


@pytest.mark.parametrize("preset", ["mlm", "mae-lm"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_masking_and_no_decoder_is_a_plain_encoder(preset, variant, batch):
    model = tiny_model(preset, decoder_layers=0, mask_rate=0.0, **variant)
    out = model(mask_batch(batch, model.config, seed=0, step=0))
    assert out.num_predicted == 0
    expected = torch.cat([encoder_forward(model, ids, pos)
                          for ids, pos in zip(per_sequence(batch, batch.tokens), per_sequence(batch, batch.positions))])
    torch.testing.assert_close(out.encoder_states, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.encode(batch), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("insert_layer", [0, 1, 2, 4])
@pytest.mark.parametrize("variant", VARIANTS)
def test_encode_runs_the_pretrained_encoder_for_every_insert_layer(insert_layer, variant, batch):
    # L = 4, k in {0, 1, L/2, L}: for 0 < k < L the insertion's own positions and LayerNorm are part of the encoder
    preset = "mlm" if insert_layer == 0 else "mae-lm"
    model = tiny_model(preset, encoder_layers=4, decoder_layers=0, insert_layer=insert_layer, mask_rate=0.0, **variant)
    states = model.encode(batch)
    expected = torch.cat([encoder_forward(model, ids, pos)
                          for ids, pos in zip(per_sequence(batch, batch.tokens), per_sequence(batch, batch.positions))])
    torch.testing.assert_close(states, expected, rtol=1e-5, atol=1e-5)
    states.square().sum().backward()  # every encoder parameter (the insertion's too when k < L) shapes the states
    unused = [name for name, p in model.named_parameters()
              if not name.startswith(("head.", "decoder")) and (p.grad is None or not p.grad.abs().sum() > 0)
              and not (name.startswith("insertion.") and insert_layer == 4)]
    assert unused == []


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_mlm_equals_replacing_by_mask_and_running_the_full_encoder(variant, seed, batch):
    model = tiny_model("mlm", mask_token_prob=1.0, random_token_prob=0.0, **variant)
    out = model(batch, seed=seed, step=2)
    sel = out.masked.selection
    replaced = batch.tokens.clone()
    replaced[sel.masked_index.long()] = FASTMAE.mask
    assert torch.equal(sel.input_tokens, replaced)
    hidden = model.encode(PackedBatch.from_packed(replaced.numpy(), batch.seqlens.numpy()))
    head = model.head
    logits = head(hidden[sel.masked_index.long()]) @ model.embeddings.tokens.weight.T + head.bias
    expected = F.cross_entropy(logits, batch.tokens[sel.masked_index.long()].long())
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_visible_tokens_keep_their_original_positions(variant, batch):
    model = tiny_model("3ml", initializer_range=0.3, **variant)  # large weights: sharp, position-sensitive attention
    out = model(batch, seed=4)
    sel = out.masked.selection
    visible = sel.visible_index.long()
    cu = out.masked.visible.cu_seqlens.tolist()
    ids, pos = batch.tokens[visible], batch.positions[visible]
    expected = torch.cat([encoder_forward(model, ids[cu[i]:cu[i + 1]], pos[cu[i]:cu[i + 1]])
                          for i in range(batch.num_sequences)])
    torch.testing.assert_close(out.encoder_states, expected, rtol=1e-5, atol=1e-5)
    # renumbering the visible tokens 0..n-1 (what a naive "drop and re-pack" would do) gives other states
    renumbered = torch.cat([encoder_forward(model, ids[cu[i]:cu[i + 1]], torch.arange(cu[i + 1] - cu[i]))
                            for i in range(batch.num_sequences)])
    assert (out.encoder_states - renumbered).abs().max() > 1e-2


def test_masked_slots_receive_the_mask_embedding_and_its_gradient(batch):
    model = tiny_model("mae-lm")
    captured = {}
    model.insertion.register_forward_hook(lambda mod, args, result: captured.setdefault("x", result))
    out = model(batch, seed=1)
    sel, cfg = out.masked.selection, model.config
    removed = sel.removed_index.long()
    ins = model.insertion
    mask_row = model.embeddings.tokens.weight[FASTMAE.mask]
    expected = F.layer_norm(mask_row + ins.positions.weight[batch.positions[removed] + 1],
                            (cfg.hidden_size,), ins.norm.weight, ins.norm.bias, cfg.layer_norm_eps)
    torch.testing.assert_close(captured["x"][removed], expected)
    visible = sel.visible_index.long()
    expected_visible = F.layer_norm(out.encoder_states + ins.positions.weight[batch.positions[visible] + 1],
                                    (cfg.hidden_size,), ins.norm.weight, ins.norm.bias, cfg.layer_norm_eps)
    torch.testing.assert_close(captured["x"][visible], expected_visible)
    out.loss.backward()
    assert model.embeddings.tokens.weight.grad[FASTMAE.mask].abs().sum() > 0


def test_mask_row_gradient_is_the_sum_over_removed_rows(batch):
    """The tied <mask> row's gradient is what the insertion sends it from every removed row (recomputed in plain
    torch from the gradient at the insertion's output) plus what the tied projection sends it."""
    model = tiny_model("mae-lm", decoder_layers=1)
    captured = {}

    def keep_output(module, args, result):
        result.retain_grad()
        captured["x"] = result

    model.insertion.register_forward_hook(keep_output)
    model.head.register_forward_hook(lambda module, args, result: captured.setdefault("h", args[0]))
    out = model(batch, seed=2)
    sel, cfg, ins = out.masked.selection, model.config, model.insertion
    removed = sel.removed_index.long()
    assert out.num_predicted == removed.numel() > 0
    out.loss.backward()
    w = model.embeddings.tokens.weight.detach().clone().requires_grad_()
    rows = F.layer_norm(w[FASTMAE.mask] + ins.positions.weight.detach()[batch.positions[removed] + 1],
                        (cfg.hidden_size,), ins.norm.weight.detach(), ins.norm.bias.detach(), cfg.layer_norm_eps)
    logits = model.head(captured["h"].detach()) @ w.T + model.head.bias
    loss = F.cross_entropy(logits, sel.labels.long())
    (grad_w,) = torch.autograd.grad([rows, loss], w, grad_outputs=[captured["x"].grad[removed], None])
    torch.testing.assert_close(model.embeddings.tokens.weight.grad[FASTMAE.mask], grad_w[FASTMAE.mask], rtol=1e-4,
                               atol=1e-7)


@pytest.mark.parametrize("preset, extra", [("mlm", {}), ("mae-lm", {}), ("3ml", {}), ("3ml", {"decoder_kind": "cross"}),
                                           ("mae-lm", {"position_embedding": "rotary"})])
def test_sequences_in_a_batch_do_not_see_each_other(preset, extra):
    model = tiny_model(preset, **extra)
    a, b, c = (tiny_batch(1, seed=s) for s in (10, 11, 12))
    seqs = lambda *bs: [bt.tokens.tolist() for bt in bs]  # noqa: E731
    # the first sequence gets the same rows, hence the same mask, in both batches; its neighbours differ
    first = PackedBatch.from_sequences(seqs(a, b, c))
    second = PackedBatch.from_sequences(seqs(a, c, b, b))
    head_inputs = []  # the decoder's output at the predicted rows, in row order
    model.head.register_forward_hook(lambda mod, args, result: head_inputs.append(args[0]))
    out1, out2 = model(first, seed=3), model(second, seed=3)
    n1 = out1.masked.counts.predicted[0]
    assert n1 > 0 and torch.equal(out1.masked.selection.masked_index[:n1], out2.masked.selection.masked_index[:n1])
    v = int(out1.masked.visible.cu_seqlens[1])
    torch.testing.assert_close(out1.encoder_states[:v], out2.encoder_states[:v], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head_inputs[0][:n1], head_inputs[1][:n1], rtol=1e-5, atol=1e-6)
    # and without masking, the encoder is equivariant to any reordering of the batch
    order = [2, 0, 1]
    enc = per_sequence(first, model.encode(first))
    reordered = PackedBatch.from_sequences([seqs(a, b, c)[i] for i in order])
    enc2 = per_sequence(reordered, model.encode(reordered))
    for i, j in enumerate(order):
        torch.testing.assert_close(enc2[i], enc[j], rtol=1e-5, atol=1e-6)


def test_cross_decoder_with_one_layer_equals_self_decoder_on_masked_rows(batch):
    cross = tiny_model("3ml", decoder_layers=1, decoder_kind="cross", seed=5)
    plain = tiny_model("3ml", decoder_layers=1, decoder_kind="self", seed=5)
    plain.load_state_dict(cross.state_dict())
    torch.testing.assert_close(cross(batch, seed=1).loss, plain(batch, seed=1).loss, rtol=1e-5, atol=1e-6)
    # from the second layer on, the self decoder's visible rows move and the cross decoder's do not
    two = tiny_model("3ml", decoder_layers=2, decoder_kind="cross", seed=5, initializer_range=0.3)
    two_self = tiny_model("3ml", decoder_layers=2, decoder_kind="self", seed=5, initializer_range=0.3)
    two_self.load_state_dict(two.state_dict())
    assert (two(batch, seed=1).loss - two_self(batch, seed=1).loss).abs() > 1e-3


def test_cross_decoder_matches_naive_computation(batch):
    model = tiny_model("3ml", decoder_layers=2, decoder_kind="cross")
    captured = {}
    model.insertion.register_forward_hook(lambda mod, args, result: captured.setdefault("x", result))
    out = model(batch, seed=6)
    cfg, sel = model.config, out.masked.selection
    inserted, masked_rows = captured["x"], sel.masked_index.long()
    predicted = []
    for b in range(batch.num_sequences):
        lo, hi = batch.cu_seqlens[b].item(), batch.cu_seqlens[b + 1].item()
        rows = masked_rows[(masked_rows >= lo) & (masked_rows < hi)]
        full, x = inserted[lo:hi], inserted[rows]
        for layer in model.decoder:
            context = full.index_copy(0, rows - lo, x)
            x = layer_forward(layer, x, batch.positions[rows], cfg, context, batch.positions[lo:hi])
        predicted.append(x)
    hidden = model.head(torch.cat(predicted))
    expected = F.cross_entropy(hidden @ model.embeddings.tokens.weight.T + model.head.bias, sel.labels.long())
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["mlm", "mae-lm", "3ml"])
def test_same_seed_same_loss_other_step_or_rank_other_loss(preset, batch):
    model = tiny_model(preset)
    ref = model(batch, seed=9, step=4, rank=0).loss
    assert torch.equal(ref, model(batch, seed=9, step=4, rank=0).loss)
    assert not torch.equal(ref, model(batch, seed=9, step=5, rank=0).loss)
    assert not torch.equal(ref, model(batch, seed=9, step=4, rank=1).loss)


@pytest.mark.parametrize("preset", ["mlm", "mae-lm", "3ml"])
def test_fp32_and_bf16_autocast_agree(preset):
    batch = tiny_batch(8, seed=2)
    model = tiny_model(preset)
    out32 = model(batch, seed=1)
    out32.loss.backward()
    grads32 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out16 = model(batch, seed=1)
    out16.loss.backward()
    # bf16 keeps 8 bits of mantissa: the loss (fp32 cross-entropy of bf16 logits) within 1%, states within 5%
    torch.testing.assert_close(out16.loss, out32.loss, rtol=1e-2, atol=0)
    err = (out16.encoder_states.float() - out32.encoder_states).norm() / out32.encoder_states.norm()
    assert err < 5e-2, err
    g16 = torch.cat([p.grad.flatten() for p in model.parameters()])
    g32 = torch.cat([g.flatten() for g in grads32])
    assert (g16 - g32).norm() / g32.norm() < 5e-2


def test_embedding_of_the_first_token_row_uses_robertas_offset(batch):
    model = tiny_model("mlm")
    x = model.embeddings(batch.tokens[:3], batch.positions[:3])
    torch.testing.assert_close(x, embed(model, batch.tokens[:3], batch.positions[:3]))
    assert model.embeddings.positions.weight.shape[0] == model.config.max_seq_len + 1


def test_too_long_sequence_is_an_error():
    model = tiny_model("mlm", max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(PackedBatch.from_sequences([list(range(5, 15))]))


def test_activation_checkpointing_changes_nothing_but_memory(batch):
    model = tiny_model("3ml", dropout=0.1, attention_dropout=0.1).train()
    results = []
    for checkpointing in (False, True):
        model.activation_checkpointing = checkpointing
        model.zero_grad()
        torch.manual_seed(7)  # same dropout masks; checkpoint replays the RNG in the recomputation
        out = model(batch, seed=1)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_attention_backend_can_be_forced_per_model(batch):
    model = tiny_model("3ml")
    model.set_attention_backend("reference")
    reference = model(batch, seed=3).loss
    model.set_attention_backend("padded")
    torch.testing.assert_close(model(batch, seed=3).loss, reference, rtol=1e-5, atol=1e-6)
    model.set_attention_backend("magic")
    with pytest.raises(ValueError, match="magic"):
        model(batch, seed=3)


@pytest.mark.parametrize("preset", ["mlm", "mae-lm", "3ml"])
def test_relative_bias_model_trains_its_table_and_backends_agree(preset):
    """With model.relative_attention_bias every encoder layer adds the one shared table's bias (the decoder none):
    padded SDPA, the math path and the per-sequence reference give the same loss and gradients, and the table gets
    a gradient."""
    from fastmae import MaskedLM, ModelConfig

    config = ModelConfig.preset(preset, vocab_size=60, hidden_size=32, num_heads=4, encoder_layers=2, max_seq_len=64,
                                relative_attention_bias=True, dropout=0.0, attention_dropout=0.0)
    batch = tiny_batch(num_sequences=6, seed=2, vocab_size=60)
    results = []
    for backend in ("reference", "padded", "math"):
        torch.manual_seed(0)
        model = MaskedLM(config)
        model.set_attention_backend(backend)
        out = model(batch, seed=1, step=0)
        out.loss.backward()
        results.append((out.loss.detach(), model.relative_bias.grad.clone(),
                        model.embeddings.tokens.weight.grad.clone()))
    (loss_ref, table_ref, emb_ref), *others = results
    assert table_ref.abs().sum() > 0
    for loss, table, emb in others:
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(table, table_ref, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(emb, emb_ref, rtol=1e-4, atol=1e-6)
    assert model.relative_bias.shape == (64, 4)
    # the bias changes what the encoder computes (it is not a no-op); `encode` (fine-tuning) applies it too
    with torch.no_grad():
        model.relative_bias.zero_()
        without = model.encode(batch)
        model.relative_bias.normal_(std=1.0)
        assert (model.encode(batch) - without).abs().max() > 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_relative_bias_on_cuda_takes_compiled_flex_attention_like_the_reference():
    """On CUDA without attention dropout the biased encoder runs FlexAttention (compiled; here inside compiled
    layers too, as train.compile does): loss and gradients (the bias table's included) equal the per-sequence
    reference's, and batches of other lengths reuse the compiled graphs."""
    import torch._dynamo

    from fastmae import MaskedLM, ModelConfig
    from fastmae.attention import resolve_backend

    assert resolve_backend(None, torch.device("cuda"), 0.0, torch.bfloat16, biased=True) == "flex"
    assert resolve_backend(None, torch.device("cuda"), 0.1, torch.bfloat16, biased=True) == "padded"
    config = ModelConfig.preset("mae-lm", vocab_size=60, hidden_size=64, num_heads=4, encoder_layers=2,
                                max_seq_len=160, relative_attention_bias=True, dropout=0.0, attention_dropout=0.0)
    batches = [tiny_batch(num_sequences=n, seed=n, vocab_size=60, max_len=150).to("cuda") for n in (9, 14, 11, 6, 12)]
    torch._dynamo.reset()
    results = {}
    for backend, compiled in (("reference", False), (None, True)):
        torch.manual_seed(0)
        model = MaskedLM(config).cuda()
        model.set_attention_backend(backend)
        if compiled:
            model.compile_layers()
        for i, batch in enumerate(batches):
            out = model(batch, seed=1, step=i)
            out.loss.backward()
            if i == 1:  # warmed up: the first batches may turn sizes dynamic
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results[backend] = (out.loss.detach(), model.relative_bias.grad.clone(),
                            model.embeddings.tokens.weight.grad.clone())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "recompiled for another batch"
    torch._dynamo.reset()
    for got, want in zip(results[None], results["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
