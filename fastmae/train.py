"""Pretraining entry point. For now a single-process loop on the generated corpus (the offline demo).

    python -m fastmae.train --objective mae-lm --steps 300
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .batch import PackedBatch
from .config import ModelConfig
from .model import MaskedLM
from .synthetic import markov_documents


@dataclass
class LoopConfig:
    """Optimisation settings of the simple loop."""

    steps: int = 800
    """Optimizer steps."""
    sequences_per_batch: int = 16
    """Sequences in each packed batch."""
    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 20
    """Linear warm-up steps, then linear decay to 0."""
    weight_decay: float = 0.01
    clip_norm: float = 2.0
    seed: int = 0


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1 over `warmup` steps, then linear decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def train_on_documents(model: MaskedLM, documents: list[list[int]], loop: LoopConfig, progress: bool = False):
    """Train `model` on `documents` (cycled, packed `sequences_per_batch` at a time); return per-step losses."""
    torch.manual_seed(loop.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "norm" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": loop.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=loop.lr, betas=(0.9, 0.98),
                                  eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, loop.warmup_steps, loop.steps))
    n = loop.sequences_per_batch
    batches = [PackedBatch.from_sequences(documents[i:i + n], model.config.vocab_size)
               for i in range(0, len(documents) - n + 1, n)]
    model.train()
    losses = []
    bar = tqdm(range(loop.steps), disable=not progress, desc=model.config.objective, dynamic_ncols=True,
               mininterval=1.0)
    for step in bar:
        out = model(batches[step % len(batches)], seed=loop.seed, step=step)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # the demo loop logs every step; the distributed trainer will not
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def demo_config(objective: str) -> ModelConfig:
    """The tiny model of the CPU demo (and of the test that each objective learns): seconds per hundred steps."""
    return ModelConfig.preset(objective, vocab_size=64, hidden_size=64, num_heads=4, encoder_layers=2, max_seq_len=64,
                              dropout=0.0, attention_dropout=0.0,
                              **({"decoder_layers": 1} if objective != "mlm" else {}))


def demo_documents(vocab_size: int, seed: int) -> list[list[int]]:
    """The generated corpus of the demo: 512 Markov-chain documents of 16 to 40 tokens."""
    return markov_documents(512, vocab_size, 16, 40, seed=seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a tiny masked LM on the generated corpus (CPU demo).")
    parser.add_argument("--objective", choices=["mlm", "mae-lm", "3ml"], default="mae-lm")
    parser.add_argument("--steps", type=int, default=LoopConfig.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # CPU matmuls slow down ~40x on denormal floats, which confident softmaxes produce in the LM-head gradient
    torch.set_flush_denormal(True)
    config = demo_config(args.objective)
    torch.manual_seed(args.seed)
    model = MaskedLM(config)
    documents = demo_documents(config.vocab_size, args.seed)
    losses = train_on_documents(model, documents, LoopConfig(steps=args.steps, seed=args.seed), progress=True)
    head, tail = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    uniform = math.log(config.vocab_size - 5)
    print(f"{args.objective}: masked-token loss {head:.3f} -> {tail:.3f} (uniform guess over the vocabulary: "
          f"{uniform:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
