"""The systems benchmarks/throughput.py times (and host_overhead.py counts): each one's model config, the tokens it
trains on (random, the embedded corpus packed `full` or `doc`), its engine, one training step of it, and the
attention backend it runs with."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fastmae.config import ROLES, ModelConfig, SpecialTokens
from fastmae.flops import training_flops
from fastmae.hardware import DTYPES, use_cublas_workspace

FASTMAE = SpecialTokens()  # the special ids of the sentencepiece tokenizers fastmae trains

SIZES = {  # (hidden, heads, encoder layers)
    "small": dict(hidden_size=512, num_heads=8, encoder_layers=6),
    "base": dict(hidden_size=768, num_heads=12, encoder_layers=12),
}
VOCAB_SIZE, SEQ_LEN = 32000, 512
FASTMAE_SYSTEMS = {  # system -> (preset, overrides)
    "mlm": ("mlm", {}),
    "mae-lm": ("mae-lm", {}),
    "3ml": ("3ml", {}),
    "3ml-cross": ("3ml", {"decoder_kind": "cross"}),
    # the reference encoder's relative position bias, with attention dropout and without (on CUDA FlexAttention
    # then; on CPU padded SDPA): the `attention` column says which backend each row ran
    "mae-lm-relbias": ("mae-lm", {"relative_attention_bias": True}),
    "mae-lm-relbias-no-dropout": ("mae-lm", {"relative_attention_bias": True, "attention_dropout": 0.0}),
}
MODERN = dict(ffn_gated=True, linear_bias=False, norm_bias=False, norm_position="pre", first_attention_norm=False,
              position_embedding="rotary", global_attention_every=3, local_window=128, dropout=0.0,
              attention_dropout=0.0)
MODERN_SYSTEMS = {  # system -> (preset, overrides) on ModernBERT's layers
    "modern-mlm": ("mlm", {"mask_rate": 0.3}),
    "modern-3ml": ("3ml", {}),
    "modern-mae-lm": ("mae-lm", {}),
}
HF_SYSTEMS = ("hf-roberta", "hf-modernbert")
SYSTEMS = (*HF_SYSTEMS, *FASTMAE_SYSTEMS, *MODERN_SYSTEMS)
REAL_DATA = "real data"
"""The variant that trains on the embedded corpus packed `full` (separators inside) instead of random tokens."""
DOC_DATA = "real doc data"
"""The variant that trains on the embedded corpus packed `doc` (documents apart, lengths as they come):
DOC_MICRO_BATCHES micro-batches of the same token budget make one optimizer step, padded to the shapes graphs replay
where they do."""
DOC_MICRO_BATCHES = 4
EAGER = "eager"
"""The variant that runs every micro-batch eagerly (train.cuda_graphs=never) where the others replay CUDA graphs."""
NO_WORKSPACE = "no cuBLAS workspace"
"""The variant that gives cuBLAS no workspace (train.cublas_workspace=none): one kernel a GEMM."""
GRAPHS_TWIN = "cuda graphs twin"
"""The variant that runs CUDA graphs' CPU twin (fastmae.graphs) where the device has no CUDA (host_overhead.py)."""


