"""The layers `MaskedLM` stacks (ARCHITECTURE.md section 1): the transformer layer, composed from the config (GELU or
GeGLU feed-forward, biases or none, pre- or post-LN, global or local attention), its LayerNorms, and the per-stream
views each kind of layer runs on. This module imports neither deepspeed nor torch.distributed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .attention import StreamBias, VarlenMeta, local_in_bands, resolve_backend, varlen_attention, window_of_rows
from .config import ModelConfig
from .dropout import Dropout
from .kernels import ResidualGrad
from .positions import rotary_tables, window_by_distance


def layer_norm(config: ModelConfig) -> nn.LayerNorm:
    """A LayerNorm of the model's width, with a bias unless `norm_bias` is off."""
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.norm_bias)


def fused_norm_args(norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(weight, bias, eps) of `norm` as the fused row kernels take them (zeros for a LayerNorm without a bias)."""
    return norm.weight, norm.bias if norm.bias is not None else torch.zeros_like(norm.weight), norm.eps


class TransformerLayer(nn.Module):
    """Bidirectional self-attention + feed-forward (GELU, or GeGLU with `ffn_gated`), post-LN (RoBERTa) or pre-LN,
    on packed rows; global, or local (`kind`): a window of original positions, which `MaskedLM._run` hands it as a
    position bias with its own rotary tables. Everything a layer varies by is settled here, from the config."""

    def __init__(self, config: ModelConfig, dropout: float, attention_dropout: float, kind: str = "global",
                 attention_norm: bool = True):
        super().__init__()
        h, bias = config.hidden_size, config.linear_bias
        self.num_heads, self.pre_norm, self.kind = config.num_heads, config.norm_position == "pre", kind
        self.gated = config.ffn_gated
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.attn_out = nn.Linear(h, h, bias=bias)
        self.attn_norm = layer_norm(config) if attention_norm else nn.Identity()
        self.ffn_in = nn.Linear(h, config.ffn_input_size, bias=bias)
        self.ffn_out = nn.Linear(config.intermediate_size, h, bias=bias)
        self.ffn_norm = layer_norm(config)
        self.dropout = Dropout(dropout)
        self.attention_dropout = attention_dropout
        self.attention_backend: str | None = None  # None: fastmae.attention picks per device

    def _attention(self, x: torch.Tensor, meta: VarlenMeta, context: torch.Tensor | None,
                   meta_k: VarlenMeta | None, bias: StreamBias | None,
                   residual_grad: ResidualGrad | None = None) -> torch.Tensor:
        rows, h = x.shape
        heads, head_dim = self.num_heads, h // self.num_heads
        if context is None:  # on CUDA one gathering kernel backward (the rotary undone in it), the residual's
            q, k, v = ops.project_qkv(x, self.qkv.weight, self.qkv.bias, heads, residual_grad,  # gradient added
                                      meta.rotary)                                           # in its GEMM
            meta_k = meta
        else:  # queries from x, keys and values from the context rows
            w_q, w_kv = self.qkv.weight.split([h, 2 * h])
            b_q, b_kv = (None, None) if self.qkv.bias is None else self.qkv.bias.split([h, 2 * h])
            q = F.linear(x, w_q, b_q).view(rows, heads, head_dim)
            k, v = F.linear(context, w_kv, b_kv).view(-1, 2, heads, head_dim).unbind(1)
            if meta.rotary is not None:
                q, k = ops.rotary_qk(q, k, *meta.rotary, *meta_k.rotary)
        out = varlen_attention(q, k, v, meta, meta_k, dropout_p=self.attention_dropout_p,
                               backend=self.attention_backend, bias=bias)
        return out.reshape(rows, h)  # before the output projection, which _add_norm applies

    @property
    def attention_dropout_p(self) -> float:
        """The attention dropout this layer applies now (none in eval mode)."""
        return self.attention_dropout if self.training else 0.0

    def biased_backend(self, x: torch.Tensor, window_rows: bool = False, window: bool = False) -> str:
        """The attention backend this layer runs with a position bias on rows like `x` (`window`: the bias is a local
        window; `window_rows`: over consecutive positions, attention.window_of_rows)."""
        return resolve_backend(self.attention_backend, x.device, self.attention_dropout_p, x.dtype, biased=True,
                               window_rows=window_rows, window=window)

    def _ffn_hidden(self, x: torch.Tensor, residual_grad: ResidualGrad | None = None) -> torch.Tensor:
        """The feed-forward's activation, before its output projection."""
        if self.gated:  # GeGLU: gelu(input) * gate (`ops.geglu`: one Triton kernel each way on CUDA)
            return ops.geglu(ops.linear(x, self.ffn_in))
        return ops.linear_gelu(x, self.ffn_in.weight, self.ffn_in.bias, residual_grad)  # one kernel on CUDA

    DROPOUT_KEYS = 2
    """The keys of fused dropout a layer's forward takes (`dropout_keys`): one for each norm after a sublayer."""

    def forward(self, x: torch.Tensor, meta: VarlenMeta, context: torch.Tensor | None = None,
                meta_k: VarlenMeta | None = None, bias: StreamBias | None = None,
                dropout_keys: torch.Tensor | None = None,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows, delta): x [rows, H] on layout `meta`, with `delta` the previous pre-LN layer's output still to be
        added to it. With `context` [T_k, H] (layout meta_k), queries attend to it instead. `bias`: a relative
        position bias added to the attention scores. Each sublayer's output projection, dropout, the residual add
        and the LayerNorm after it run as one op (`ops.add_layer_norm`: the projection and one Triton kernel on
        CUDA), its dropout hashed under one of `dropout_keys` (DROPOUT_KEYS of `ops.dropout_keys`, drawn for a whole
        stack of layers; without them each norm draws its own). A pre-LN layer returns its feed-forward's output
        as the delta, not added: the next layer's attention norm (or the stack's final norm, `finish_stack`) adds it
        in its own fused op; a post-LN layer returns no delta."""
        keys = [None] * self.DROPOUT_KEYS if dropout_keys is None else dropout_keys.split(1)
        if self.pre_norm:
            normed, x = _add_norm(delta, x, self.attn_norm, keep_sum=True) if delta is not None else (
                self.attn_norm(x), x)
            ctx = None if context is None else self.attn_norm(context)
            attended = self._attention(normed, meta, ctx, meta_k, bias)
            normed, x = _add_norm(attended, x, self.ffn_norm, self.attn_out, self.dropout, keep_sum=True,
                                  dropout_key=keys[0])
            return x, self.dropout(ops.linear(self._ffn_hidden(normed), self.ffn_out))
        # post-LN: each sublayer's input is also its norm's residual; the projection that reads it takes the
        # residual's gradient into its input-gradient GEMM on CUDA (kernels/residual.py), autograd adds no two
        handoff = ResidualGrad()
        x = _add_norm(self._attention(x, meta, context, meta_k, bias, handoff), x, self.attn_norm, self.attn_out,
                      self.dropout, residual_grad=handoff, dropout_key=keys[0])[0]
        handoff = ResidualGrad()
        return _add_norm(self._ffn_hidden(x, handoff), x, self.ffn_norm, self.ffn_out, self.dropout,
                         residual_grad=handoff, dropout_key=keys[1])[0], None


def finish_stack(x: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module | None = None) -> torch.Tensor:
    """The rows a stack of layers hands on from its last layer's (rows, delta): the residual add a pre-LN layer
    leaves pending, then `norm` (a pre-LN stack's final norm) where given, the two in one fused op."""
    if delta is None:
        return x if norm is None else norm(x)
    return x + delta if norm is None else _add_norm(delta, x, norm)[0]


def stack_dropout_keys(layers: list[nn.Module] | nn.ModuleList, x: torch.Tensor,
                       compiled: bool) -> list[torch.Tensor | None]:
    """Each of `layers`' keys of fused dropout (TransformerLayer.DROPOUT_KEYS) on rows like `x`, drawn for the whole
    stack in one op (`ops.dropout_keys`); Nones where no layer hashes its dropout (eval, torch's references, layers
    `compiled`, whose dropout is inductor's, and autocast, under which `_add_norm` keeps torch's add and norm)."""
    count = TransformerLayer.DROPOUT_KEYS
    p = max((layer.dropout.p for layer in layers if layer.training), default=0.0)
    unfused = compiled or torch.is_autocast_enabled(x.device.type)
    keys = None if unfused else ops.dropout_keys(x, count * len(layers), p)
    return [None] * len(layers) if keys is None else list(keys.split(count))


def _add_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module, projection: nn.Linear | None = None,
              dropout: Dropout | None = None, keep_sum: bool = False, residual_grad: ResidualGrad | None = None,
              dropout_key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm(dropout(projection(x)) + residual), the sum if keep_sum), without the projection or the dropout where
    none is given: one op for a LayerNorm whose inputs and weight share a dtype (its residual's gradient handed
    over where a projection claimed `residual_grad`, its dropout hashed under `dropout_key`), else the projection,
    the dropout, the add and the module (an Identity; under autocast, where dtypes mix and the norm runs in fp32)."""
    p = dropout.p if dropout is not None and dropout.training else 0.0
    if (isinstance(norm, nn.LayerNorm) and x.dtype == residual.dtype == norm.weight.dtype
            and (projection is None or projection.weight.dtype == x.dtype)
            and not torch.is_autocast_enabled(x.device.type)):
        return ops.add_layer_norm(x, residual, norm.weight, norm.bias, norm.eps, keep_sum, p,
                                  None if projection is None else (projection.weight, projection.bias),
                                  residual_grad, dropout_key)
    if projection is not None:
        x = projection(x)
    summed = (x if dropout is None else dropout(x)) + residual
    return norm(summed), summed


def stream_views(cfg: ModelConfig, layers: list[nn.Module] | nn.ModuleList, x: torch.Tensor, meta: VarlenMeta,
                 bias_by_distance: torch.Tensor | None) -> dict[str, tuple[VarlenMeta, StreamBias | None]]:
    """(layout, bias) of the stream for each kind of layer in `layers`, built once per stream: global layers get
    `meta` and the relative position bias if any; local layers the window of `local_window` original positions as
    a bias (in the form their backend reads) and the rotary tables of `local_rotary_base`."""
    views = {}
    for layer in layers:
        if layer.kind in views:
            continue
        table, layer_meta, window = bias_by_distance, meta, None
        if layer.kind == "local":
            window = cfg.local_half_window
            table = window_by_distance(window, cfg.num_heads, x.device)
            if meta.rotary is not None and cfg.local_rotary_base != cfg.rotary_base:
                layer_meta = meta._replace(rotary=rotary_tables(meta.positions, cfg.head_dim,
                                                                cfg.local_rotary_base))
        bias = None
        if table is not None:
            backend = layer.biased_backend(x, window_of_rows(layer_meta, layer_meta, window), window is not None)
            bias = StreamBias.build(table, layer_meta, layer_meta, backend, x.dtype, window)
        views[layer.kind] = (layer_meta, bias)
    return views


def local_streams(config: ModelConfig) -> tuple[bool, bool]:
    """(whether some local layer runs on a stream of consecutive positions, whether some runs on a shortened one):
    encoder layers [0, insert_layer) run on the visible stream, which skips the removed positions, when the
    insertion is inside the encoder; the others on the full stream."""
    kinds = config.layer_kinds
    early = kinds[:config.insert_layer]
    return "local" in kinds[len(early):], "local" in early


def local_backends(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                   dropout_p: float) -> dict[str, str]:
    """{'consecutive' | 'shortened': backend}: what `auto` gives the model's local layers on each kind of stream
    they run on (empty without local layers)."""
    consecutive, shortened = local_streams(config)
    backends = {}
    if consecutive:
        backends["consecutive"] = resolve_backend(None, device, dropout_p, dtype, biased=True, window_rows=True,
                                                  window=True)
    if shortened:
        backends["shortened"] = resolve_backend(None, device, dropout_p, dtype, biased=True, window=True)
    return backends


def local_attention_note(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """The log's line on which attention backend serves the local layers here, on which streams, and why (None
    without any)."""
    backends = local_backends(config, device, dtype, config.attention_dropout)
    if not backends:
        return None
    hows = []
    for stream, backend in backends.items():
        how = f"{backend!r}"
        if local_in_bands(backend, device, dtype):
            how += f" in bands of {config.local_half_window}-row blocks (fastmae.banded)"
        if stream == "consecutive":
            how += " on streams of consecutive positions" + (
                " (its window of rows is the window of positions)" if backend == "torch_flash" else "")
        else:
            how += " on the shortened stream (its rows skip positions: the window is a position bias)"
        hows.append(how)
    whole = (f" (sequences of at most {config.max_seq_len} tokens: each sees its whole sequence, as a global layer "
             "does, at a local layer's cost)" if config.local_half_window >= config.max_seq_len - 1 else "")
    return (f"local attention: {config.layer_kinds.count('local')} of {config.encoder_layers} encoder layers see the "
            f"tokens within {config.local_half_window} original positions of each token{whole}, on {'; '.join(hows)}")
