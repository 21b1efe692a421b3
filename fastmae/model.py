"""One masked-LM model for `mlm`, `mae-lm` and `3ml` on packed varlen batches (ARCHITECTURE.md section 1).

A step reads top to bottom in `MaskedLM.forward`: mask selection -> embeddings of the encoder's rows -> layers
[0, k) on visible rows -> insertion of the masked slots -> layers [k, L + d) on the full sequence (or, for the
`cross` decoder, on the masked rows) -> LM head and loss on the predicted rows only.
This module imports neither deepspeed nor torch.distributed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from . import ops
from .attention import VarlenMeta
from .batch import PackedBatch
from .config import ModelConfig
from .dropout import Dropout
from .flat import FlatParameters
from .layers import TransformerLayer, finish_stack, fused_norm_args, layer_norm, stack_dropout_keys, stream_views
from .masking import MaskedBatch, mask_batch, select_rows, unmasked
from .positions import relative_bias_by_distance


class PositionEmbedding(nn.Module):
    """Learned absolute positions, RoBERTa style: position p reads row p + position_offset."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.offset = config.position_offset
        self.weight = nn.Parameter(torch.empty(config.position_capacity + self.offset, config.hidden_size))

    def row_args(self, positions: torch.Tensor) -> dict:
        """The fused row ops' position arguments: the table, each row's position and the offset of position 0."""
        return dict(pos_table=self.weight, pos_ids=positions, pos_offset=self.offset)


def _position_args(module: PositionEmbedding | None, positions: torch.Tensor) -> dict:
    return {} if module is None else module.row_args(positions)


def _norm_args(norm: nn.LayerNorm | None) -> dict:
    return {} if norm is None else dict(zip(("ln_weight", "ln_bias", "eps"), fused_norm_args(norm)))


def _fused_dropout(dropout: Dropout, like: torch.Tensor) -> dict:
    """A row op's arguments for `dropout` hashed in its kernel (`ops.dropout_keys`: on the Triton path, a key drawn
    from torch's generator), or {} where the module runs after the op instead (off, the references, and autocast,
    under which the layers keep torch's dropout too)."""
    p = dropout.p if dropout.training and not torch.is_autocast_enabled(like.device.type) else 0.0
    key = ops.dropout_keys(like, 1, p)
    return {} if key is None else dict(dropout_p=p, key=key)