def model_config(system: str, size: str) -> ModelConfig:
    """The fastmae config of `system` at `size` (hf-roberta, hf-modernbert: the `mlm` config each mirrors)."""
    if system in MODERN_SYSTEMS or system == "hf-modernbert":
        preset, overrides = MODERN_SYSTEMS.get(system, MODERN_SYSTEMS["modern-mlm"])
        shape = dict(SIZES[size], intermediate_size=SIZES[size]["hidden_size"] * 3 // 2)
        return ModelConfig.preset(preset, vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN, **shape, **MODERN, **overrides)
    preset, overrides = FASTMAE_SYSTEMS.get(system, ("mlm", {}))
    return ModelConfig.preset(preset, vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN, **SIZES[size], **overrides)


def make_tokens(sequences: int) -> torch.Tensor:
    """[sequences, SEQ_LEN] int64: <s>, random ordinary tokens, </s>; the same for every system."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(len(ROLES), VOCAB_SIZE, (sequences, SEQ_LEN), generator=gen)
    ids[:, 0], ids[:, -1] = FASTMAE.bos, FASTMAE.eos
    return ids


def embedded_corpus() -> Path:
    """The embedded corpus's dataset directory (prepared once where `data.path: builtin` prepares it)."""
    from fastmae.config import DataConfig

    data = DataConfig()
    if not (data.directory / "meta.json").is_file():
        from fastmae.prepare import prepare

        prepare([], data.directory, fmt="builtin", vocab_size=data.builtin_vocab_size,
                valid_fraction=data.builtin_valid_fraction, workers=1, progress=False)
    return data.directory


def real_tokens(sequences: int) -> torch.Tensor:
    """[sequences, SEQ_LEN] int64: the first full-length sequences of the embedded corpus packed `full`, document
    separators inside, as training sees them."""
    import numpy as np

    from fastmae.data import PackedLoader

    loader = PackedLoader(embedded_corpus(), "train", max_seq_len=SEQ_LEN, packing="full", tokens_per_batch=SEQ_LEN)
    tokens, lengths = loader.tokens_of(np.arange(loader.num_sequences))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[lengths == SEQ_LEN][:sequences]
    if len(starts) < sequences:
        raise SystemExit(f"the embedded corpus has {len(starts)} full-length sequences, fewer than {sequences}")
    return torch.from_numpy(np.stack([tokens[s:s + SEQ_LEN] for s in starts]).astype(np.int64))


def doc_micro_batches(sequences: int) -> list:
    """The first DOC_MICRO_BATCHES micro-batches of the embedded corpus packed `doc`, each of at most sequences x
    SEQ_LEN tokens (PackedBatches, as the data loader yields them)."""
    from fastmae.data import PackedLoader

    loader = iter(PackedLoader(embedded_corpus(), "train", max_seq_len=SEQ_LEN, packing="doc",
                               tokens_per_batch=sequences * SEQ_LEN, grad_accum=DOC_MICRO_BATCHES))
    return [next(loader) for _ in range(DOC_MICRO_BATCHES)]


# ------------------------------------------------------------------------------------------- one system, one process
def init_world_of_one() -> None:
    from fastmae.distributed import init_distributed, set_world_of_one_env

    set_world_of_one_env()
    init_distributed()


ZERO_STAGE = 2
"""The ZeRO stage the benchmarks' engines train with: the recipes' (bf16 steps ask for no host-device sync there, where
ZeRO-1's bf16 optimizer reads its gradient norm on the host every step)."""


def default_run(zero_stage: int = ZERO_STAGE):
    """The run config the benchmark's engines train with unless given one: fastmae's defaults at `zero_stage`."""
    from fastmae.config import RunConfig

    run = RunConfig()
    run.train.zero_stage = zero_stage
    return run


def engine_for(model: torch.nn.Module, precision: str, device: torch.device, non_finite: torch.Tensor | None = None,
            run=None):
    """The DeepSpeed engine fastmae.engine builds, for a world of one with the train settings of `run` (default: the
    defaults, AdamW with RoBERTa's betas and eps, clipping at 2.0, ZERO_STAGE, or ZeRO-0 in fp32); `non_finite`: the
    skip flag the trainer's step keeps."""
    from fastmae.engine import build_engine

    run = default_run() if run is None else run
    if precision == "fp32":  # ZeRO partitions nothing in a world of one; without it fp32 steps plainly
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, zero_stage=0))
    return build_engine(model, run, precision, device, non_finite)[0]


