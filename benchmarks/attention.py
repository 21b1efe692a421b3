"""Attention backends side by side, forward + backward, in one run: every backend this device has, without
attention dropout and (those that take it) with dropout 0.1. On CPU: padded and nested SDPA, then padded SDPA and
`math` with dropout; on CUDA also torch_varlen (and flash with flash-attn), and whether nested SDPA reaches the flash
kernel.

    python benchmarks/attention.py            # writes benchmarks/results/attention.{json,md}
"""

from __future__ import annotations

import argparse

import torch
from common import median_time, write_results

from fastmae.attention import VarlenMeta, available_backends, varlen_attention


def make_stream(lengths: list[int], heads: int, head_dim: int, dtype, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(torch.int32)
    positions = torch.arange(total) - cu.long()[seq_ids.long()]
    meta = VarlenMeta.build(cu.to(device), max(lengths), seq_ids.to(device), positions.to(device))
    qkv = [torch.randn(total, heads, head_dim, generator=gen, dtype=torch.float32).to(device, dtype).requires_grad_()
           for _ in range(3)]
    return qkv, meta


def nested_reaches_flash(device: str) -> str:
    """'yes', or why nested jagged SDPA cannot run on the flash kernel here (bf16, dropout 0.1, backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    (q, k, v), meta = make_stream([300, 200, 512], 12, 64, torch.bfloat16, 0, device)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            varlen_attention(q, k, v, meta, dropout_p=0.1, backend="nested").float().sum().backward()
        return "yes"
    except RuntimeError as err:
        return f"no: {str(err).splitlines()[0][:200]}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        runs = [(b, 0.0) for b in available_backends(device) if b in ("padded", "nested")]
        runs += [("padded", 0.1), ("math", 0.1)]
        dtypes = (torch.float32, torch.bfloat16)
    else:
        backends = [b for b in available_backends(device) if b != "reference"]
        runs = [(b, 0.0) for b in backends] + [(b, 0.1) for b in backends if b != "torch_varlen"]
        dtypes = (torch.bfloat16,)
    shapes = [  # (name, lengths, heads, head_dim)
        ("8x512 full", [512] * 8, 8, 64),
        ("8x~435 visible (15% dropped)", [435] * 8, 8, 64),
        ("8x256 visible (50% dropped)", [256] * 8, 8, 64),
        ("16 docs 40..500", [40 + 30 * i for i in range(16)], 12, 64),
    ]
    rows = []
    for name, lengths, heads, head_dim in shapes:
        for dtype in dtypes:
            (q, k, v), meta = make_stream(lengths, heads, head_dim, dtype, seed=0, device=device)
            row = {"shape": name, "tokens": sum(lengths), "dtype": str(dtype).replace("torch.", "")}
            for backend, dropout_p in runs:
                def step():
                    out = varlen_attention(q, k, v, meta, dropout_p=dropout_p, backend=backend)
                    out.float().square().mean().backward()
                column = f"{backend} ms" + (f" (dropout {dropout_p})" if dropout_p else "")
                row[column] = 1e3 * median_time(step, warmup=1, repeats=args.repeats)
            row["nested / padded"] = row["nested ms"] / row["padded ms"]
            row["padded / math, dropout"] = row["padded ms (dropout 0.1)"] / row["math ms (dropout 0.1)"]
            if device == "cuda":
                row["nested / padded, dropout"] = row["nested ms (dropout 0.1)"] / row["padded ms (dropout 0.1)"]
            rows.append(row)
            print(row, flush=True)
    columns = list(rows[0])
    notes = "Median of repeats; lower is faster. Ratios above 1: the second backend is faster."
    if device == "cuda":
        notes += f" Nested jagged SDPA on the flash kernel (bf16, dropout, backward): {nested_reaches_flash(device)}."
    path = write_results("attention", rows, columns, f"Varlen attention on {device}: forward + backward", notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
