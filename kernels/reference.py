"""The plain-torch references of fastmae.kernels: the CPU path, the oracle of the tests, the benchmarks' baseline.

Each has the signature of its Triton twin (`select_masked`, `embed_rows`, `insert_rows`, `linear_cross_entropy`, in
the module of the same topic) and imports no Triton, so fastmae trains on CPU where Triton is not installed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .hashing import hashed_keep, row_uniform_bits

# ------------------------------------------------------------------------------------------ masked selection


class MaskSelection(NamedTuple):
    """What the selection produces; all int32 on the tokens' device.

    input_tokens [T]: the input ids after corruption (random replacements applied, removed rows set to <mask>).
    masked_index [T_m]: rows that are predicted, ascending; labels [T_m]: their original ids.
    visible_index [T_v]: rows that stay in the encoder stream, ascending; removed_index [T_r]: the others, ascending.
    """

    input_tokens: torch.Tensor
    masked_index: torch.Tensor
    labels: torch.Tensor
    visible_index: torch.Tensor
    removed_index: torch.Tensor


def _compact(flags: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending indices of the True entries of `flags`, whose number `count` the host already knows (no sync)."""
    slot = torch.where(flags, torch.cumsum(flags, 0) - 1, count)  # rows not taken all land in the spare slot
    out = torch.empty(count + 1, dtype=torch.int32, device=flags.device)
    out.scatter_(0, slot, torch.arange(flags.numel(), dtype=torch.int32, device=flags.device))
    return out[:count]


