"""Each objective learns from context: on the generated corpus the masked-token loss falls well below its start and
below the corpus's unigram entropy (what predicting token frequencies alone reaches)."""

import math

import numpy as np
import pytest
import torch
from simple_training import LoopConfig, demo_config, demo_documents, train_on_documents

from fastmae import MaskedLM
from fastmae.config import SpecialTokens
from fastmae.evaluation import unigram_baselines

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains


# (3ml's `cross` decoder is left out: with one decoder layer it computes exactly what the `self` decoder computes at
# the predicted rows, so it would repeat the 3ml case)
@pytest.mark.parametrize("objective", ["mlm", "mae-lm", "3ml"])
def test_objective_learns(objective):
    config = demo_config(objective)
    documents = demo_documents(config.vocab_size, seed=0)
    torch.manual_seed(0)
    model = MaskedLM(config)
    losses = train_on_documents(model, documents, LoopConfig(steps=500, seed=0))
    start, end = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    assert abs(start - math.log(config.vocab_size - 5)) < 0.3  # starts near a uniform guess
    assert end < 0.65 * start, (start, end)  # measured: 0.49 (mlm), 0.61 (mae-lm), 0.59 (3ml) on an AVX2 CPU
    tokens = np.concatenate([np.asarray(d) for d in documents])
    entropy = unigram_baselines(tokens[~np.isin(tokens, FASTMAE.unmaskable)])["unigram_entropy"]  # 3.65 nats
    assert end < entropy - 0.5, (end, entropy)
