"""CPU attention backends side by side: padded SDPA vs nested-jagged SDPA, forward + backward, in one run.

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
    backends = [b for b in available_backends(device) if b in ("padded", "nested")]
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
            for backend in backends:
                def step():
                    out = varlen_attention(q, k, v, meta, backend=backend)
                    out.float().square().mean().backward()
                row[f"{backend} ms"] = 1e3 * median_time(step, warmup=1, repeats=args.repeats)
            row["nested / padded"] = row["nested ms"] / row["padded ms"]
            rows.append(row)
            print(row, flush=True)
    path = write_results("attention", rows, ["shape", "tokens", "dtype", "padded ms", "nested ms", "nested / padded"],
                         "Varlen attention on CPU: forward + backward", "Median of repeats; lower is faster.")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