class Embeddings(nn.Module):
    """Token + learned position embedding, LayerNorm, dropout: the encoder's input (one fused gather)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.positions = PositionEmbedding(config) if config.position_embedding == "learned" else None
        self.norm = layer_norm(config)
        self.dropout = Dropout(config.dropout)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None,
                extra_row: int | None = None):
        """ids: int32; rows: [N] int32, the entries of ids to embed (None: all); positions: [N] int32 -> [N, H].
        With `extra_row`, also that row of the token table (the insertion's `<mask>` row): (rows, row)."""
        fused = _fused_dropout(self.dropout, self.tokens.weight)
        out = ops.embed_rows(self.tokens.weight, ids, rows=rows, extra_row=extra_row, **fused,
                             **_position_args(self.positions, positions), **_norm_args(self.norm))
        if fused:  # hashed in the kernel
            return out
        return self.dropout(out) if extra_row is None else (self.dropout(out[0]), out[1])


class Insertion(nn.Module):
    """Scatter the visible rows back to full length with the <mask> embedding in the removed rows.

    When layers follow (a decoder, or k < L), the full stream then gets its own position embedding and LayerNorm,
    as MAE-LM's decoder does; with no layer after it, the rows go to the head as they are.
    """

    def __init__(self, config: ModelConfig, has_own_embedding: bool, dropout: float):
        super().__init__()
        self.positions = None
        self.norm = None
        if has_own_embedding:
            if config.position_embedding == "learned":
                self.positions = PositionEmbedding(config)
            self.norm = layer_norm(config)
        self.dropout = Dropout(dropout)

    def forward(self, visible: torch.Tensor, masked: MaskedBatch, fill: torch.Tensor) -> torch.Tensor:
        """visible: [T_v, H] rows; fill: [H], the `<mask>` row (`Embeddings` hands it out) -> [T, H]."""
        sel = masked.selection
        fused = _fused_dropout(self.dropout, visible)
        x = ops.insert_rows(visible, sel.visible_index, sel.removed_index, fill, **fused,
                            **_position_args(self.positions, masked.batch.positions), **_norm_args(self.norm))
        return x if fused else self.dropout(x)


class LMHead(nn.Module):
    """dense -> GELU -> LayerNorm, then the projection tied to the token embeddings (+ bias), on predicted rows."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.linear_bias)
        self.norm = layer_norm(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The predicted rows' states before the projection: on CUDA the dense's GEMM, then bias + GELU and the
        LayerNorm in one fused kernel each way (`ops.linear_gelu`, `ops.layer_norm`); else torch's modules."""
        return ops.layer_norm(ops.linear_gelu(x, self.dense.weight, self.dense.bias), self.norm)


class MaskedLMOutput(NamedTuple):
    """loss: scalar fp32 mean cross-entropy over predicted rows. num_predicted: host int (T_m).
    masked: the masking of the batch. encoder_states: [T_v, H] (k > 0) or [T, H] (k = 0), the encoder output.
    num_correct: scalar int64 tensor of predicted rows whose argmax is the label (only with compute_accuracy).
    head_states: [T_m, H] the LM head's transformed predicted rows (what `correct_predictions` projects).

    A NamedTuple, not a dataclass: wrappers that hook a module's output tensors (ZeRO-3 re-gathers parameters for
    backward that way) look inside tuples, lists and dicts only."""

    loss: torch.Tensor
    num_predicted: int
    masked: MaskedBatch
    encoder_states: torch.Tensor
    num_correct: torch.Tensor | None = None
    head_states: torch.Tensor | None = None


class MaskedLM(nn.Module):
    """Encoder (L layers) + optional decoder (d layers) + tied LM head; `insert_layer` k picks the objective.

    The layers live in two stacks: `encoder` (L layers: [0, k) run on the visible rows, [k, L) on the full rows after
    the insertion) and `decoder` (d layers on the full rows, or the masked rows for `cross`). Pretraining (`forward`)
    and fine-tuning (`encode`) run the same `_encoder` path; `encode` merely masks nothing.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        k, n_enc = config.insert_layer, config.encoder_layers
        self.embeddings = Embeddings(config)
        self.encoder = nn.ModuleList(
            [TransformerLayer(config, config.dropout, config.attention_dropout, kind,
                              attention_norm=i > 0 or config.first_attention_norm)
             for i, kind in enumerate(config.layer_kinds)])
        self.decoder = nn.ModuleList(
            [TransformerLayer(config, config.decoder_dropout, config.decoder_dropout)
             for _ in range(config.decoder_layers)])
        # k = 0 inserts at the input (ids become <mask>, inside Embeddings); k > 0 has an insertion module.
        self.insertion = None
        if k > 0:
            self.insertion = Insertion(config, has_own_embedding=k < config.num_layers,
                                       dropout=config.decoder_dropout if k == n_enc else config.dropout)
        pre = config.norm_position == "pre"
        self.encoder_norm = layer_norm(config) if pre else None
        self.decoder_norm = layer_norm(config) if pre and config.decoder_layers else None
        self.head = LMHead(config)
        # MAE-LM's relative position bias: [buckets, heads], shared by the encoder layers (None when off)
        self.relative_bias = (nn.Parameter(torch.empty(config.relative_attention_buckets, config.num_heads))
                              if config.relative_attention_bias else None)
        self.activation_checkpointing = False  # recompute each layer in backward (set by the trainer)
        self.layers_compiled = False  # compile_layers ran: the layers' dropout is inductor's, drawn inside the graphs
        self.flat: FlatParameters | None = None  # the parameters held flat (fastmae.flat; set by fastmae.engine)
        self.graphs = None  # fastmae.graphs.StepGraphs when training replays recorded graphs (set by fastmae.engine)
        self.apply(self._init_weights)
        if self.relative_bias is not None:
            nn.init.normal_(self.relative_bias, std=config.initializer_range)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, PositionEmbedding):
            nn.init.normal_(module.weight, std=std)

    def functional_parameters(self) -> list[nn.Parameter]:
        """Parameters read outside their own module's forward (fused row ops, the tied projection, the head bias).

        Sharding that gathers parameters per module call (ZeRO-3) must treat these as used by the whole model. (The
        relative bias table, read by `_encoder`, is this module's own parameter: gathered for its forward anyway.)
        """
        modules = [self.embeddings] + ([self.insertion] if self.insertion is not None else [])
        return [p for m in modules for p in m.parameters()] + [self.head.bias]

    def compile_layers(self) -> None:
        """Regional compilation (train.compile): every transformer layer compiled with dynamic shapes, so the
        varying row counts of packed batches (T, T_v) reuse one graph. Masking, the fused row kernels and the fused
        loss stay eager around them: their Triton kernels never enter a graph."""
        for layer in [*self.encoder, *self.decoder]:
            layer.compile(dynamic=True)
        self.layers_compiled = True

    def set_attention_backend(self, backend: str | None) -> None:
        """Force one attention backend for every layer (None: automatic)."""
        for layer in [*self.encoder, *self.decoder]:
            layer.attention_backend = backend

    def _bind_parameters(self) -> None:
        """With flat parameters, point the modules' weights at the flat parameters as they are now (`forward` does
        this in a hook; `encode` is not a forward)."""
        if self.flat is not None:
            self.flat.bind()

    def _check(self, batch: PackedBatch) -> None:
        if batch.max_seqlen > self.config.position_capacity:
            raise ValueError(f"batch has a sequence of {batch.max_seqlen} tokens; the model holds "
                             f"{self.config.position_capacity} positions (max_seq_len, or max_positions)")

    def _run(self, layers: list[nn.Module] | nn.ModuleList, x: torch.Tensor, meta: VarlenMeta,
             states: list[torch.Tensor] | None = None, bias_by_distance: torch.Tensor | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `layers` in order on rows laid out by `meta` (recomputed in backward under activation checkpointing);
        append each layer's output to `states` when given. With `bias_by_distance` (relative_bias_by_distance) the
        layers add the relative position bias; local layers get their window instead (`layers.stream_views`).
        Returns the last layer's (rows, delta): pre-LN layers leave their residual add to the next norm
        (`layers.finish_stack` does the last)."""
        views = stream_views(self.config, layers, x, meta, bias_by_distance)
        delta = None
        for layer, keys in zip(layers, stack_dropout_keys(layers, x, self.layers_compiled)):
            layer_meta, bias = views[layer.kind]
            if self.activation_checkpointing and self.training:  # the recomputation gets the same keys
                x, delta = torch.utils.checkpoint.checkpoint(layer, x, layer_meta, None, None, bias, keys, delta,
                                                             use_reentrant=False)
            else:
                x, delta = layer(x, layer_meta, bias=bias, dropout_keys=keys, delta=delta)
            if states is not None:
                states.append(finish_stack(x, delta))
        return x, delta

    def _encoder(self, masked: MaskedBatch, states: list[torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The L encoder layers on a masked batch: embeddings of the encoder's rows, layers [0, k) on the visible
        rows, the insertion (when 0 < k < L), layers [k, L) on the full rows, and the pre-LN final norm.

        Returns [T_v, H] rows of the visible stream when k = L, else [T, H] rows of the full stream, and the
        `<mask>` row the insertion fills with (None when k = 0). `states`, when given, receives the embeddings'
        output and every layer's (the last one after the pre-LN final norm).
        """
        k, n_enc = self.config.insert_layer, self.config.encoder_layers
        layers = list(self.encoder)  # sliced as a list: a ModuleList's slice builds a new ModuleList
        sel = masked.selection
        fill = None
        if k == 0:  # the insertion at the input is "replace by <mask>": the selection already wrote those ids
            x = self.embeddings(sel.input_tokens, masked.batch.positions)
        else:
            x, fill = self.embeddings(sel.input_tokens, masked.visible.positions, rows=sel.visible_index,
                                      extra_row=self.config.mask_token_id)
        if states is not None:
            states.append(x)
        bias_by_distance = None  # looked up by original positions, so dropping tokens keeps every distance
        if self.relative_bias is not None:
            bias_by_distance = relative_bias_by_distance(self.relative_bias,
                                                         self.config.relative_attention_max_distance)
        delta = None
        if k > 0:
            x, delta = self._run(layers[:k], x, masked.visible, states, bias_by_distance)
            if k < n_enc:
                x, delta = self.insertion(finish_stack(x, delta), masked, fill), None
        if k < n_enc:
            x, delta = self._run(layers[k:], x, masked.full, states, bias_by_distance)
        x = finish_stack(x, delta, self.encoder_norm)
        if states is not None and self.encoder_norm is not None:
            states[-1] = x
        return x, fill

    def encode(self, batch: PackedBatch, all_layers: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """[T, H] encoder states of the unmasked batch (the fine-tuning path): the pretrained encoder's L layers,
        including the insertion's own positions and LayerNorm when 0 < k < L, with nothing masked.

        all_layers: return the L + 1 states instead (embeddings, then each layer), as `fastmae analyze` reads them.
        """
        self._check(batch)
        self._bind_parameters()
        states = [] if all_layers else None
        x = self._encoder(unmasked(batch, self.config), states)[0]
        return states if all_layers else x

    def forward(self, batch: PackedBatch | MaskedBatch, seed: int = 0, step: int = 0, rank: int = 0,
                compute_accuracy: bool = False) -> MaskedLMOutput:
        """The masked-token loss of a masked batch (`masking.mask_batch`, `masking.mask_rows`); a plain PackedBatch
        is masked here first, for (seed, step, rank). compute_accuracy also counts the predicted rows whose most
        likely token is the label."""
        cfg = self.config
        masked = batch if isinstance(batch, MaskedBatch) else mask_batch(batch, cfg, seed, step, rank)
        self._check(masked.batch)
        encoder_states, fill = self._encoder(masked)
        x = encoder_states
        if 0 < cfg.insert_layer == cfg.encoder_layers:  # k = L: the insertion feeds the decoder
            x = self.insertion(x, masked, fill)
        if cfg.decoder_kind == "cross":
            x = self._cross_decoder(x, masked)
        else:
            x = finish_stack(*self._run(self.decoder, x, masked.full), self.decoder_norm)
            x = select_rows(x, masked.selection.masked_index)
        return self._loss(x, masked, encoder_states, compute_accuracy)

    def _cross_decoder(self, inserted: torch.Tensor, masked: MaskedBatch) -> torch.Tensor:
        """3ML's cross decoder: only predicted rows are updated; each attends to the whole sequence, whose visible
        rows stay at their inserted encoder outputs and whose predicted rows hold the current states.
        Returns the [T_m, H] states of the predicted rows."""
        index = masked.selection.masked_index
        x = select_rows(inserted, index)
        for layer, keys in zip(self.decoder, stack_dropout_keys(self.decoder, x, self.layers_compiled)):
            context = inserted.index_copy(0, index.long(), x)
            x = finish_stack(*layer(x, masked.masked, context=context, meta_k=masked.full, dropout_keys=keys))
        return finish_stack(x, None, self.decoder_norm)

    def _loss(self, predicted: torch.Tensor, masked: MaskedBatch, encoder_states: torch.Tensor,
              compute_accuracy: bool) -> MaskedLMOutput:
        hidden = self.head(predicted)
        weight, labels = self.embeddings.tokens.weight, masked.selection.labels
        # a padded batch's count is the device's (its filler rows' labels are ignored): a recorded graph replays
        # every batch of its shape, whatever their counts
        num_counted = masked.num_predicted if masked.filler is None else None
        loss = ops.linear_cross_entropy(hidden, weight, self.head.bias, labels, num_counted=num_counted)
        out = MaskedLMOutput(loss=loss, num_predicted=masked.num_predicted, masked=masked,
                             encoder_states=encoder_states, head_states=hidden)
        return out._replace(num_correct=self.correct_predictions(out)) if compute_accuracy else out

    def correct_predictions(self, out: MaskedLMOutput) -> torch.Tensor:
        """Scalar int64 tensor: `out`'s predicted rows whose most likely token is the label (no gradient; a padded
        batch's dummy rows, labelled as ignored, never count). CUDA graphs' replays count from the replayed rows."""
        return count_correct(out.head_states.detach(), self.embeddings.tokens.weight, self.head.bias,
                             out.masked.selection.labels)


@torch.no_grad()
def count_correct(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Scalar int64 tensor: rows of `hidden` [T_m, H] whose most likely token under the tied projection (`weight`
    [V, H], `bias` [V]) is the label ([T_m]). Computed in row chunks: never a [T_m, V] fp32 tensor."""
    rows = max(1, 2**24 // weight.shape[0])
    num_correct = sum(
        (F.linear(h, weight.to(h.dtype), bias.to(h.dtype)).argmax(-1) == y.long()).sum()
        for h, y in zip(hidden.split(rows), labels.split(rows)))
    return torch.as_tensor(num_correct, device=hidden.device)
