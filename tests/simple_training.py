"""A plain single-process training loop on generated documents, for tests that need a few optimizer steps without
DeepSpeed (the learning test, kernels-vs-references training)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from synthetic import markov_documents

from fastmae import MaskedLM, ModelConfig, PackedBatch
from fastmae.optim import param_groups
from fastmae.schedule import lr_multiplier


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


def train_on_documents(model: MaskedLM, documents: list[list[int]], loop: LoopConfig):
    """Train `model` on `documents` (cycled, packed `sequences_per_batch` at a time); return per-step losses."""
    torch.manual_seed(loop.seed)
    # fused: one kernel over every parameter, as the trainer's optimizer (DeepSpeed's fused AdamW); 10-15% of a step
    # of these tiny models against torch's loop over the parameters on CPU
    optimizer = torch.optim.AdamW(param_groups(model, loop.weight_decay), lr=loop.lr, betas=(0.9, 0.98), eps=1e-6,
                                  fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda s: lr_multiplier(s, loop.warmup_steps, loop.steps))
    n = loop.sequences_per_batch
    device = next(model.parameters()).device
    batches = [PackedBatch.from_sequences(documents[i:i + n], model.config.vocab_size).to(device)
               for i in range(0, len(documents) - n + 1, n)]
    model.train()
    losses = []
    for step in range(loop.steps):
        out = model(batches[step % len(batches)], seed=loop.seed, step=step)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.item())
    return losses


def demo_config(objective: str) -> ModelConfig:
    """A tiny model that learns the generated corpus in seconds."""
    return ModelConfig.preset(objective, vocab_size=64, hidden_size=64, num_heads=4, encoder_layers=2, max_seq_len=64,
                              dropout=0.0, attention_dropout=0.0,
                              **({"decoder_layers": 1} if objective != "mlm" else {}))


def demo_documents(vocab_size: int, seed: int) -> list[list[int]]:
    """512 Markov-chain documents of 16 to 40 tokens."""
    return markov_documents(512, vocab_size, 16, 40, seed=seed)
