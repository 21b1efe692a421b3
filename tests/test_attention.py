import pytest
import torch
from tolerance import assert_as_accurate

from fastmae.attention import (
    BACKENDS,
    StreamBias,
    VarlenMeta,
    available_backends,
    varlen_attention,
    varlen_attention_reference,
)
from fastmae.positions import apply_rotary, relative_bias_by_distance, relative_position_buckets, rotary_tables

# the backends that take any position bias (torch_flash takes a window only: tests/test_flash.py)
POSITION_BIAS_BACKENDS = ("flex", "padded", "math")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_meta(lengths, device, positions=None):
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)
    if positions is None:
        positions = (torch.arange(sum(lengths)) - cu.long()[seq_ids.long()]).to(torch.int32)
    return VarlenMeta.build(cu.to(device), max(max(lengths), 1), seq_ids.to(device), positions.to(device))


GLOBAL_BACKENDS = tuple(name for name in BACKENDS[1:-1] if name != "triton_window")
"""All but auto, the reference itself and triton_window, which runs local windows only (its tests:
tests/kernels/test_kernel_local_attention.py)."""


def backend_params(names=GLOBAL_BACKENDS, dtypes=None):
    """Every backend of `names` on every device it is meant for and present here (the CUDA ones where CUDA is,
    flash-attn's where it is installed), with each dtype of `dtypes` that backend and device train in."""
    for backend in names:
        for device in ("cpu", "cuda") if backend in ("padded", "nested", "math") else ("cuda",):
            if device == "cuda" and not torch.cuda.is_available() or backend not in available_backends(device):
                continue
            if dtypes is None:
                yield pytest.param(backend, device, id=f"{backend}-{device}")
                continue
            for dtype in dtypes:
                if backend in ("flash", "torch_varlen", "torch_flash") and dtype == torch.float32:
                    continue  # their CUDA kernels take fp16/bf16 only (torch_flash's CPU twin: tests/test_flash.py)
                if device == "cpu" and dtype == torch.float16:
                    continue  # not a CPU training dtype
                yield pytest.param(backend, device, dtype, id=f"{backend}-{device}-{str(dtype)[6:]}")


SHAPES = [
    pytest.param([1], [1], id="one-token"),
    pytest.param([7, 1, 33], None, id="self-7-1-33"),
    pytest.param([64, 50, 3, 97], None, id="self-64-50-3-97"),
    pytest.param([2, 5, 4], [9, 5, 30], id="cross-q2,5,4-k9,5,30"),
    pytest.param([16, 16, 16], None, id="rectangular-3x16"),  # no padding: the padded view is a plain view
    pytest.param([4, 4], [9, 9], id="cross-rectangular-q4,4-k9,9"),
]


@pytest.mark.parametrize("backend, device, dtype",
                         list(backend_params(dtypes=(torch.float32, torch.bfloat16, torch.float16))))
