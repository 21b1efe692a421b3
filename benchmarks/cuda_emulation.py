"""The CUDA code path taken on any machine, for counting what a step asks of a GPU (benchmarks/host_overhead.py):
fastmae's Triton kernels, flash-attn's varlen attention, Hugging Face's fused SDPA, CUDA's dropout and CUDA graphs'
replays each counted as the launches they are on a GPU, their insides computed by references and not counted.
"""

from __future__ import annotations

import contextlib
import os

import torch


def count_triton_launches(counter_of) -> None:
    """Report every Triton kernel launch (compiled, or run by the interpreter) to `counter_of()`."""
    from triton.runtime import interpreter, jit

    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            counter = counter_of()
            if counter is None:
                return _original(self, *args, **kwargs)
            with counter.kernel(f"triton {getattr(self, '__name__', '?')}"):
                return _original(self, *args, **kwargs)

        cls.run = run


def emulate_cuda_path(counter_of) -> None:
    """Make this process take the code path a CUDA device takes: Triton kernels (each launch reported to
    `counter_of()`, a StepCounter or None), flash-attn's varlen attention (two kernels), a local layer's window on
    the backend CUDA picks, CUDA's fused SDPA and dropout (two aten ops each), the copy of a packed micro-batch to
    the device (one op, its rotary tables made there) and a replay of a recorded pass (CUDA graphs' CPU twin) as one
    graph launch."""
    os.environ["FASTMAE_KERNELS"] = "triton"
    from fastmae import attention, dropout, graphs, layers, masking

    count_triton_launches(counter_of)

    class FlashVarlen(torch.autograd.Function):
        """flash-attn's varlen forward and backward kernels: one launch each (the reference computes them)."""

        @staticmethod
        def forward(ctx, q, k, v, meta_q, meta_k, scale):
            ctx.save_for_backward(q, k, v)
            ctx.meta, ctx.scale = (meta_q, meta_k), scale
            counter = counter_of()
            with counter.kernel("flash_attn_varlen_fwd") if counter else contextlib.nullcontext():
                return attention.varlen_attention_reference(q, k, v, meta_q, meta_k, 0.0, scale)

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = ctx.saved_tensors
            counter = counter_of()
            with counter.kernel("flash_attn_varlen_bwd") if counter else contextlib.nullcontext():
                with torch.enable_grad():
                    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
                    out = attention.varlen_attention_reference(*inputs, *ctx.meta, 0.0, ctx.scale)
                    grads = torch.autograd.grad(out, inputs, grad_out)
            return (*grads, None, None, None)

    def flash(q, k, v, meta_q, meta_k, dropout_p, scale, bias=None):
        return FlashVarlen.apply(q, k, v, meta_q, meta_k, scale)

    attention._IMPLS["flash"] = flash

    class NativeDropout(torch.autograd.Function):
        """CUDA's dropout: native_dropout forward (mask and output in one kernel), native_dropout_backward."""

        @staticmethod
        def forward(ctx, x, p):
            counter = counter_of()
            with counter.kernel("native_dropout", aten=True) if counter else contextlib.nullcontext():
                keep = torch.rand_like(x, dtype=torch.float32) >= p
                ctx.save_for_backward(keep)
                ctx.scale = 1.0 / (1.0 - p)
                return x * keep * ctx.scale

        @staticmethod
        def backward(ctx, grad):
            counter = counter_of()
            with counter.kernel("native_dropout_backward", aten=True) if counter else contextlib.nullcontext():
                return grad * ctx.saved_tensors[0] * ctx.scale, None

    def native_dropout(x, p=0.5, training=True, inplace=False):
        return NativeDropout.apply(x, p) if training and p else x

    dropout.dropout = native_dropout  # fastmae's, and torch's that Hugging Face's modules call
    torch.nn.functional.dropout = native_dropout
    sdpa = torch.nn.functional.scaled_dot_product_attention

    class FusedSDPA(torch.autograd.Function):
        """Hugging Face's SDPA as CUDA runs it with a mask and dropout: the memory-efficient kernel, one op each way
        (on CPU, dropout sends SDPA to its unfused math path)."""

        @staticmethod
        def forward(ctx, q, k, v, mask, dropout_p, scale):
            ctx.save_for_backward(q, k, v, mask)
            ctx.dropout_p, ctx.scale = dropout_p, scale
            counter = counter_of()
            with counter.kernel("_efficient_attention_forward", aten=True) if counter else contextlib.nullcontext():
                return sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)

        @staticmethod
        def backward(ctx, grad):
            q, k, v, mask = ctx.saved_tensors
            counter = counter_of()
            with counter.kernel("_efficient_attention_backward", aten=True) if counter else contextlib.nullcontext():
                with torch.enable_grad():
                    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
                    out = sdpa(*inputs, attn_mask=mask, dropout_p=ctx.dropout_p, scale=ctx.scale)
                    grads = torch.autograd.grad(out, inputs, grad)
            return (*grads, None, None, None)

    def fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        assert not is_causal and not kwargs, "an encoder's attention"
        return FusedSDPA.apply(q, k, v, attn_mask, dropout_p, scale)

    torch.nn.functional.scaled_dot_product_attention = fused_sdpa

    def moved_in_one_copy(self, device, non_blocking=False):
        """The copy of a packed micro-batch to the device, which on CPU it is on already: a clone stands for it."""
        return self.viewing(self.buffer.clone())

    masking.MaskedBatch.to = moved_in_one_copy
    for name in ("replay_forward", "replay_backward"):  # the CPU twin of a CUDA graph: one launch for the pass
        original = getattr(graphs.Recording, name)

        def replay(self, _original=original):
            counter = counter_of()
            with counter.kernel("cuda_graph_replay", aten=True) if counter else contextlib.nullcontext():
                return _original(self)

        setattr(graphs.Recording, name, replay)
    original_resolve = attention.resolve_backend
    for module in (attention, layers, graphs):  # flash-attn's kernels (emulated above); with a bias, CUDA's choice
        module.resolve_backend = lambda backend, device, dropout_p, dtype=None, biased=False, **stream: (
            original_resolve(backend, torch.device("cuda"), dropout_p, dtype, biased, **stream) if biased else "flash")
