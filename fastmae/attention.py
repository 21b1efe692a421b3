"""Varlen attention over packed sequences, with its backends and rotary positions (ARCHITECTURE.md section 4).

Backends (`auto` picks per device, dtype, dropout and stream: `resolve_backend`):
- `torch_flash`: torch's own FlashAttention-2 varlen kernels (fastmae.flash; CUDA, a plain-torch twin on CPU), with
  attention dropout and a window of rows. `auto`'s choice on CUDA in fp16/bf16 for a global layer on a stream whose
  sequences differ in length (no padding), and for a local layer with attention dropout on a stream whose rows are
  consecutive positions (mlm's input, the decoder's full stream, fine-tuning), where its window of rows is the
  window of positions.
- `flash`: flash_attn.flash_attn_varlen_func (CUDA, the optional `gpu` extra; only when asked for).
- `torch_varlen`: torch.nn.attention.varlen.varlen_attn (CUDA, in torch; no attention dropout; only when asked for).
- `triton_window`: fastmae's own local-attention kernel (fastmae.kernels.local_attention; CUDA, or CPU under the
  Triton interpreter): a local window by original position on any stream, each (query, key) pair masked by the
  rows' positions, blocks outside every window skipped; no attention dropout. `auto`'s choice on CUDA in fp16/bf16
  for a local layer without attention dropout, on any stream: one whose rows skip positions (3ml's and mae-lm's
  encoder before the insertion), where FlashAttention's window of rows is not the window, and one of consecutive
  positions, where it measured faster than FlashAttention's window (see CUDA_LOCAL_BACKEND).
- `flex`: torch's FlexAttention, compiled (CUDA; fastmae.flex): the document mask as a block mask and the relative
  position bias as a score_mod; no attention dropout. The default with a relative bias (not a window) on CUDA when
  attention dropout is 0. On CPU torch runs it eagerly and forward only (never chosen automatically there).
- `nested`: torch SDPA over nested jagged tensors (any device; on CUDA meant to reach the flash kernel with dropout
  and no padding, but measured slower than `padded`: see CUDA_RECTANGULAR_BACKEND).
- `padded`: torch SDPA over a padded view with a key mask (any device). On CPU the default without attention
  dropout (see CPU_BACKEND), where a local layer's window runs in bands of rows instead (fastmae.banded); on CUDA
  the default for a global layer on a rectangular stream (every sequence max_seqlen rows: the view is free), where
  SDPA runs cuDNN's attention (see CUDA_RECTANGULAR_BACKEND), and for fp32.
- `math`: softmax(QK^T + key mask) V over the padded view with fastmae.dropout on the probabilities. The CPU default
  with attention dropout, where SDPA falls back to its own math path and torch's slow CPU dropout.
- `reference`: a per-sequence softmax loop, the oracle of the tests (slow, never chosen automatically).
Override with the `backend` argument or the FASTMAE_ATTENTION environment variable.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .banded import Band, banded_attention
from .dropout import drop_mask
from .flash import flash_varlen
from .flex import document_block_mask, flex_varlen
from .streams import VarlenMeta

BACKENDS = ("auto", "torch_flash", "flash", "torch_varlen", "triton_window", "flex", "padded", "nested", "math",
            "reference")
# Measured by benchmarks/attention.py (results in benchmarks/results/attention.md), forward + backward on a 2-core
# CPU: padded SDPA beat nested jagged SDPA at every shape tried, and `math` beat padded SDPA whenever attention
# dropout is on (SDPA's CPU flash kernel takes no dropout).
CPU_BACKEND, CPU_DROPOUT_BACKEND = "padded", "math"
# CUDA, fp16/bf16, a global layer on a rectangular stream (no padding in the view): padded SDPA runs cuDNN's fused
# attention, which beat FlashAttention-2's varlen kernels there (scripts/flash_probe.py on an H100, torch 2.11,
# 128 x 512 rows, 12 heads of 64, forward + backward: 1.90 ms against 2.21 with attention dropout 0.1, 1.42 against
# 1.97 without; 128 x 256: 0.68 against 0.75). On a ragged stream the view pads every sequence to the longest, and
# the varlen kernels win (128 sequences of 64-512 rows: 1.20 ms). Nested jagged SDPA measured far slower (a base mlm
# step 0.194 s against 0.045 s padded, an H100).
CUDA_RECTANGULAR_BACKEND, CUDA_RAGGED_BACKEND = "padded", "torch_flash"
# CUDA, fp16/bf16, a local layer without attention dropout, on any stream. On a stream whose rows skip positions
# FlexAttention measured 1.39x a global layer (ModernBERT-base's 3ml, an H100, 2026-11-26) and its block mask, built
# in the forward, kept modern-3ml's steps from replaying as CUDA graphs (GPU busy 0.75 of the step, an H200); fastmae's
# own kernel builds nothing per step. On a stream of consecutive positions it also beat torch's FlashAttention-2
# window at ModernBERT-base's 128 x 512 rows (an H200 at f6d59b9, benchmarks/local_attention.py, one run: forward
# 0.49 ms against 0.80, forward + backward 2.47 against 2.90), which keeps the layers with attention dropout.
CUDA_LOCAL_BACKEND = "triton_window"
# A local layer's window on CPU's padded SDPA runs in bands (fastmae.banded) in these dtypes. Measured by
# benchmarks/local_attention.py (benchmarks/results/local_attention.md), forward + backward at ModernBERT-base's
# attention: in bf16 the band beat the window as a dense mask on every stream; in fp32 it lost on shortened and
# padded streams (its copies cost more than the pairs it skips), so fp32 keeps the dense mask.
BAND_DTYPES = (torch.bfloat16, torch.float16)


def local_in_bands(backend: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a local layer's window on `backend` runs in bands of rows (fastmae.banded) on `device` in `dtype`."""
    return backend == "padded" and torch.device(device).type == "cpu" and dtype in BAND_DTYPES