def hf_step(config: ModelConfig, tokens: torch.Tensor, device: torch.device, precision: str, run=None):
    """A training-step closure for Hugging Face RobertaForMaskedLM, and its model FLOPs per step."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    hf = RobertaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       num_hidden_layers=config.encoder_layers, num_attention_heads=config.num_heads,
                       intermediate_size=config.intermediate_size, max_position_embeddings=SEQ_LEN + 2,
                       type_vocab_size=1, pad_token_id=0, bos_token_id=FASTMAE.bos, eos_token_id=FASTMAE.eos,
                       hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.attention_dropout,
                       layer_norm_eps=config.layer_norm_eps, attn_implementation="sdpa")
    step, _ = masked_lm_step(engine_for(RobertaForMaskedLM(hf), precision, device, run=run), config, tokens, device)
    lengths = torch.full((tokens.shape[0],), SEQ_LEN)
    return step, training_flops(config, lengths, lengths, lengths)  # the LM head runs on every row


def hf_modernbert_step(config: ModelConfig, tokens: torch.Tensor, device: torch.device, precision: str, run=None):
    """A training-step closure for transformers' ModernBertForMaskedLM (sdpa, `sparse_prediction`: the head on the
    masked rows only), and its model FLOPs per step (the same count as fastmae's mlm on these layers)."""
    from transformers import ModernBertForMaskedLM

    from fastmae.hf import modernbert

    hf = modernbert.hugging_face_config(config, {})
    hf.sparse_prediction, hf._attn_implementation = True, "sdpa"
    step, chosen = masked_lm_step(engine_for(ModernBertForMaskedLM(hf), precision, device, run=run), config, tokens,
                                  device)
    lengths = torch.full((tokens.shape[0],), SEQ_LEN)
    return step, training_flops(config, lengths, lengths, chosen.sum(1))


def masked_lm_step(engine, config: ModelConfig, tokens: torch.Tensor, device: torch.device):
    """(a training-step closure of a Hugging Face masked LM's engine on `tokens` with `config.mask_rate` of them
    replaced by <mask> (one fixed draw, never <s> or </s>), the [sequences, length] bool of the chosen ones)."""
    gen = torch.Generator().manual_seed(1)
    chosen = torch.rand(tokens.shape, generator=gen) < config.mask_rate
    chosen[:, 0] = chosen[:, -1] = False
    labels = torch.where(chosen, tokens, -100).to(device)
    inputs = torch.where(chosen, FASTMAE.mask, tokens).to(device)

    def step():
        loss = engine(input_ids=inputs, labels=labels).loss
        engine.backward(loss)
        engine.step()

    return step, chosen


def fastmae_step(config: ModelConfig, tokens: torch.Tensor | list, device: torch.device, precision: str,
                  variant: str | None, run=None):
    """A training-step closure for fastmae's MaskedLM (the trainer's `train_step`, on micro-batches masked and moved
    as the trainer's are), and its model FLOPs per step. `tokens`: [sequences, length] ids, one micro-batch a step,
    or the PackedBatches that make one step (DOC_DATA: padded to the shapes graphs replay where they do)."""
    from fastmae import MaskedLM, PackedBatch
    from fastmae.batch import to_device_ahead
    from fastmae.flops import masked_training_flops
    from fastmae.graphs import StepGraphs, plan_graphs
    from fastmae.masking import mask_batch
    from fastmae.pipeline import masked_ahead
    from fastmae.step import train_step

    run = default_run() if run is None else run
    run = dataclasses.replace(run, model=config)  # what plans its CUDA graphs is the system's model, not the default
    if variant == EAGER:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, cuda_graphs="never"))
    if variant == NO_WORKSPACE:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, cublas_workspace="none"))
    use_cublas_workspace(run.train.cublas_workspace, device)  # as the trainer does, before the first GEMM
    model = MaskedLM(config)
    if variant == "compiled":
        model.compile_layers()
    elif variant not in (REAL_DATA, DOC_DATA, EAGER, GRAPHS_TWIN, NO_WORKSPACE):
        model.set_attention_backend(variant)
    batches = [PackedBatch.from_sequences(tokens.tolist())] if isinstance(tokens, torch.Tensor) else tokens
    if variant == DOC_DATA:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, grad_accum=len(batches)), data=(
            dataclasses.replace(run.data, packing="doc", tokens_per_micro_batch=max(b.num_tokens for b in batches))))
    non_finite = torch.zeros((), dtype=torch.float32, device=device)
    engine = engine_for(model, precision, device, non_finite, run)
    if variant == GRAPHS_TWIN and model.graphs is None:
        StepGraphs(model, capture=False)
    # each step masks anew (other micro-batch indices), on the host ahead of use, as the trainer does
    endless = (dataclasses.replace(batches[index % len(batches)], index=index) for index in range(1 << 30))
    micro_batches = to_device_ahead(masked_ahead(endless, config, seed=0, pin_memory=device.type == "cuda",
                                                 shapes=plan_graphs(run, device, precision).shapes), device)

    def step():
        train_step(engine, [next(micro_batches) for _ in batches], seed=0, non_finite=non_finite)

    step.graphs = model.graphs  # fastmae.graphs.StepGraphs where the step replays CUDA graphs, else None
    step.tokens = sum(batch.num_tokens for batch in batches)
    # the counts follow the lengths alone: the same every step
    flops = sum(masked_training_flops(config, mask_batch(batch, config, seed=0, step=0)) for batch in batches)
    return step, flops


def attention_backend(system: str, config: ModelConfig, device: torch.device, precision: str,
                      variant: str | None) -> str:
    """The attention backend a system's encoder runs (Hugging Face: its SDPA), and its local layers' where it has
    some."""
    from fastmae.attention import local_in_bands, resolve_backend
    from fastmae.layers import local_backends

    if system in HF_SYSTEMS:
        return "hf sdpa"
    backend = None if variant in (None, "compiled", REAL_DATA, DOC_DATA, EAGER, NO_WORKSPACE) else variant
    dtype = DTYPES[precision]
    names = resolve_backend(backend, device, config.attention_dropout, dtype, biased=config.relative_attention_bias,
                            rectangular=variant != DOC_DATA)
    if backend is None:
        for stream, local in local_backends(config, device, dtype, config.attention_dropout).items():
            names += f"; local ({stream}): {local}" + (" in bands" if local_in_bands(local, device, dtype) else "")
    elif "local" in config.layer_kinds:
        names += f"; local: {backend}"
    return names


