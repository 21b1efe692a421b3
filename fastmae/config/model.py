"""Model configuration: one dataclass for `mlm`, `mae-lm` and `3ml` (ARCHITECTURE.md section 1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError
from .fields import apply_overrides, did_you_mean
from .tokens import ROLES, SpecialTokens


@dataclass
class ModelConfig:
    """Architecture and masking objective of a `MaskedLM`.

    The unifying knob is `insert_layer` k: layers [0, k) run on visible tokens only, the insertion puts the
    masked slots back, and layers [k, encoder_layers + decoder_layers) run on the full sequence.
    """

    objective: str = "mlm"
    """Name of the preset this config came from (`mlm`, `mae-lm`, `3ml`); informational."""
    vocab_size: int = 32000
    """Rows of the token-embedding table, specials included (the tokenizer's size)."""
    hidden_size: int = 768
    """Model width H."""
    num_heads: int = 12
    """Attention heads; `hidden_size` must be divisible by it."""
    intermediate_size: int = 0
    """Feed-forward width; 0 means 4 * hidden_size."""
    encoder_layers: int = 12
    """L: the layers kept for fine-tuning."""
    decoder_layers: int = 0
    """d: shallow decoder layers after the encoder, discarded after pretraining."""
    insert_layer: int = 0
    """k in [0, L]: where masked slots re-enter. 0 is RoBERTa MLM, L is MAE-LM / 3ML."""
    decoder_kind: str = "self"
    """`self`: decoder layers attend over the full sequence. `cross`: only masked rows are updated; their queries
    attend to the whole sequence (encoder outputs at visible rows). Needs insert_layer == encoder_layers."""
    max_seq_len: int = 512
    """Longest sequence, in tokens (specials included)."""
    max_positions: int = 0
    """Positions the model holds where more than max_seq_len (0: none more): a continued run's on shorter sequences."""
    position_embedding: str = "learned"
    """`learned` (RoBERTa absolute, exportable to Hugging Face) or `rotary` (applied by original position id)."""
    rotary_base: float = 10000.0
    """Base of the rotary frequencies (only with position_embedding=rotary)."""
    relative_attention_bias: bool = False
    """T5-style relative position bias in the encoder's attention (MAE-LM's reference encoder): one table of
    [buckets, heads] shared by all encoder layers, looked up by original positions; the decoder has none."""
    relative_attention_buckets: int = 64
    """Buckets of the relative bias (per direction: a quarter exact, then log-spaced; the reference's bucketing,
    fastmae.positions.relative_position_buckets). The reference: 64 (base), 128 (large)."""
    relative_attention_max_distance: int = 128
    """Distances from max_distance - 1 on share the last bucket; the reference: 128 (base), 256 (large)."""
    norm_position: str = "post"
    """`post` (RoBERTa, BERT) or `pre` LayerNorm in each layer."""
    ffn_gated: bool = False
    """GeGLU feed-forward (ModernBERT): the input projection makes 2 x intermediate_size, and gelu(first half) x
    (second half) feeds the output projection. False: GELU of one intermediate_size projection (RoBERTa)."""
    linear_bias: bool = True
    """Biases in the attention and feed-forward projections and the head's dense layer (ModernBERT: none)."""
    norm_bias: bool = True
    """A bias (beta) in every LayerNorm (ModernBERT: none)."""
    first_attention_norm: bool = True
    """Pre-LN only: whether encoder layer 0 normalises its attention input (ModernBERT's does not: the embeddings'
    LayerNorm serves)."""
    global_attention_every: int = 1
    """Encoder layer i attends over its whole sequence when i % global_attention_every == 0, else to the tokens
    within `local_window` / 2 of its own *original* position (ModernBERT: 3). 1: every layer global."""
    local_window: int = 0
    """A local layer's window: each token sees the tokens within local_window / 2 original positions either side of
    its own (ModernBERT's `local_attention`: 128, 64 each side). Even; 0 without local layers."""
    local_rotary_base: float = 10000.0
    """Rotary base of the local layers (the global layers use rotary_base; ModernBERT: 10000 and 160000)."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon everywhere."""
    dropout: float = 0.1
    """Hidden dropout in the encoder (and its embeddings)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities in the encoder."""
    decoder_dropout: float = 0.0
    """Hidden and attention dropout in the decoder (MAE-LM uses 0)."""
    mask_rate: float = 0.15
    """Share of each sequence predicted (exact count: round(rate * (length - 2)), at most its maskable tokens); with
    mask_rate_end, the rate at the run's first step."""
    mask_rate_end: float = -1.0
    """A masking-rate schedule's rate at the run's last step (-1: none, mask_rate throughout). The rate moves from
    mask_rate by `mask_rate_shape`, in whole percents (fastmae/schedule.py: MaskRates); for mae-lm and 3ml the share
    removed from the encoder follows it. Evaluation keeps eval.mask_rate."""
    mask_rate_shape: str = "linear"
    """`linear` (mask_rate to mask_rate_end over the run, in steps of one percent) or `step` (mask_rate until
    mask_rate_switch of the run, then mask_rate_end)."""
    mask_rate_switch: float = 0.5
    """`step` schedules: the share of the run's steps after which mask_rate_end applies."""
    mask_token_prob: float = 0.8
    """Share of the predicted tokens whose input is removed / replaced by <mask>."""
    random_token_prob: float = 0.1
    """Share of the predicted tokens replaced by a random ordinary token (the rest keep their token)."""
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    pad_token_id: int = SpecialTokens.pad
    """The tokenizer's special ids (set from the dataset, like vocab_size): padding; learned positions start at
    pad_token_id + 1, as in Hugging Face RoBERTa."""
    bos_token_id: int = SpecialTokens.bos
    """The token that starts every sequence (`<s>`, `[CLS]`); never masked."""
    eos_token_id: int = SpecialTokens.eos
    """The token that ends every sequence and separates documents and pair halves (`</s>`, `[SEP]`); never masked."""
    unk_token_id: int = SpecialTokens.unk
    """The unknown token: maskable, but never drawn as a random replacement."""
    mask_token_id: int = SpecialTokens.mask
    """`<mask>`: the input of a masked row at k = 0, and the embedding re-inserted at the insertion."""

    def __post_init__(self):
        if self.intermediate_size == 0:
            self.intermediate_size = 4 * self.hidden_size
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError naming the first field with a bad value (`check_model_config`)."""
        check_model_config(self)

    # ----------------------------------------------------------------- helpers
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """`global` or `local` per encoder layer (decoder layers are global: they must see every inserted slot's
        sequence, and see it once, which a shallow decoder cannot do through windows)."""
        return tuple("global" if i % self.global_attention_every == 0 else "local" for i in range(self.encoder_layers))

    @property
    def local_half_window(self) -> int:
        """How many original positions a local layer's token sees on each side (ModernBERT's local_attention / 2)."""
        return self.local_window // 2

    @property
    def ffn_input_size(self) -> int:
        """Width of the feed-forward's input projection: 2 x intermediate_size when gated."""
        return self.intermediate_size * (2 if self.ffn_gated else 1)

    @property
    def special_tokens(self) -> SpecialTokens:
        """The five special ids, by role."""
        return SpecialTokens(**{role: getattr(self, f"{role}_token_id") for role in ROLES})

    @property
    def num_layers(self) -> int:
        """All layers, encoder and decoder."""
        return self.encoder_layers + self.decoder_layers

    @property
    def removed_rows_see_no_context(self) -> bool:
        """Whether tokens removed at the insertion are predicted without any layer after it (k > 0 and
        k == L + d): their head inputs are then all the one `<mask>` embedding, whatever the sequence says."""
        removes = self.mask_rate > 0 and self.mask_token_prob > 0
        return removes and self.insert_layer > 0 and self.insert_layer == self.num_layers

    @property
    def position_capacity(self) -> int:
        """Positions the model reads (a learned table's rows) and an export declares: max_seq_len or more."""
        return max(self.max_seq_len, self.max_positions)

    @property
    def position_offset(self) -> int:
        """Learned position ids start at pad_token_id + 1, as in Hugging Face RoBERTa, so exported tables match."""
        return self.pad_token_id + 1

    def describe(self) -> str:
        """The objective and the network's shape, for the run's log and an export's model card."""
        return (f"objective `{self.objective}`: insertion at layer {self.insert_layer} of {self.encoder_layers}, "
                f"{self.decoder_layers} decoder layer(s); {self.norm_position}-LN layers, {self.position_embedding} "
                f"positions; width {self.hidden_size}, {self.num_heads} heads, vocabulary {self.vocab_size}, "
                f"sequences up to {self.max_seq_len} tokens" + (f" of the {self.position_capacity} positions it "
                                                                 "holds" if self.max_positions else ""))

    def replace(self, **overrides) -> ModelConfig:
        """A copy with `overrides` applied and validated (a default feed-forward width follows `hidden_size`)."""
        if "hidden_size" in overrides and "intermediate_size" not in overrides and (
            self.intermediate_size == 4 * self.hidden_size
        ):
            overrides = {**overrides, "intermediate_size": 0}
        return apply_overrides(self, overrides)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """The config saved as `dataclasses.asdict(config)` (derived fields are dropped)."""
        return cls(**{k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(cls) if f.init}})

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """The config of objective `name` (`mlm`, `mae-lm`, `3ml`) at base size, with `overrides` applied.

        A `3ml` preset's decoder depth follows the encoder depth (2 layers under 24 encoder layers, else 3),
        unless `decoder_layers` is overridden.
        """
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        base = dict(PRESETS[name])
        layers = overrides.get("encoder_layers", ModelConfig.encoder_layers)
        if name in ("mae-lm", "3ml"):
            # The insertion sits at the top of the encoder unless the caller moves it.
            base["insert_layer"] = layers
        if name == "3ml":
            base["decoder_layers"] = 3 if layers >= 24 else 2
        base.update(overrides)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        if unknown := sorted(set(base) - known):  # the nearest of each, a model section's `preset` among them
            named = ", ".join(key + did_you_mean(key, known | {"preset"}, "model.") for key in unknown)
            raise ConfigError(f"unknown model field(s) {named}; known: {sorted(known)}")
        return cls(**base)


