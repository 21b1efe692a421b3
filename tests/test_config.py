import pytest

from fastmae import ModelConfig


def test_presets_match_the_design():
    mlm = ModelConfig.preset("mlm")
    assert (mlm.insert_layer, mlm.decoder_layers, mlm.mask_rate) == (0, 0, 0.15)
    assert (mlm.mask_token_prob, mlm.random_token_prob) == (0.8, 0.1)
    mae = ModelConfig.preset("mae-lm")
    assert (mae.insert_layer, mae.decoder_layers, mae.mask_rate, mae.mask_token_prob) == (12, 4, 0.15, 1.0)
    assert mae.decoder_dropout == 0.0
    base = ModelConfig.preset("3ml")
    large = ModelConfig.preset("3ml", encoder_layers=24, hidden_size=1024, num_heads=16)
    assert (base.insert_layer, base.decoder_layers, base.mask_rate) == (12, 2, 0.5)
    assert (large.insert_layer, large.decoder_layers, large.intermediate_size) == (24, 3, 4096)


def test_overrides_follow_the_encoder_depth():
    cfg = ModelConfig.preset("mae-lm", encoder_layers=6, decoder_layers=2)
    assert (cfg.insert_layer, cfg.decoder_layers) == (6, 2)
    assert ModelConfig.preset("mlm").replace(hidden_size=256, num_heads=4).intermediate_size == 1024


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(hidden_size=100, num_heads=12), "hidden_size"),
        (dict(insert_layer=13), "insert_layer"),
        (dict(mask_rate=1.5), "mask_rate"),
        (dict(decoder_kind="sideways"), "decoder_kind"),
        (dict(vocab_size=4), "vocab_size"),
        (dict(mask_token_prob=0.9, random_token_prob=0.2), "random_token_prob"),
        (dict(position_embedding="rotary", hidden_size=36, num_heads=4), "num_heads"),
        (dict(max_seq_len=2), "model.max_seq_len=2: must leave room for <s>, a token and </s>"),
        (dict(max_positions=-1), "model.max_positions=-1: must be >= 0"),
    ],
)
def test_bad_values_name_the_field(overrides, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.preset("mlm", **overrides)


def test_decoder_needs_insertion_at_the_top():
    with pytest.raises(ValueError, match="decoder_layers"):
        ModelConfig.preset("mae-lm", insert_layer=3)


@pytest.mark.parametrize("preset, overrides", [
    ("mae-lm", dict(encoder_layers=2, decoder_layers=0)),  # study objective `mae-lm:decoder_layers=0`
    ("3ml", dict(encoder_layers=2, decoder_layers=0)),
    ("3ml", dict(encoder_layers=2, insert_layer=2, decoder_layers=0)),  # study objective `k=L`
    ("3ml", dict(encoder_layers=2, decoder_layers=0, mask_token_prob=0.5, random_token_prob=0.2)),
])
def test_objectives_whose_removed_tokens_see_no_context_are_refused(preset, overrides):
    with pytest.raises(ValueError, match=r"insert_layer=2 with encoder_layers=2 and decoder_layers=0: no layer runs"):
        ModelConfig.preset(preset, **overrides)


@pytest.mark.parametrize("preset, overrides", [
    ("3ml", dict(encoder_layers=2, insert_layer=1, decoder_layers=0)),  # mask later: layer 1 sees the context
    ("mae-lm", dict(encoder_layers=2, decoder_layers=1)),
    ("mae-lm", dict(encoder_layers=2, decoder_layers=0, mask_rate=0.0)),  # predicts nothing: the fine-tuning encoder
    ("3ml", dict(encoder_layers=2, decoder_layers=0, mask_token_prob=0.0, random_token_prob=1.0)),  # none removed
    ("mlm", dict(encoder_layers=1)),
])
def test_objectives_whose_predicted_tokens_see_context_are_accepted(preset, overrides):
    assert not ModelConfig.preset(preset, **overrides).removed_rows_see_no_context


def test_unknown_preset_and_field_are_rejected():
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("bert")
    with pytest.raises(ValueError, match="hiden_size"):
        ModelConfig.preset("mlm", hiden_size=3)
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig.preset("mlm").replace(num_heads="12")