_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


class StreamBias(NamedTuple):
    """The relative position bias (MAE-LM's encoder) between a query stream and a key stream, looked up by the rows'
    *original* positions, so dropping tokens keeps every distance. Built once per step and stream pair, outside the
    layers (compiled layers take it as an input, like VarlenMeta), in the form `backend` reads: for padded SDPA and
    math the `dense` attention mask (a local window on CPU: the `band`), for flex the document `block_mask` (its
    score_mod reads by_distance), for torch_flash (a window on a stream of consecutive positions: the kernel's
    window of rows) and the reference neither.
    """

    backend: str
    by_distance: torch.Tensor  # [2 * max_distance + 1, heads] fp32, relative_bias_by_distance
    dense: torch.Tensor | None  # [B, heads, S_q, S_k] in the attention dtype over the padded views, -inf at padded keys
    block_mask: object | None  # torch.nn.attention.flex_attention.BlockMask
    window: int | None = None  # the bias is exactly a local window of this many positions either side
    band: Band | None = None  # padded SDPA's form of a window on CPU, in place of `dense` (fastmae.banded)

    @classmethod
    def build(cls, by_distance: torch.Tensor, mq: VarlenMeta, mk: VarlenMeta, backend: str,
              dtype: torch.dtype, window: int | None = None) -> StreamBias:
        """The bias for attention from stream `mq` to stream `mk` on `backend` with q, k, v in `dtype`. `window`: the
        bias is exactly a local window of that many positions either side (`positions.window_by_distance`), so flex's
        block mask holds all of it: blocks wholly outside are skipped, and no score_mod runs."""
        if backend not in BIAS_BACKENDS:
            raise ValueError(f"attention backend {backend!r} takes no relative position bias; choose one of "
                             f"{BIAS_BACKENDS} (or model.relative_attention_bias=false)")
        bias = cls(backend, by_distance, None, None, window)
        if backend == "triton_window" and (window is None or mq is not mk):
            raise ValueError("attention backend 'triton_window' takes a position bias only as a local window of "
                             "self-attention (its kernel masks pairs by their positions)")
        if backend == "torch_flash" and not window_of_rows(mq, mk, window):
            raise ValueError("attention backend 'torch_flash' takes a position bias only as a local window over a "
                             "stream whose rows are consecutive positions (its window counts rows); this stream "
                             + ("has no window" if window is None else "skips positions"))
        if backend in ("padded", "math"):
            pos_q = _to_padded(mq.positions[:, None, None], mq)[:, 0, :, 0]  # [B, S_q], padding rows at 0
            if window is not None and mq is mk and local_in_bands(backend, mq.positions.device, dtype):
                # SDPA's CPU kernel computes every pair whatever the mask: a local layer there runs in bands
                return bias._replace(band=Band.build(pos_q, mq.key_valid, window, dtype))
            pos_k = _to_padded(mk.positions[:, None, None], mk)[:, 0, :, 0]
            relative = pos_k.long()[:, None, :] - pos_q.long()[:, :, None]
            # one cast and one contiguous copy for all layers (the kernels read the key dimension with stride 1)
            dense = bias.lookup(relative).permute(0, 3, 1, 2).to(dtype, memory_format=torch.contiguous_format)
            if not mk.is_rectangular:
                dense = dense.masked_fill(~mk.key_valid[:, None, None, :], -math.inf)  # padded keys get no weight
            bias = bias._replace(dense=dense)
        elif backend == "flex":
            bias = bias._replace(block_mask=document_block_mask(mq, mk, window))
        return bias

    @property
    def max_distance(self) -> int:
        return (self.by_distance.shape[0] - 1) // 2

    def lookup(self, relative: torch.Tensor) -> torch.Tensor:
        """[..., heads] bias of the relative positions (key - query) in `relative` [...]."""
        far = self.max_distance
        return self.by_distance[relative.clamp(-far, far) + far]