def check_model_config(config: ModelConfig) -> None:
    """Raise ConfigError naming the first field of `config` with a bad value."""
    def bad(key, msg):
        raise ConfigError(f"model.{key}={getattr(config, key)!r}: {msg}")

    for key in ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "encoder_layers", "max_seq_len"):
        if not isinstance(getattr(config, key), int) or getattr(config, key) <= 0:
            bad(key, "must be a positive integer")
    if config.vocab_size <= len(ROLES):
        bad("vocab_size", f"must exceed the {len(ROLES)} special tokens")
    ids = config.special_tokens.as_fields()
    for key, token_id in ids.items():
        if not isinstance(token_id, int) or not 0 <= token_id < config.vocab_size:
            bad(key, f"must be a token id in [0, vocab_size={config.vocab_size})")
    if len(set(ids.values())) < len(ids):
        raise ConfigError(f"model special token ids {ids}: the five roles need five different ids")
    if config.hidden_size % config.num_heads:
        bad("hidden_size", f"must be divisible by num_heads={config.num_heads}")
    if config.position_embedding == "rotary" and (config.hidden_size // config.num_heads) % 2:
        bad("num_heads", "rotary positions need an even head dimension")
    if not isinstance(config.decoder_layers, int) or config.decoder_layers < 0:
        bad("decoder_layers", "must be an integer >= 0")
    if not isinstance(config.insert_layer, int) or not 0 <= config.insert_layer <= config.encoder_layers:
        bad("insert_layer", f"must be in [0, encoder_layers={config.encoder_layers}]")
    if config.decoder_layers and config.insert_layer != config.encoder_layers:
        bad("decoder_layers", f"a decoder needs insert_layer == encoder_layers ({config.encoder_layers})")
    if config.decoder_kind not in ("self", "cross"):
        bad("decoder_kind", "must be 'self' or 'cross'")
    if config.decoder_kind == "cross" and config.decoder_layers == 0:
        bad("decoder_kind", "'cross' needs decoder_layers > 0")
    if config.removed_rows_see_no_context:
        raise ConfigError(
            f"model.insert_layer={config.insert_layer} with encoder_layers={config.encoder_layers} and "
            f"decoder_layers={config.decoder_layers}: no layer runs after the insertion, so every removed token "
            f"reaches the LM head as the same <mask> embedding and can learn only token frequencies; use "
            f"decoder_layers >= 1 or insert_layer < encoder_layers (or mask_rate=0 for an encoder that "
            f"predicts nothing)")
    if config.max_seq_len < 3:
        bad("max_seq_len", "must leave room for <s>, a token and </s>")
    if config.max_positions < 0:
        bad("max_positions", "must be >= 0 (0: the model holds max_seq_len positions)")
    if config.relative_attention_buckets < 4 or config.relative_attention_buckets % 2:
        bad("relative_attention_buckets", "must be an even number >= 4")
    if config.relative_attention_max_distance <= config.relative_attention_buckets // 4 + 1:
        bad("relative_attention_max_distance",
            "must exceed relative_attention_buckets / 4 + 1 (past the exact distances)")
    if config.position_embedding not in ("learned", "rotary"):
        bad("position_embedding", "must be 'learned' or 'rotary'")
    if config.norm_position not in ("post", "pre"):
        bad("norm_position", "must be 'post' or 'pre'")
    if not config.first_attention_norm and config.norm_position != "pre":
        bad("first_attention_norm", "false needs norm_position=pre (a post-LN layer has no attention input norm)")
    if not isinstance(config.global_attention_every, int) or config.global_attention_every < 1:
        bad("global_attention_every", "must be an integer >= 1")
    if config.global_attention_every > 1 and config.encoder_layers > 1:
        if not isinstance(config.local_window, int) or config.local_window < 2 or config.local_window % 2:
            bad("local_window", "local layers (global_attention_every > 1) need an even window of >= 2 tokens")
        if config.relative_attention_bias:
            bad("relative_attention_bias", "true cannot be combined with local layers (global_attention_every > 1)")
    for key in ("dropout", "attention_dropout", "decoder_dropout", "mask_token_prob", "random_token_prob"):
        if not 0.0 <= getattr(config, key) <= 1.0:
            bad(key, "must be in [0, 1]")
    if not 0.0 <= config.mask_rate < 1.0:
        bad("mask_rate", "must be in [0, 1)")
    if config.mask_rate_end != -1.0 and not 0.0 <= config.mask_rate_end < 1.0:
        bad("mask_rate_end", "must be in [0, 1), or -1 for no masking schedule")
    if config.mask_rate_shape not in ("linear", "step"):
        bad("mask_rate_shape", "must be 'linear' or 'step'")
    if config.mask_rate_end != -1.0 and config.mask_rate_shape == "linear":
        for key in ("mask_rate", "mask_rate_end"):  # a linear schedule moves in whole percents
            if abs(100 * getattr(config, key) - round(100 * getattr(config, key))) > 1e-9:
                bad(key, "a linear masking-rate schedule runs between whole percents (0.3, 0.15, ...)")
    if not 0.0 < config.mask_rate_switch < 1.0:
        bad("mask_rate_switch", "must be in (0, 1)")
    if config.mask_token_prob + config.random_token_prob > 1.0 + 1e-9:
        bad("random_token_prob", f"mask_token_prob + random_token_prob must be <= 1 (got {config.mask_token_prob})")


PRESETS: dict[str, dict] = {
    # RoBERTa: [MASK] at the input, 15%, 80/10/10.
    "mlm": dict(objective="mlm", insert_layer=0, decoder_layers=0, mask_rate=0.15, mask_token_prob=0.8,
                random_token_prob=0.1),
    # MAE-LM (Meng et al., ICLR 2024): 4-layer decoder of encoder width, dropout 0, masked tokens all removed.
    "mae-lm": dict(objective="mae-lm", decoder_layers=4, mask_rate=0.15, mask_token_prob=1.0, random_token_prob=0.0,
                   decoder_dropout=0.0),
    # 3ML (Liao et al., 2022): 50% removed; 2 (base) / 3 (large) decoder layers, see ARCHITECTURE.md section 1.
    "3ml": dict(objective="3ml", mask_rate=0.5, mask_token_prob=1.0, random_token_prob=0.0, decoder_dropout=0.0),
}
