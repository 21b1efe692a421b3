"""A naive, per-sequence re-implementation of the encoder/decoder math, written independently of fastmae.model.

It reads the weights of a MaskedLM and recomputes with explicit loops over sequences and plain softmax attention,
so the tests can check the packed varlen model against textbook transformer math.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary on [heads, n, d] by absolute positions [n] (rotate-half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def layer_forward(layer, x: torch.Tensor, positions: torch.Tensor, config, context=None, context_positions=None):
    """One TransformerLayer on one sequence x [n, H] (queries) and context [m, H] (keys/values; x if None)."""
    h, heads = config.hidden_size, config.num_heads
    d = h // heads
    pre = config.norm_position == "pre"
    ln_a = lambda t: F.layer_norm(t, (h,), layer.attn_norm.weight, layer.attn_norm.bias, config.layer_norm_eps)  # noqa
    ln_f = lambda t: F.layer_norm(t, (h,), layer.ffn_norm.weight, layer.ffn_norm.bias, config.layer_norm_eps)  # noqa
    ctx = x if context is None else context
    ctx_pos = positions if context is None else context_positions
    a_in, c_in = (ln_a(x), ln_a(ctx)) if pre else (x, ctx)
    w, b = layer.qkv.weight, layer.qkv.bias
    q = (a_in @ w[:h].T + b[:h]).view(-1, heads, d).transpose(0, 1)
    k = (c_in @ w[h:2 * h].T + b[h:2 * h]).view(-1, heads, d).transpose(0, 1)
    v = (c_in @ w[2 * h:].T + b[2 * h:]).view(-1, heads, d).transpose(0, 1)
    if config.position_embedding == "rotary":
        q, k = _rotate(q, positions, config.rotary_base), _rotate(k, ctx_pos, config.rotary_base)
    att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1) @ v
    att = att.transpose(0, 1).reshape(-1, h) @ layer.attn_out.weight.T + layer.attn_out.bias
    ffn = lambda t: F.gelu(t @ layer.ffn_in.weight.T + layer.ffn_in.bias) @ layer.ffn_out.weight.T + layer.ffn_out.bias  # noqa
    if pre:
        x = x + att
        return x + ffn(ln_f(x))
    x = ln_a(x + att)
    return ln_f(x + ffn(x))


def embed(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Encoder embedding of one sequence: token + learned position rows, LayerNorm."""
    cfg = model.config
    emb = model.embeddings
    x = emb.tokens.weight[ids.long()]
    if cfg.position_embedding == "learned":
        x = x + emb.positions.weight[positions.long() + cfg.pad_token_id + 1]
    return F.layer_norm(x, (cfg.hidden_size,), emb.norm.weight, emb.norm.bias, cfg.layer_norm_eps)


def encoder_forward(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The first L layers on one sequence (ids and their position ids), with the pre-LN final norm if any.

    For 0 < k < L the insertion sits before layer k: with nothing removed it adds its own position rows and applies
    its own LayerNorm (the network that was pretrained)."""
    cfg = model.config
    x = embed(model, ids, positions)
    for index, layer in enumerate(model.encoder):
        if 0 < index == cfg.insert_layer:
            insertion = model.insertion
            if cfg.position_embedding == "learned":
                x = x + insertion.positions.weight[positions.long() + cfg.pad_token_id + 1]
            x = F.layer_norm(x, (cfg.hidden_size,), insertion.norm.weight, insertion.norm.bias, cfg.layer_norm_eps)
        x = layer_forward(layer, x, positions, cfg)
    if model.encoder_norm is not None:
        x = model.encoder_norm(x)
    return x
