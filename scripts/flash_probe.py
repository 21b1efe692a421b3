"""What torch's own FlashAttention-2 varlen ops do on this GPU (issue 55's first lease): their schema, whether they
compute the windowed oracle with and without a window, whether attention dropout replays from the forward's rng
state and under a CUDA graph, and what they cost against padded SDPA (cuDNN) at the throughput benchmark's micro-batch
(128 x 512 full, 128 x 256 visible; 12 heads of 64, bf16), with a local window of 64 positions either side.

    python scripts/flash_probe.py [--json PATH]      # on a CUDA machine
    python scripts/flash_probe.py --lengths 257,256  # the speeds alone, 128 sequences of each length

`--lengths` times rectangular streams only (the GPU check's headline phase keeps the table in its log): 3ml's encoder
stream at base is 128 x 257 rows (the 255 removed of 510 maskable tokens leave 255 and the two special tokens), one
row past a multiple of the kernels' 64- and 128-row tiles, so its attention may cost what 128 x 320 would. For the
first length it also computes the last row apart (`split_forward`: cuDNN on the others, that row's pairs merged in by
their log-sum-exps; exact) against cuDNN over all rows, and times both: whether cuDNN's backward takes the merged
outputs (torch's context-parallel ring attention calls it so) and what the pairs by hand cost in torch ops.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import traceback

import torch
import torch.nn.functional as F

FWD, BWD = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
HEADS, HEAD_DIM, HALF_WINDOW = 12, 64, 64
RESULTS: dict = {}


def flash(q, k, v, cu, max_len, dropout_p, window=None):
    """out, (lse, rng_state, unused) of the varlen forward over one packed stream."""
    left = right = -1 if window is None else window
    out, lse, rng, unused, _ = FWD(q, k, v, cu, cu, max_len, max_len, dropout_p, False, False,
                                   scale=1 / math.sqrt(q.shape[-1]), window_size_left=left, window_size_right=right)
    return out, (lse, rng, unused)


def flash_backward(grad, q, k, v, out, saved, cu, max_len, dropout_p, window=None):
    lse, rng, unused = saved
    left = right = -1 if window is None else window
    return BWD(grad, q, k, v, out, lse, cu, cu, max_len, max_len, dropout_p, False, rng, unused,
               scale=1 / math.sqrt(q.shape[-1]), window_size_left=left, window_size_right=right)


def reference(q, k, v, lengths, window=None):
    """fp32 oracle, per sequence; `window`: rows at most that far apart (consecutive positions)."""
    outs, start = [], 0
    for n in lengths:
        qb, kb, vb = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
        scores = qb @ kb.transpose(1, 2) / math.sqrt(q.shape[-1])
        if window is not None:
            rows = torch.arange(n, device=q.device)
            scores = scores.masked_fill((rows[:, None] - rows[None, :]).abs() > window, -math.inf)
        outs.append((scores.softmax(-1) @ vb).transpose(0, 1))
        start += n
    return torch.cat(outs)


def stream(lengths, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    return q, k, v, cu, max(lengths)


def check(name, fn):
    try:
        RESULTS[name] = fn()
    except Exception as error:  # noqa: BLE001 - a probe records every failure and goes on
        traceback.print_exc()
        RESULTS[name] = f"FAILED: {type(error).__name__}: {error}"[:600]
    print(f"{name}: {RESULTS[name]}", flush=True)


def correctness(window):
    lengths = [300, 17, 512, 129, 64, 200]
    q, k, v, cu, max_len = stream(lengths)
    out, saved = flash(q, k, v, cu, max_len, 0.0, window)
    grad = torch.randn_like(out)
    dq, dk, dv = flash_backward(grad, q, k, v, out, saved, cu, max_len, 0.0, window)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, lengths, window)
    ref.backward(grad.float())
    return {"out_max_err": (out.float() - ref).abs().max().item(),
            **{f"d{n}_max_err": (g.float() - leaf.grad).abs().max().item()
               for n, g, leaf in zip("qkv", (dq, dk, dv), leaves)},
            "ref_out_abs_max": ref.abs().max().item()}


def dropout_replay():
    lengths = [512, 300, 77]
    q, k, v, cu, max_len = stream(lengths)
    grad = torch.randn_like(q)
    runs = []
    for _ in range(2):
        torch.cuda.manual_seed(7)
        out, saved = flash(q, k, v, cu, max_len, 0.1)
        runs.append((out, *flash_backward(grad, q, k, v, out, saved, cu, max_len, 0.1)))
    out_nodrop, _ = flash(q, k, v, cu, max_len, 0.0)
    again, _ = flash(q, k, v, cu, max_len, 0.1)  # generator moved on: another mask
    return {"same_seed_identical": all(torch.equal(a, b) for a, b in zip(*runs)),
            "next_call_differs": not torch.equal(again, runs[0][0]),
            "differs_from_no_dropout": (runs[0][0] - out_nodrop).abs().max().item(),
            "rng_state": str(flash(q, k, v, cu, max_len, 0.1)[1][1].tolist())}


def dropout_graph():
    lengths = [512, 300, 77]
    q, k, v, cu, max_len = stream(lengths)
    grad = torch.randn_like(q)
    static = {}

    def step():
        out, saved = flash(q, k, v, cu, max_len, 0.1)
        static["out"] = out
        static["grads"] = flash_backward(grad, q, k, v, out, saved, cu, max_len, 0.1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.manual_seed(11)
    graph.replay()
    first = static["out"].clone(), [g.clone() for g in static["grads"]]
    graph.replay()
    second = static["out"].clone()
    torch.cuda.manual_seed(11)
    graph.replay()
    third = static["out"].clone(), [g.clone() for g in static["grads"]]
    return {"replays_differ": not torch.equal(first[0], second),
            "reseeded_replay_identical": torch.equal(first[0], third[0])
            and all(torch.equal(a, b) for a, b in zip(first[1], third[1]))}


def timed(fn, repeats=10):
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return round(statistics.median(times), 3)


def speed(lengths, label):
    q, k, v, cu, max_len = stream(lengths)
    grad = torch.randn_like(q)
    rows = {}
    for dropout_p in (0.0, 0.1):
        for window in (None, HALF_WINDOW):
            def fwd(dropout_p=dropout_p, window=window):
                return flash(q, k, v, cu, max_len, dropout_p, window)

            def both(dropout_p=dropout_p, window=window):
                out, saved = flash(q, k, v, cu, max_len, dropout_p, window)
                return flash_backward(grad, q, k, v, out, saved, cu, max_len, dropout_p, window)
            key = f"flash2 dropout={dropout_p} {'local' if window else 'global'}"
            rows[key] = {"fwd_ms": timed(fwd), "fwd_bwd_ms": timed(both)}
        if len(set(lengths)) == 1:  # padded SDPA: a plain view
            qp, kp, vp = (t.view(len(lengths), max_len, HEADS, HEAD_DIM).transpose(1, 2).requires_grad_()
                          for t in (q.clone(), k.clone(), v.clone()))
            gp = grad.view(len(lengths), max_len, HEADS, HEAD_DIM).transpose(1, 2)

            def sdpa_fwd(dropout_p=dropout_p):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(qp, kp, vp, dropout_p=dropout_p)

            def sdpa_both(dropout_p=dropout_p):
                out = F.scaled_dot_product_attention(qp, kp, vp, dropout_p=dropout_p)
                return torch.autograd.grad(out, (qp, kp, vp), gp)
            rows[f"sdpa (auto: cuDNN) dropout={dropout_p} global"] = {"fwd_ms": timed(sdpa_fwd),
                                                                      "fwd_bwd_ms": timed(sdpa_both)}
    RESULTS[f"speed {label}"] = rows
    for key, row in rows.items():
        print(f"  {label:18s} {key:42s} fwd {row['fwd_ms']:7.3f} ms  fwd+bwd {row['fwd_bwd_ms']:7.3f} ms", flush=True)
    return "done"


CUDNN_FWD = torch.ops.aten._scaled_dot_product_cudnn_attention
CUDNN_BWD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward


def split_forward(q, k, v, dropout_p):
    """Attention over [B, H, S, D] views with the last row apart: cuDNN on the first M = S - 1 rows (its log-sum-exp
    returned), the last key merged into those rows' outputs by their log-sum-exps, the last query over every key by
    hand (the extra pairs without dropout: exact at dropout 0). (out [B, H, S, D], lse [B, H, S], saved)."""
    m, scale = q.shape[2] - 1, 1 / math.sqrt(q.shape[-1])
    qm, km, vm, qx, kx, vx = q[:, :, :m], k[:, :, :m], v[:, :, :m], q[:, :, m:], k[:, :, m:], v[:, :, m:]
    out_m, lse_m, cum_q, cum_k, _, _, seed, offset, _ = CUDNN_FWD(qm, km, vm, None, True, dropout_p, False, False,
                                                                  scale=scale)
    lse_shape, lse_m = lse_m.shape, lse_m.reshape(out_m.shape[:3]).float()
    s_e = (qm @ kx.transpose(-1, -2)).squeeze(-1).float() * scale
    lse_t = torch.logaddexp(lse_m, s_e)
    p_e = torch.exp(s_e - lse_t)
    out_main = out_m.float() * torch.exp(lse_m - lse_t)[..., None] + p_e[..., None] * vx.float()
    s_x = (qx @ k.transpose(-1, -2)).float() * scale
    lse_x = torch.logsumexp(s_x, -1)
    p_x = torch.exp(s_x - lse_x[..., None])
    out = torch.cat([out_main.to(q.dtype), p_x.to(q.dtype) @ v], 2)
    return out, (lse_t, lse_shape, p_e, p_x, seed, offset, cum_q, cum_k)


def split_backward(grad, q, k, v, out, saved, dropout_p):
    """dq, dk, dv of `split_forward`: cuDNN's backward of the first M rows given the merged outputs and log-sum-exps
    (as torch's context-parallel ring attention calls it), the last key's and the last query's pairs by hand."""
    lse_t, lse_shape, p_e, p_x, seed, offset, cum_q, cum_k = saved
    m, scale = q.shape[2] - 1, 1 / math.sqrt(q.shape[-1])
    qm, km, vm, qx, kx, vx = q[:, :, :m], k[:, :, :m], v[:, :, :m], q[:, :, m:], k[:, :, m:], v[:, :, m:]
    grad_m, grad_x = grad[:, :, :m], grad[:, :, m:]
    dq_m, dk_m, dv_m = CUDNN_BWD(grad_m, qm, km, vm, out[:, :, :m], lse_t.reshape(lse_shape).contiguous(), seed,
                                 offset, None, cum_q, cum_k, m, m, dropout_p, False, scale=scale)
    row_dot = (grad.float() * out.float()).sum(-1)
    ds_e = p_e * ((grad_m @ vx.transpose(-1, -2)).squeeze(-1).float() - row_dot[:, :, :m])
    ds_x = p_x * ((grad_x @ v.transpose(-1, -2)).float() - row_dot[:, :, m:, None])
    dq = torch.cat([dq_m.float() + ds_e[..., None] * kx.float() * scale, (ds_x.to(q.dtype) @ k).float() * scale], 2)
    dk = torch.cat([dk_m.float(), (ds_e[..., None] * qm.float()).sum(2, keepdim=True) * scale], 2)
    dv = torch.cat([dv_m.float(), (p_e[..., None] * grad_m.float()).sum(2, keepdim=True)], 2)
    dk += ds_x.transpose(-1, -2) * qx.float() * scale
    dv += p_x.transpose(-1, -2) * grad_x.float()
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def split_probe(length):
    """The last row apart (`split_forward`) against cuDNN's SDPA over all `length` rows of 128 sequences: the errors at
    dropout 0 (fp32 oracle), then forward + backward ms at dropout 0.1, and cuDNN's own on the first length - 1 rows."""
    q, k, v, cu, _ = stream([length] * 128)
    q, k, v = (t.view(128, length, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    grad = torch.randn_like(q)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    oracle = F.scaled_dot_product_attention(*leaves)
    oracle.backward(grad.float())
    out, saved = split_forward(q, k, v, 0.0)
    errors = {f"{name}_max_err": (mine.float() - ref).abs().max().item() for name, mine, ref in zip(
        ("out", "dq", "dk", "dv"), (out, *split_backward(grad, q, k, v, out, saved, 0.0)),
        (oracle.detach(), *(leaf.grad for leaf in leaves)))}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    m = length - 1

    def cudnn_all():
        return torch.autograd.grad(F.scaled_dot_product_attention(*leaves, dropout_p=0.1), leaves, grad)

    def split_all():
        out, saved = split_forward(q, k, v, 0.1)
        return split_backward(grad, q, k, v, out, saved, 0.1)

    def cudnn_main():
        res = CUDNN_FWD(q[:, :, :m], k[:, :, :m], v[:, :, :m], None, True, 0.1, False, False)
        return CUDNN_BWD(grad[:, :, :m], q[:, :, :m], k[:, :, :m], v[:, :, :m], res[0], res[1], res[6], res[7], None,
                         res[2], res[3], m, m, 0.1, False)
    return {**errors, "sdpa_fwd_bwd_ms": timed(cudnn_all), "split_fwd_bwd_ms": timed(split_all),
            "cudnn_first_rows_fwd_bwd_ms": timed(cudnn_main)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="results file (default flash_probe.json; none with --lengths)")
    parser.add_argument("--lengths", help="comma-separated sequence lengths: only the speeds of 128 sequences of each")
    args = parser.parse_args()
    RESULTS["torch"], RESULTS["device"] = torch.__version__, torch.cuda.get_device_name()
    if args.lengths:
        for length in (int(n) for n in args.lengths.split(",")):
            check(f"speed_{length}", lambda length=length: speed([length] * 128, f"128x{length}"))
        check(f"split_{args.lengths.split(',')[0]}", lambda: split_probe(int(args.lengths.split(",")[0])))
        if args.json:
            with open(args.json, "w") as file:
                json.dump(RESULTS, file, indent=1)
        return 0
    RESULTS["forward_schema"], RESULTS["backward_schema"] = str(FWD.default._schema), str(BWD.default._schema)
    print(RESULTS["forward_schema"], RESULTS["backward_schema"], sep="\n", flush=True)
    check("global_vs_oracle", lambda: correctness(None))
    check("local_vs_oracle", lambda: correctness(HALF_WINDOW))
    check("dropout_replay", dropout_replay)
    check("dropout_graph", dropout_graph)
    check("speed_full", lambda: speed([512] * 128, "128x512 full"))
    check("speed_visible", lambda: speed([256] * 128, "128x256 visible"))
    gen = torch.Generator().manual_seed(0)
    ragged = torch.randint(64, 513, (128,), generator=gen).tolist()
    check("speed_ragged", lambda: speed(ragged, "128 ragged 64-512"))
    with open(args.json or "flash_probe.json", "w") as file:
        json.dump(RESULTS, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