# --------------------------------------------------------------------------------------------------- backends
def _flash(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, mq.cu_seqlens, mk.cu_seqlens, mq.max_seqlen, mk.max_seqlen,
                                  dropout_p=dropout_p, softmax_scale=scale, causal=False)


def _torch_flash(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    window = None if bias is None else bias.window
    return flash_varlen(q, k, v, mq.cu_seqlens, mk.cu_seqlens, mq.max_seqlen, mk.max_seqlen, dropout_p, scale, window)


def _triton_window(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    from . import kernels  # its bias a window of self-attention (StreamBias.build), no dropout (varlen_attention)

    return kernels.local_attention(q, k, v, mq.cu_seqlens, mq.positions, mq.max_seqlen, bias.window, scale)


def window_of_rows(mq: VarlenMeta, mk: VarlenMeta, window: int | None) -> bool:
    """Whether a local `window` of positions on this stream pair is exactly a window of rows: self-attention on a
    stream whose rows are consecutive positions."""
    return window is not None and mq is mk and mq.consecutive


def _torch_varlen(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, mq.cu_seqlens, mk.cu_seqlens, mq.max_seqlen, mk.max_seqlen, scale=scale)


def _to_padded(x: torch.Tensor, meta: VarlenMeta) -> torch.Tensor:
    """[T, heads, D] -> [B, heads, max_seqlen, D], zeros in the padding (a view when there is none)."""
    padded = x
    if not meta.is_rectangular:
        padded = x.new_zeros(meta.num_sequences * meta.max_seqlen, *x.shape[1:]).index_copy(0, meta.padded_index, x)
    return padded.view(meta.num_sequences, meta.max_seqlen, *x.shape[1:]).transpose(1, 2)


def _from_padded(out: torch.Tensor, meta: VarlenMeta) -> torch.Tensor:
    """[B, heads, max_seqlen, D] -> [T, heads, D], the padding rows dropped."""
    out = out.transpose(1, 2).reshape(meta.num_sequences * meta.max_seqlen, out.shape[1], out.shape[3])
    return out if meta.is_rectangular else out.index_select(0, meta.padded_index)


def _key_mask(mk: VarlenMeta, bias: StreamBias | None):
    """SDPA's attn_mask: None, the boolean key mask, or (with a bias) the bias's dense mask."""
    if bias is not None:
        return bias.dense
    return None if mk.is_rectangular else mk.key_valid[:, None, None, :]  # padded keys get no weight


def _padded(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    if bias is not None and bias.band is not None:
        if dropout_p:
            raise ValueError("a local layer on CPU runs padded attention in bands, which take no attention dropout: "
                             "with dropout use the 'math' backend (FASTMAE_ATTENTION=math, or auto)")
        out = banded_attention(_to_padded(q, mq), _to_padded(k, mk), _to_padded(v, mk), bias.band, scale)
        return _from_padded(out, mq)
    mask = _key_mask(mk, bias)
    out = F.scaled_dot_product_attention(_to_padded(q, mq), _to_padded(k, mk), _to_padded(v, mk), attn_mask=mask,
                                         dropout_p=dropout_p, scale=scale)
    return _from_padded(out, mq)


def _math(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    q_pad, k_pad, v_pad = _to_padded(q * scale, mq), _to_padded(k, mk), _to_padded(v, mk)
    batch, heads, len_q, head_dim = q_pad.shape
    len_k = mk.max_seqlen
    q_pad = q_pad.reshape(batch * heads, len_q, head_dim)
    k_t = k_pad.reshape(batch * heads, len_k, head_dim).transpose(1, 2)
    if bias is not None:
        scores = torch.baddbmm(_key_mask(mk, bias).reshape(batch * heads, len_q, len_k), q_pad, k_t)
    elif mk.is_rectangular:
        scores = torch.bmm(q_pad, k_t)
    else:  # 0 / -inf per key, [B * heads, 1, S_k], broadcast over the queries without a copy (stride 0)
        key_bias = torch.zeros(mk.key_valid.shape, dtype=q.dtype, device=q.device)
        key_bias = key_bias.masked_fill(~mk.key_valid, -math.inf)[:, None, :].expand(batch, heads, len_k)
        scores = torch.baddbmm(key_bias.reshape(batch * heads, 1, len_k).expand(-1, len_q, -1), q_pad, k_t)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p:
        dropped, rescale = drop_mask(tuple(probs.shape), dropout_p, probs.device)
        probs = probs.masked_fill(dropped, 0.0)
        v_pad = v_pad * rescale  # scaling v ([S, D]) rather than the probabilities ([S, S]) saves a pass
    out = torch.bmm(probs, v_pad.reshape(batch * heads, len_k, head_dim))
    return _from_padded(out.view(batch, heads, len_q, head_dim), mq)


def _nested(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float, scale: float, bias=None):
    if mq is not mk:
        return _padded(q, k, v, mq, mk, dropout_p, scale)  # jagged q and kv with different lengths: not supported

    offsets = mq.cu_seqlens.long()

    def nest(x):
        # min_seqlen=1: every packed sequence keeps its <s>; given, SDPA need not read the lengths from the device
        return torch.nested.nested_tensor_from_jagged(x, offsets, min_seqlen=1,
                                                      max_seqlen=mq.max_seqlen).transpose(1, 2)

    out = F.scaled_dot_product_attention(nest(q), nest(k), nest(v), dropout_p=dropout_p, scale=scale)
    return out.transpose(1, 2).values()


def varlen_attention_reference(q, k, v, mq: VarlenMeta, mk: VarlenMeta, dropout_p: float = 0.0,
                               scale: float | None = None, bias: StreamBias | None = None):
    """Plain softmax attention, one sequence at a time, computed in q's dtype (the oracle in fp64; no dropout); with
    `bias`, each sequence's bias looked up from its rows' positions on its own."""
    if dropout_p:
        raise ValueError("varlen_attention_reference: dropout is not supported")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    cq, ck = mq.cu_seqlens.tolist(), mk.cu_seqlens.tolist()
    outs = []
    for b in range(len(cq) - 1):
        qb, kb, vb = (t.transpose(0, 1) for t in (q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]))
        scores = qb @ kb.transpose(1, 2) * scale
        if bias is not None:
            relative = mk.positions[ck[b]:ck[b + 1]].long()[None, :] - mq.positions[cq[b]:cq[b + 1]].long()[:, None]
            scores = scores + bias.lookup(relative).permute(2, 0, 1).to(scores.dtype)
        weights = torch.softmax(scores, dim=-1)
        outs.append((weights @ vb).transpose(0, 1))
    return torch.cat(outs)


_IMPLS = {"torch_flash": _torch_flash, "flash": _flash, "torch_varlen": _torch_varlen,
          "triton_window": _triton_window, "flex": flex_varlen,
          "padded": _padded, "nested": _nested, "math": _math,
          "reference": varlen_attention_reference}


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on `device` here (the reference always can)."""
    names = ["torch_flash", "padded", "nested", "math", "flex", "reference"]
    if torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        names = ["triton_window", *names]
    if torch.device(device).type == "cuda":
        names = ["torch_varlen", *names]
        if _HAS_FLASH_ATTN:
            names = ["flash", *names]
    return names


BIAS_BACKENDS = ("torch_flash", "triton_window", "flex", "padded", "math", "reference")
"""Backends that add a position bias (torch_flash: a local window over consecutive positions only; triton_window: a
local window on any stream). `auto` picks, on CUDA in fp16/bf16, `triton_window` for a window without attention
dropout and `torch_flash` for one with it over consecutive positions; else `flex` on CUDA without attention dropout
(FlexAttention has none), else padded SDPA with the bias as a float mask (or `math` on CPU with dropout)."""


def resolve_backend(backend: str | None, device: torch.device, dropout_p: float,
                    dtype: torch.dtype = torch.bfloat16, biased: bool = False, window_rows: bool = False,
                    rectangular: bool = True, window: bool = False) -> str:
    """The backend `auto` (or None) means for this device, dropout, dtype and bias; explicit names are checked.
    `window`: the bias is a local window of self-attention; `window_rows`: on a stream of consecutive positions
    (`window_of_rows`); `rectangular`: every sequence of the stream has its longest's rows (VarlenMeta.is_rectangular).

    The CUDA varlen kernels take fp16/bf16 only; fp32 on CUDA falls back to padded SDPA.
    """
    backend = backend or os.environ.get("FASTMAE_ATTENTION", "auto")
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {BACKENDS}")
    if backend != "auto":
        if backend not in available_backends(device):
            raise ValueError(f"attention backend {backend!r} is not available on {device}")
        if biased and (backend not in BIAS_BACKENDS or (backend == "torch_flash" and not window_rows)
                       or (backend == "triton_window" and not window)):
            raise ValueError(f"attention backend {backend!r} takes no relative position bias here; choose one of "
                             f"{BIAS_BACKENDS} (torch_flash: a local window over consecutive positions only; "
                             "triton_window: a local window only; or model.relative_attention_bias=false)")
        if backend == "triton_window" and not biased:
            raise ValueError("attention backend 'triton_window' runs local layers only (a window of positions)")
        return backend
    half_on_cuda = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    if biased:
        if half_on_cuda and window and not dropout_p:
            return CUDA_LOCAL_BACKEND
        if half_on_cuda and window_rows:
            return "torch_flash"
        if device.type == "cuda":
            return "padded" if dropout_p else "flex"
        return CPU_DROPOUT_BACKEND if device.type == "cpu" and dropout_p else "padded"
    if half_on_cuda:
        return CUDA_RECTANGULAR_BACKEND if rectangular else CUDA_RAGGED_BACKEND
    if device.type == "cpu":
        return CPU_DROPOUT_BACKEND if dropout_p else CPU_BACKEND
    return "padded"


PADDED_VIEW_BACKENDS = ("padded", "math")
"""Backends that lay each stream out as a padded [sequences, max_seqlen] view (the others read the packed rows)."""
FLASH_KERNEL_BACKENDS = ("torch_flash", "flash", "torch_varlen", "nested")  # on CUDA: flash kernels, head_dim limits
FLASH_MAX_HEAD_DIM = 256


def check_flash_head_dim(head_dim: int, backend: str) -> None:
    """Raise a ValueError naming the config fields when the CUDA flash kernels cannot take `head_dim`."""
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        raise ValueError(f"attention backend {backend!r} runs flash kernels, which take a head dimension that is a "
                         f"multiple of 8 and at most {FLASH_MAX_HEAD_DIM}; this model's is {head_dim} "
                         "(model.hidden_size / model.num_heads): change those, or set FASTMAE_ATTENTION=padded")


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta_q: VarlenMeta,
                     meta_k: VarlenMeta | None = None, dropout_p: float = 0.0, backend: str | None = None,
                     bias: StreamBias | None = None):
    """Bidirectional attention within each packed sequence; no sequence sees another.

    q: [T_q, heads, head_dim]; k, v: [T_k, heads, head_dim] (the same rows as q when meta_k is None or meta_q).
    Sequence b of the queries attends to sequence b of the keys; `bias` adds a relative position bias to the
    scaled scores. Returns [T_q, heads, head_dim] in q's dtype.
    """
    meta_k = meta_q if meta_k is None else meta_k
    name = resolve_backend(backend, q.device, dropout_p, q.dtype, biased=bias is not None,
                           window_rows=bias is not None and window_of_rows(meta_q, meta_k, bias.window),
                           rectangular=meta_q.is_rectangular and meta_k.is_rectangular,
                           window=bias is not None and bias.window is not None and meta_q is meta_k)
    if bias is not None and bias.backend != name:
        raise ValueError(f"the relative position bias was built for attention backend {bias.backend!r}, but this "
                         f"call resolves to {name!r}")
    if name in ("torch_varlen", "triton_window") and dropout_p:
        raise ValueError(f"attention backend {name!r} has no dropout; use attention dropout 0 or another backend")
    if q.device.type == "cuda" and name in FLASH_KERNEL_BACKENDS:
        check_flash_head_dim(q.shape[-1], name)
    return _IMPLS[name](q, k, v, meta_q, meta_k, dropout_p, 1.0 / math.sqrt(q.shape[-1]), bias=bias)
