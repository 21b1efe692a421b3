"""What torch's own FlashAttention-2 varlen ops do on this GPU (issue 55's first lease): their schema, whether they
compute the windowed oracle with and without a window, whether attention dropout replays from the forward's rng
state and under a CUDA graph, and what they cost against padded SDPA (cuDNN) at the throughput benchmark's micro-batch
(128 x 512 full, 128 x 256 visible; 12 heads of 64, bf16), with a local window of 64 positions either side.

    python scripts/flash_probe.py [--json PATH]      # on a CUDA machine
    python scripts/flash_probe.py --lengths 257,256  # the speeds alone, 128 sequences of each length

`--lengths` times rectangular streams only (the GPU check's headline phase keeps the table in its log): 3ml's encoder
stream at base is 128 x 257 rows (the 255 removed of 510 maskable tokens leave 255 and the two special tokens), one
row past a multiple of the kernels' 64- and 128-row tiles, so its attention may cost what 128 x 320 would.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="results file (default flash_probe.json; none with --lengths)")
    parser.add_argument("--lengths", help="comma-separated sequence lengths: only the speeds of 128 sequences of each")
    args = parser.parse_args()
    RESULTS["torch"], RESULTS["device"] = torch.__version__, torch.cuda.get_device_name()
    if args.lengths:
        for length in (int(n) for n in args.lengths.split(",")):
            check(f"speed_{length}", lambda length=length: speed([length] * 128, f"128x{length}"))
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