@pytest.mark.parametrize("q_lengths, k_lengths", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_backend_matches_reference_forward_and_backward(backend, device, dtype, q_lengths, k_lengths, seed):
    heads, head_dim = 3, 16
    mq = make_meta(q_lengths, device)
    mk = mq if k_lengths is None else make_meta(k_lengths, device)
    gen = torch.Generator().manual_seed(seed)
    q32 = torch.randn(sum(q_lengths), heads, head_dim, generator=gen)
    k32, v32 = (torch.randn(sum(k_lengths or q_lengths), heads, head_dim, generator=gen) for _ in range(2))
    grad_out = torch.randn(q32.shape, generator=gen)

    def run(fn, dtype, q, k, v):
        q, k, v = (t.detach().to(device, dtype).requires_grad_() for t in (q, k, v))  # own leaves, own .grad
        out = fn(q, k, v)
        out.backward(grad_out.to(device, dtype))
        return [t.float().cpu() for t in (out, q.grad, k.grad, v.grad)]

    reference = lambda q, k, v: varlen_attention_reference(q, k, v, mq, mk)  # noqa: E731
    tested = lambda q, k, v: varlen_attention(q, k, v, mq, mk, backend=backend)  # noqa: E731
    exact = run(reference, torch.float64, q32.double(), k32.double(), v32.double())
    got = run(tested, dtype, q32, k32, v32)
    plain = run(reference, dtype, q32, k32, v32)  # plain torch's own error in this dtype
    # one-token sequences have dq exactly 0: a kernel's rounding there is measured against the other gradients
    zero_scale = max(t.abs().max().item() for t in exact)
    for name, g, p, e in zip(("out", "dq", "dk", "dv"), got, plain, exact):
        assert_as_accurate(f"{backend} {name}", g, p, e, dtype, factor=2 if name == "out" else 3,
                           zero_scale=zero_scale)


def test_sequences_do_not_see_each_other():
    meta = make_meta([5, 6], "cpu")
    q, k, v = (torch.randn(11, 2, 8) for _ in range(3))
    out = varlen_attention(q, k, v, meta)
    k2, v2 = k.clone(), v.clone()
    k2[5:] += 10.0
    v2[5:] -= 3.0
    out2 = varlen_attention(q, k2, v2, meta)
    assert torch.equal(out[:5], out2[:5])
    assert not torch.allclose(out[5:], out2[5:])


def test_rotary_scores_depend_only_on_distance():
    cos, sin = rotary_tables(torch.tensor([3, 10, 103, 110]), 16, 10000.0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)
    rot = lambda x, i: apply_rotary(x, cos[i:i + 1], sin[i:i + 1])  # noqa: E731
    near = (rot(q, 1) * rot(k, 0)).sum()  # positions 10 and 3
    far = (rot(q, 3) * rot(k, 2)).sum()  # positions 110 and 103
    torch.testing.assert_close(near, far, rtol=1e-5, atol=1e-5)
    assert not torch.allclose((rot(q, 1) * rot(k, 0)).sum(), (rot(q, 2) * rot(k, 0)).sum())


def test_unknown_or_unavailable_backend_is_an_error(monkeypatch):
    meta = make_meta([3], "cpu")
    x = torch.randn(3, 1, 4)
    with pytest.raises(ValueError, match="unknown"):
        varlen_attention(x, x, x, meta, backend="magic")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            varlen_attention(x, x, x, meta, backend="torch_varlen")
    from fastmae import attention

    ran = []  # the forced backend must be the one that runs (its output alone would equal any other backend's)
    spy = lambda *args, **kwargs: ran.append(True) or varlen_attention_reference(*args, **kwargs)  # noqa: E731
    monkeypatch.setitem(attention._IMPLS, "reference", spy)
    monkeypatch.setenv("FASTMAE_ATTENTION", "reference")
    torch.testing.assert_close(varlen_attention(x, x, x, meta), varlen_attention_reference(x, x, x, meta, meta))
    assert ran == [True]


def test_automatic_choice_follows_device_dropout_and_dtype(monkeypatch):
    from fastmae import attention

    monkeypatch.delenv("FASTMAE_ATTENTION", raising=False)
    cuda = torch.device("cuda")
    assert attention.resolve_backend(None, torch.device("cpu"), 0.0, torch.float32) == attention.CPU_BACKEND
    assert attention.resolve_backend(None, torch.device("cpu"), 0.1, torch.bfloat16) == attention.CPU_DROPOUT_BACKEND
    for has_flash_attn in (False, True):  # flash-attn, installed or not, runs only when asked for
        monkeypatch.setattr(attention, "_HAS_FLASH_ATTN", has_flash_attn)
        for dropout_p in (0.0, 0.1):  # torch's FlashAttention-2 kernels take attention dropout
            # a rectangular stream: cuDNN's attention through padded SDPA (measured faster there); a ragged one:
            # the varlen kernels (no padding)
            assert attention.resolve_backend(None, cuda, dropout_p, torch.bfloat16) == "padded"
            assert attention.resolve_backend(None, cuda, dropout_p, torch.float16, rectangular=False) == "torch_flash"
            # a local window over consecutive positions: fastmae's kernel (measured faster), or with attention
            # dropout, which it has not, the FlashAttention kernels' window of rows
            assert attention.resolve_backend(None, cuda, dropout_p, torch.bfloat16, biased=True, window_rows=True,
                                             window=True) == ("torch_flash" if dropout_p else "triton_window")
        assert attention.resolve_backend(None, cuda, 0.0, torch.float32, rectangular=False) == "padded"  # half only
    # a window over a shortened stream: fastmae's own kernel (no dropout); a relative bias: flex, or padded with
    # dropout (neither kernel takes it)
    assert attention.resolve_backend(None, cuda, 0.0, torch.bfloat16, biased=True, window=True) == "triton_window"
    assert attention.resolve_backend(None, cuda, 0.1, torch.bfloat16, biased=True, window=True) == "padded"
    assert attention.resolve_backend(None, cuda, 0.0, torch.float32, biased=True, window=True) == "flex"
    assert attention.resolve_backend(None, cuda, 0.0, torch.bfloat16, biased=True) == "flex"
    assert attention.resolve_backend(None, cuda, 0.1, torch.bfloat16, biased=True) == "padded"
    with pytest.raises(ValueError, match="triton_window: a local window only"):
        attention.resolve_backend("triton_window", torch.device("cpu"), 0.0, torch.bfloat16, biased=True)
    assert attention.resolve_backend(None, torch.device("cpu"), 0.0, torch.bfloat16, biased=True,
                                     window_rows=True) == "padded"  # the CPU keeps its bands
    with pytest.raises(ValueError, match="torch_flash: a local window over consecutive positions only"):
        attention.resolve_backend("torch_flash", cuda, 0.0, torch.bfloat16, biased=True)


def test_flash_head_dim_limits_name_the_config_fields():
    from fastmae.attention import check_flash_head_dim

    check_flash_head_dim(64, "nested")
    for head_dim in (20, 320):
        with pytest.raises(ValueError, match=r"this model's is \d+ \(model.hidden_size / model.num_heads\)"):
            check_flash_head_dim(head_dim, "nested")


DROPOUT_BACKENDS = [pytest.param("math", "cpu", torch.float32, id="math-cpu-fp32"),
                    pytest.param("math", "cpu", torch.bfloat16, id="math-cpu-bf16"),
                    pytest.param("torch_flash", "cpu", torch.float32, id="torch_flash-cpu-fp32"),  # the CPU twin
                    *(pytest.param(backend, "cuda", torch.bfloat16, id=f"{backend}-cuda-bf16")
                      for backend in ("padded", "nested", "torch_flash") if torch.cuda.is_available())]


@pytest.mark.parametrize("backend, device, dtype", DROPOUT_BACKENDS)
def test_attention_dropout_is_unbiased_and_random(backend, device, dtype):
    """With attention dropout, each call drops different probabilities, and the mean over many calls converges to
    the no-dropout output (the survivors' scale is exact), on padded and unequal sequences."""
    torch.manual_seed(0)
    meta = make_meta([9, 4, 13], device)
    q, k, v = (torch.randn(26, 2, 8).to(device, dtype) for _ in range(3))
    exact = varlen_attention_reference(q.double(), k.double(), v.double(), meta, meta).cpu()
    draws = torch.stack([varlen_attention(q, k, v, meta, dropout_p=0.25, backend=backend).double().cpu()
                         for _ in range(2000)])
    assert not torch.equal(draws[0], draws[1])
    # each draw's error has std <= ~max|v| * sqrt(p / (1 - p)); the mean of n draws shrinks it by sqrt(n)
    bound = (5 * v.double().abs().max().cpu() * (0.25 / 0.75) ** 0.5 / 2000**0.5
             + (0.02 if dtype == torch.bfloat16 else 0))
    assert (draws.mean(0) - exact).abs().max() < bound
    assert (draws.mean(0) - exact).abs().max() > 0  # not silently without dropout
    assert (draws[0] - exact).abs().max() > 10 * bound / 5**0.5 / 2000**0.5


# ------------------------------------------------------------------------------------ relative position bias
BIAS_SHAPES = [
    pytest.param([7, 1, 33], None, None, id="self-7-1-33"),
    pytest.param([40, 12], None, [0, 5, 9, 30, 31, 33, 60, 90, 140, 141] * 4 + [0, 1, 2, 3, 7, 8, 9, 100, 200, 300, 301,
                                                                                 302], id="self-dropped-positions"),
    pytest.param([2, 5, 4], [9, 5, 30], None, id="cross-q2,5,4-k9,5,30"),
    pytest.param([16, 16], None, None, id="rectangular-2x16"),
]


def _biased_run(backend, device, q_lengths, k_lengths, positions, dtype, seed, grad=True):
    """(got, plain torch in dtype, fp64 oracle): out and, with grad, dq, dk, dv and the bias table's gradient."""
    heads, head_dim, buckets = 3, 16, 64
    pos = None if positions is None else torch.tensor(positions, dtype=torch.int32)
    mq = make_meta(q_lengths, device, pos)
    mk = mq if k_lengths is None else make_meta(k_lengths, device)
    gen = torch.Generator().manual_seed(seed)
    q32 = torch.randn(sum(q_lengths), heads, head_dim, generator=gen)
    k32, v32 = (torch.randn(sum(k_lengths or q_lengths), heads, head_dim, generator=gen) for _ in range(2))
    table32 = torch.randn(buckets, heads, generator=gen)
    grad_out = torch.randn(q32.shape, generator=gen)

    def run(fn, dtype, q, k, v, table):
        q, k, v, table = (t.detach().to(device, dtype).requires_grad_(grad) for t in (q, k, v, table))
        out = fn(q, k, v, table)
        if not grad:
            return [out.float().cpu()]
        out.backward(grad_out.to(device, dtype))
        return [t.float().cpu() for t in (out, q.grad, k.grad, v.grad, table.grad)]

    def bias(table, backend):
        return StreamBias.build(relative_bias_by_distance(table, 128), mq, mk, backend, table.dtype)

    reference = lambda q, k, v, t: varlen_attention_reference(q, k, v, mq, mk, bias=bias(t, "reference"))  # noqa: E731
    tested = lambda q, k, v, t: varlen_attention(q, k, v, mq, mk, backend=backend, bias=bias(t, backend))  # noqa: E731
    args = (q32, k32, v32, table32)
    with torch.set_grad_enabled(grad):
        return run(tested, dtype, *args), run(reference, dtype, *args), run(reference, torch.float64, *args)


@pytest.mark.parametrize("backend, device", list(backend_params(POSITION_BIAS_BACKENDS)))
@pytest.mark.parametrize("q_lengths, k_lengths, positions", BIAS_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_biased_backends_match_the_reference_and_train_the_table(backend, device, q_lengths, k_lengths, positions,
                                                                  dtype, seed):
    """Forward and backward (q, k, v and the bias table) against the per-sequence reference in fp64, on rows whose
    original positions have gaps (as after dropping masked tokens) and across max_distance."""
    got, plain, exact = _biased_run(backend, device, q_lengths, k_lengths, positions, dtype, seed)
    zero_scale = max(t.abs().max().item() for t in exact)
    for name, g, p, e in zip(("out", "dq", "dk", "dv", "dtable"), got, plain, exact):
        assert_as_accurate(f"{backend} {name}", g, p, e, dtype, factor=3, zero_scale=zero_scale)
    assert exact[4].abs().sum() > 0  # the table learns


@pytest.mark.parametrize("q_lengths, k_lengths, positions", BIAS_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flex_score_mod_and_document_mask_match_the_reference_on_cpu(q_lengths, k_lengths, positions, dtype):
    """The CUDA FlexAttention path's score_mod (bias by original positions) and block mask (no attention across
    packed sequences) run forward under torch's eager FlexAttention here; the CUDA test above adds the backward."""
    got, plain, exact = _biased_run("flex", "cpu", q_lengths, k_lengths, positions, dtype, seed=0, grad=False)
    assert_as_accurate("flex out", got[0], plain[0], exact[0], dtype, factor=2)


@pytest.mark.parametrize("backend, device", list(backend_params(POSITION_BIAS_BACKENDS)))
def test_bias_table_gradient_survives_bf16(backend, device):
    """A bucket's gradient sums one term per query-key pair and head (here ~290K per bucket and head): accumulated in
    bf16 it came out 24-31% off; the lookups run in fp32, so every bucket's gradient stays within 1% of the largest
    bucket's gradient of its fp64 value (README's claim; the per-term bf16 rounding)."""
    meta = make_meta([512, 512, 300], device)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(1324, 2, 16, generator=gen) for _ in range(4))
    table = torch.randn(64, 2, generator=gen) * 0.5

    def table_grad(dtype, backend):
        leaf = table.to(device, dtype).requires_grad_()
        bias = StreamBias.build(relative_bias_by_distance(leaf, 128), meta, meta, backend, dtype)
        out = varlen_attention(*(t.to(device, dtype) for t in (q, k, v)), meta, backend=backend, bias=bias)
        out.backward(grad_out.to(device, dtype))
        return leaf.grad.double().cpu()

    exact = table_grad(torch.float64, "reference")
    got = table_grad(torch.bfloat16, backend)
    assert (got - exact).abs().max() / exact.abs().max() < 0.01


def test_flex_refuses_to_train_on_cpu():
    meta = make_meta([5, 3], "cpu")
    q = torch.randn(8, 2, 16, requires_grad=True)
    with pytest.raises(ValueError, match="'flex' runs forward only on cpu"):
        varlen_attention(q, q, q, meta, backend="flex")


def test_reference_buckets():
    """MAE-LM's bucketing (64 buckets, max distance 128), values worked out by hand from its formula: exact below
    16 each way around the middle bucket 31, then 16 + ceil(ln(d / 16) / ln(127 / 16) * 15) per side."""
    rel = torch.tensor([0, 1, -1, 15, -15, 16, 17, -17, 100, 126, 127, 1000, -1000])
    got = relative_position_buckets(rel, num_buckets=64, max_distance=128).tolist()
    assert got == [31, 32, 30, 46, 16, 47, 48, 14, 61, 62, 62, 62, 0]
    every = relative_position_buckets(torch.arange(-600, 601), num_buckets=64, max_distance=128)
    assert (every.diff() >= 0).all() and torch.equal(every + every.flip(0), torch.full_like(every, 62))
    assert set(every.tolist()) == set(range(63))  # every bucket but the last is used, as in the reference
    large = relative_position_buckets(torch.tensor([0, 31, 32, 254, 255, -10**6]), 128, 256).tolist()
    assert large == [63, 94, 95, 126, 126, 0]


def test_dropping_tokens_keeps_the_bias_of_every_remaining_pair():
    """The visible rows' bias (looked up by original positions) equals the full sequence's bias on the same pairs."""
    table = torch.randn(64, 2)
    full = make_meta([300], "cpu")
    keep = torch.tensor(sorted(torch.randperm(300, generator=torch.Generator().manual_seed(0))[:140].tolist()))
    visible = make_meta([140], "cpu", keep.to(torch.int32))
    by_distance = relative_bias_by_distance(table, 128)
    full_bias = StreamBias.build(by_distance, full, full, "padded", torch.float32).dense[0]
    visible_bias = StreamBias.build(by_distance, visible, visible, "padded", torch.float32).dense[0]
    assert torch.equal(visible_bias, full_bias[:, keep][:, :, keep])
