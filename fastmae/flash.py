"""torch's own FlashAttention-2 varlen kernels as one autograd op: the `torch_flash` backend of fastmae.attention
(ARCHITECTURE.md section 4).

`torch.ops.aten._flash_attention_forward` / `_flash_attention_backward` take packed rows with cu_seqlens, attention
dropout (the forward returns the Philox seed and offset it drew with; the backward redraws the same mask from them)
and a window of rows either side. They are wrapped as `torch.library` custom ops (`fastmae::flash_varlen_forward`,
`fastmae::flash_varlen_backward`) with a registered autograd formula and fake (shape) functions, so dynamo traces
them as single nodes (train.compile) and CUDA graphs record them like any kernel: under a capture torch's Philox
reads its seed and offset from the generator's graph-safe state, so each replay draws a fresh mask.

On CPU the same ops run a plain-torch twin (the dense packed scores, a same-sequence and window mask, dropout from a
seed it returns as its rng state and redraws in the backward), tested against the same oracle as the CUDA kernels:
it is how CPU tests check the op's contract (window, dropout replayed from the rng state, gradients), never a
backend `auto` picks on CPU.
"""

from __future__ import annotations

import math

import torch

NO_WINDOW = -1  # the kernels' "unbounded" window


def _window_args(window: int) -> dict:
    return {"window_size_left": window, "window_size_right": window}


@torch.library.custom_op("fastmae::flash_varlen_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
             max_k: int, dropout_p: float, scale: float,
             window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, False, False, scale=scale, **_window_args(window))
    return out, lse, rng_state, unused


@torch.library.custom_op("fastmae::flash_varlen_backward", mutates_args=())
def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, dropout_p: float,
              scale: float, window: int, rng_state: torch.Tensor,
              unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, False, rng_state, unused,
        scale=scale, **_window_args(window))
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------ the CPU twin
def _twin_scores_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, rows_q: int, rows_k: int, window: int) -> torch.Tensor:
    """[Tq, Tk] bool: query row i may see key row j (same sequence and, with a window, at most `window` rows apart
    counted from each sequence's start, as the kernels count them)."""
    def seq_and_row(cu, rows):
        seq = torch.searchsorted(cu[1:].long(), torch.arange(rows), right=True)
        return seq, torch.arange(rows) - cu.long()[seq]
    (seq_q, row_q), (seq_k, row_k) = seq_and_row(cu_q, rows_q), seq_and_row(cu_k, rows_k)
    allowed = seq_q[:, None] == seq_k[None, :]
    if window != NO_WINDOW:
        allowed &= (row_q[:, None] - row_k[None, :]).abs() <= window
    return allowed


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _as_kernels_write(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x in like's dtype, contiguous, as the CUDA kernels write their outputs (an einsum's result may be a permuted
    view: left so, every reshape or `.contiguous()` after it would copy on CPU where it does not on CUDA)."""
    return x.to(like.dtype).contiguous()  # (`to` with a memory format returns x itself where the dtype is x's)


def _twin_probabilities(q, k, cu_q, cu_k, scale, window):
    """(probs [heads, Tq, Tk], lse [heads, Tq]) in fp32 (fp64 for fp64 inputs) over the dense packed scores (a row
    with no key: zeros)."""
    scores = torch.einsum("qhd,khd->hqk", _wide(q), _wide(k)) * scale
    allowed = _twin_scores_mask(cu_q, cu_k, q.shape[0], k.shape[0], window)
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0), lse


def _twin_kept(shape, dropout_p: float, seed: int) -> torch.Tensor | float:
    """The survivors' weights of the dropout drawn from `seed`: 0 or 1 / (1 - p) per probability (1.0 without)."""
    if not dropout_p:
        return 1.0
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) >= dropout_p
    return keep / (1.0 - dropout_p)


@_forward.register_kernel("cpu")
def _forward_cpu(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, window):
    seed = int(torch.randint(0, 2**62, (1,))) if dropout_p else 0  # from torch's CPU generator: manual_seed repeats it
    probs, lse = _twin_probabilities(q, k, cu_q, cu_k, scale, window)
    out = torch.einsum("hqk,khd->qhd", probs * _twin_kept(probs.shape, dropout_p, seed), _wide(v))
    return (_as_kernels_write(out, q), lse.float(), torch.tensor([seed, 0], dtype=torch.int64),
            q.new_empty(0, dtype=torch.int64))


@_backward.register_kernel("cpu")
def _backward_cpu(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, scale, window, rng_state, unused):
    """FlashAttention's backward in plain torch: the probabilities recomputed, the dropout redrawn from the seed."""
    probs, _ = _twin_probabilities(q, k, cu_q, cu_k, scale, window)
    kept = _twin_kept(probs.shape, dropout_p, int(rng_state[0]))
    grad_wide = _wide(grad)
    dv = torch.einsum("hqk,qhd->khd", probs * kept, grad_wide)
    d_probs = torch.einsum("qhd,khd->hqk", grad_wide, _wide(v)) * kept
    row_dot = (grad_wide * _wide(out)).sum(-1).transpose(0, 1)  # [heads, Tq]: sum_j P_ij dP_ij, dropout included
    d_scores = probs * (d_probs - row_dot[..., None]) * scale
    dq = torch.einsum("hqk,khd->qhd", d_scores, _wide(k))
    dk = torch.einsum("hqk,qhd->khd", d_scores, _wide(q))
    return _as_kernels_write(dq, q), _as_kernels_write(dk, k), _as_kernels_write(dv, v)


# ---------------------------------------------------------------------------------------------- shapes, autograd
@_forward.register_fake
def _forward_fake(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, window):
    rng_dtype = torch.uint64 if q.device.type == "cuda" else torch.int64
    return (torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32),
            q.new_empty(2, dtype=rng_dtype), q.new_empty(0, dtype=rng_dtype))


@_backward.register_fake
def _backward_fake(grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, scale, window, rng_state, unused):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, window = inputs
    out, lse, rng_state, unused = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
    ctx.args = (max_q, max_k, dropout_p, scale, window)
    ctx.mark_non_differentiable(lse, rng_state, unused)
    ctx.set_materialize_grads(False)  # else autograd makes a zero gradient of lse and the rng state: two CUDA kernels


def _autograd_backward(ctx, grad_out, _grad_lse, _grad_rng, _grad_unused):
    if grad_out is None:  # the output went unused
        return (None,) * 10
    q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
    max_q, max_k, dropout_p, scale, window = ctx.args
    dq, dk, dv = _backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, scale, window,
                           rng_state, unused)
    return dq, dk, dv, None, None, None, None, None, None, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, dropout_p: float = 0.0, scale: float | None = None,
                 window: int | None = None) -> torch.Tensor:
    """Attention of q [Tq, heads, D] to k, v [Tk, heads, D] within each packed sequence (cu_q, cu_k: int32 [B+1]),
    with attention dropout `dropout_p` and, with `window`, only keys at most that many rows from the query's row
    (counted from each sequence's start). torch's FlashAttention-2 kernels on CUDA (fp16/bf16), the twin on CPU."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _forward(q, k, v, cu_q, cu_k, max_q, max_k, float(dropout_p), float(scale),
                    NO_WINDOW if window is None else int(window))[0]
