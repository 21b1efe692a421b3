"""Shared fixtures: tiny configs and batches that run in milliseconds on CPU."""

from __future__ import annotations

import pytest
import torch

from fastmae import MaskedLM, ModelConfig, PackedBatch
from fastmae.synthetic import markov_documents

TINY = dict(vocab_size=97, hidden_size=48, num_heads=4, intermediate_size=80, encoder_layers=2, max_seq_len=128)


def tiny_config(preset: str = "mae-lm", **overrides) -> ModelConfig:
    """A small config of `preset`; dropout off so outputs are deterministic."""
    values = {**TINY, "dropout": 0.0, "attention_dropout": 0.0, **overrides}
    return ModelConfig.preset(preset, **values)


def tiny_model(preset: str = "mae-lm", seed: int = 0, **overrides) -> MaskedLM:
    torch.manual_seed(seed)
    return MaskedLM(tiny_config(preset, **overrides)).eval()


def tiny_batch(num_sequences: int = 5, seed: int = 0, min_len: int = 6, max_len: int = 40,
               vocab_size: int = TINY["vocab_size"]) -> PackedBatch:
    return PackedBatch.from_sequences(markov_documents(num_sequences, vocab_size, min_len, max_len, seed=seed))


@pytest.fixture
def batch() -> PackedBatch:
    return tiny_batch()