def rank_within_sequences(bits: torch.Tensor, seq_ids: torch.Tensor, maskable: torch.Tensor,
                          cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] int64 rank of each row within its sequence: maskable rows first, ordered by `bits` [T] (int64 in
    [0, 2^32)), ties by row; unmaskable rows after them. Choosing ranks < n picks n maskable rows at random."""
    num_rows = bits.numel()
    sort_key = (seq_ids.to(torch.int64) << 33) | ((~maskable).to(torch.int64) << 32) | bits
    order = torch.argsort(sort_key, stable=True)
    rank = torch.empty(num_rows, dtype=torch.int64, device=bits.device)
    rank[order] = torch.arange(num_rows, device=bits.device) - cu_seqlens[seq_ids[order].long()].long()
    return rank


def select_masked_reference(tokens: torch.Tensor, cu_seqlens: torch.Tensor, seq_ids: torch.Tensor,
                            maskable: torch.Tensor, num_removed: torch.Tensor, num_random: torch.Tensor,
                            num_predicted: torch.Tensor, total_predicted: int, total_removed: int,
                            score_key: int, replace_key: int, mask_token_id: int,
                            ordinary_ids: torch.Tensor, max_seqlen: int) -> MaskSelection:
    """Choose, per sequence, exactly `num_predicted[b]` maskable rows uniformly at random (plain torch).

    tokens, seq_ids, maskable: [T] (int32, int32, bool). cu_seqlens: [B+1] int32.
    num_removed, num_random, num_predicted: [B] int64 on the tokens' device, with removed + random <= predicted
    <= maskable per sequence; total_predicted and total_removed are their sums, known on the host.
    Rows are ranked within their sequence by the hash of (row, score_key), unmaskable rows last, ties by row.
    Ranks [0, removed) are removed (input mask_token_id), [removed, removed + random) get a random id of
    `ordinary_ids` (int32 on the tokens' device: the ids that are no special token) drawn with replace_key,
    [.., predicted) keep their id; all of them are predicted.
    max_seqlen (host int) sizes the GPU kernels' launch; the reference does not need it.
    """
    num_rows = tokens.numel()
    device = tokens.device
    rank = rank_within_sequences(row_uniform_bits(num_rows, score_key, device), seq_ids, maskable, cu_seqlens)
    seq = seq_ids.long()
    removed = rank < num_removed[seq]
    randomised = ~removed & (rank < (num_removed + num_random)[seq])
    predicted = rank < num_predicted[seq]

    random_ids = ordinary_ids[row_uniform_bits(num_rows, replace_key, device) % ordinary_ids.numel()]
    input_tokens = torch.where(randomised, random_ids.to(tokens.dtype), tokens)
    input_tokens = torch.where(removed, torch.full_like(tokens, mask_token_id), input_tokens)
    masked_index = _compact(predicted, total_predicted)
    return MaskSelection(
        input_tokens=input_tokens,
        masked_index=masked_index,
        labels=tokens.index_select(0, masked_index),
        visible_index=_compact(~removed, num_rows - total_removed),
        removed_index=_compact(removed, total_removed),
    )


# ------------------------------------------------------------------------------------ row gather and scatter


def _layer_norm_fp32(x, weight, bias, eps):
    """LayerNorm computed in at least fp32 (as the kernel does), whatever the dtypes of x and the parameters."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    return F.layer_norm(x.to(dtype), x.shape[-1:], weight.to(dtype), bias.to(dtype), eps)


def _hashed_dropout(x, p, key):
    """x with `hashed_keep`'s dropout at probability p under `key` (x itself at p = 0)."""
    if not p:
        return x
    kept, scale = hashed_keep(x.shape[0], x.shape[1], p, key)
    return x.masked_fill(~kept, 0.0) * scale


def embed_rows_reference(table, ids, pos_table=None, pos_ids=None, ln_weight=None, ln_bias=None, eps=1e-5, *,
                         rows=None, pos_offset=0, extra_row=None, dropout_p=0.0, key=None):
    """`embed_rows` in plain torch."""
    x = F.embedding((ids if rows is None else ids.index_select(0, rows)).long(), table)
    if pos_table is not None:
        x = x + F.embedding(pos_ids.long() + pos_offset, pos_table)
    if ln_weight is not None:
        x = _layer_norm_fp32(x, ln_weight, ln_bias, eps)
    x = _hashed_dropout(x.to(table.dtype), dropout_p, key)
    return x if extra_row is None else (x, table[extra_row])


def table_gradient_reference(rows, ids, num_table_rows, dtype, extra_row=None, d_extra=None, *, out=None,
                             accumulate=False):
    """`table_gradient`'s twin: torch's embedding backward in fp32, `d_extra` added at row `extra_row`, one cast;
    written into `out` or, with `accumulate`, added to it (as autograd adds two gradients) where given."""
    grad = torch.ops.aten.embedding_dense_backward(rows.float(), ids.long(), num_table_rows, -1, False)
    if d_extra is not None:
        grad[extra_row] += d_extra.float()
    grad = grad.to(dtype)
    if out is None:
        return grad
    return out.copy_(out + grad if accumulate else grad)


def insert_rows_reference(visible, visible_index, removed_index, fill, pos_table=None, pos_ids=None, ln_weight=None,
                          ln_bias=None, eps=1e-5, *, pos_offset=0, dropout_p=0.0, key=None):
    """`insert_rows` in plain torch."""
    total = visible.shape[0] + removed_index.shape[0]
    out = visible.new_empty(total, visible.shape[1])
    out = out.index_copy(0, visible_index.long(), visible)
    out = out.index_copy(0, removed_index.long(), fill.reshape(-1).to(visible.dtype).expand(removed_index.shape[0], -1))
    if pos_table is not None:
        out = out + F.embedding(pos_ids.long() + pos_offset, pos_table)
    if ln_weight is not None:
        out = _layer_norm_fp32(out, ln_weight, ln_bias, eps)
    return _hashed_dropout(out.to(visible.dtype), dropout_p, key)


# ------------------------------------------------------------------------------------------- cross-entropy


def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                   labels: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                                   z_loss: float = 0.0, num_counted: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of `x @ weight.T + bias` against `labels` (plain torch; materialises the logits).

    x: [N, H] (predicted rows only). weight: [V, H] (the tied token embeddings). bias: [V] or None.
    labels: [N] integer ids; rows equal to `ignore_index` are skipped and not counted. label_smoothing: as in
    F.cross_entropy. z_loss: weight of the mean squared log-sum-exp (PaLM's z-loss). num_counted: the number of rows
    not ignored, when the caller knows it on the host (the device then counts nothing). Logits in x's dtype, the loss
    in fp32. Returns a scalar fp32 tensor, 0 (not NaN) when no row counts.
    """
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    labels = labels.long()
    keep = labels != ignore_index
    count = keep.sum().clamp(min=1) if num_counted is None else max(num_counted, 1)
    safe = torch.where(keep, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    nll = lse - logits.gather(1, safe[:, None])[:, 0]
    per_row = (1.0 - label_smoothing) * nll + label_smoothing * (lse - logits.mean(dim=-1)) + z_loss * lse * lse
    return torch.where(keep, per_row, 0.0).sum() / count


# ------------------------------------------------------------------------------------------------- rotary
def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by its rows' tables cos, sin [T, head_dim / 2] (rotate-half layout), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotary_qk_reference(q, k, cos_q, sin_q, cos_k, sin_k) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_qk` in plain torch."""
    return apply_rotary_reference(q, cos_q, sin_q), apply_rotary_reference(k, cos_k, sin_k)


# ------------------------------------------------------------------------------------------- add + LayerNorm
def project_qkv_reference(x, weight, bias, heads, *, rotary=None):
    """`project_qkv` in plain torch: (x W^T + b) split into q, k, v of `heads` heads each (bias may be None), q and
    k rotated by `rotary`'s (cos, sin) where given."""
    q, k, v = F.linear(x, weight, bias).view(x.shape[0], 3, heads, -1).unbind(1)
    return (q, k, v) if rotary is None else (*rotary_qk_reference(q, k, *rotary, *rotary), v)


def add_layer_norm_reference(x, residual, weight, bias, eps=1e-5, keep_sum=False, dropout_p=0.0, key=None,
                             x_bias=None):
    """`add_layer_norm` in plain torch: the hashed dropout of x (+ x_bias) under `key` where dropout_p > 0
    (`hashed_keep`)."""
    if x_bias is not None:
        x = x + x_bias
    x = _hashed_dropout(x, dropout_p, key)
    summed = x + residual
    return F.layer_norm(summed, summed.shape[-1:], weight, bias, eps), summed if keep_sum else None


def layer_norm_reference(x, weight, bias, eps=1e-5):
    """`layer_norm` in plain torch."""
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


def geglu_reference(a):
    """`geglu` in plain torch: gelu(x) * gate for rows a = [x | gate]."""
    x, gate = a.chunk(2, dim=-1)
    return F.gelu(x) * gate


def bias_gelu_reference(a, bias):
    """`bias_gelu` in plain torch: gelu(a + bias)."""
    return F.gelu(a + bias)


def local_attention_reference(q, k, v, cu_seqlens, positions, max_seqlen=None, window=0, scale=None):
    """Softmax attention of q over k, v [T, heads, D] within each sequence (cu_seqlens [B+1]) where a query sees the
    keys whose positions are within `window` of its own: one sequence at a time, [L, L] scores, in q's dtype.
    max_seqlen is unused (the kernel's signature)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
        pos = positions[start:end].long()
        far = (pos[:, None] - pos[None, :]).abs() > window
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill(far, float("-inf"))
        outs.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty(q.shape)
