"""CPU attention backends side by side, forward + backward, in one run: padded SDPA vs nested-jagged SDPA without
dropout, padded SDPA vs the `math` backend with attention dropout 0.1.

    python benchmarks/attention.py            # writes benchmarks/results/attention.{json,md}
"""

from __future__ import annotations

import argparse

import torch
from common import median_time, write_results

from fastmae.attention import VarlenMeta, available_backends, varlen_attention


def make_stream(lengths: list[int], heads: int, head_dim: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)
    positions = torch.arange(total) - cu.long()[seq_ids.long()]
    meta = VarlenMeta.build(cu, max(lengths), seq_ids, positions)
    qkv = [torch.randn(total, heads, head_dim, generator=gen, dtype=torch.float32).to(dtype).requires_grad_()
           for _ in range(3)]
    return qkv, meta


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = "cpu"
    runs = [(b, 0.0) for b in available_backends(device) if b in ("padded", "nested")]
    runs += [("padded", 0.1), ("math", 0.1)]
    shapes = [  # (name, lengths, heads, head_dim)
        ("8x512 full", [512] * 8, 8, 64),
        ("8x~435 visible (15% dropped)", [435] * 8, 8, 64),
        ("8x256 visible (50% dropped)", [256] * 8, 8, 64),
        ("16 docs 40..500", [40 + 30 * i for i in range(16)], 12, 64),
    ]
    rows = []
    for name, lengths, heads, head_dim in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            (q, k, v), meta = make_stream(lengths, heads, head_dim, dtype, seed=0)
            row = {"shape": name, "tokens": sum(lengths), "dtype": str(dtype).replace("torch.", "")}
            for backend, dropout_p in runs:
                def step():
                    out = varlen_attention(q, k, v, meta, dropout_p=dropout_p, backend=backend)
                    out.float().square().mean().backward()
                column = f"{backend} ms" + (f" (dropout {dropout_p})" if dropout_p else "")
                row[column] = 1e3 * median_time(step, warmup=1, repeats=args.repeats)
            row["nested / padded"] = row["nested ms"] / row["padded ms"]
            row["padded / math, dropout"] = row["padded ms (dropout 0.1)"] / row["math ms (dropout 0.1)"]
            rows.append(row)
            print(row, flush=True)
    columns = ["shape", "tokens", "dtype", "padded ms", "nested ms", "nested / padded", "padded ms (dropout 0.1)",
               "math ms (dropout 0.1)", "padded / math, dropout"]
    path = write_results("attention", rows, columns, "Varlen attention on CPU: forward + backward",
                         "Median of repeats; lower is faster. Ratios above 1: the second backend is faster.")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
