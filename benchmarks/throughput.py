"""Training throughput and MFU of fastmae's objectives against Hugging Face RobertaForMaskedLM and
ModernBertForMaskedLM, in one run.

    python benchmarks/throughput.py [--size small|base|small,base] [--quick] [--dtype auto|fp32|bf16]

Every system trains on the same random tokens (sequences of 512 with <s> ... </s>, vocabulary 32,000) for full
steps through the engine fastmae trains with (fastmae.engine.build_engine: DeepSpeed ZeRO-1 in bf16 or ZeRO-0 in
fp32, fp32 master weights and gradient accumulation, fused AdamW, clipping at 2.0). fastmae's systems run the
trainer's own step (fastmae.step.train_step: masking, forward, the per-token weighted backward, the optimizer step);
Hugging Face's runs forward, backward and the optimizer step.
Each system runs in a fresh process (its peak memory is its own); the GEMM peak that MFU divides by is measured
in the same run, in the training dtype, and again when a system beats it (fastmae.hardware.PeakFlops; ARCHITECTURE.md
sections 5 and 8). Model FLOPs are fastmae/flops.py's
count of what each system computes: Hugging Face runs its LM head on every row, fastmae on the predicted rows only. With
--backends (CUDA), `mlm` also runs with each attention backend present; with --compile every fastmae system also runs
with its layers compiled (train.compile). On CUDA fastmae's steps replay CUDA graphs of the forward and backward
(train.cuda_graphs=auto, fastmae/graphs.py; the `cuda_graphs` column counts the replayed micro-batches); --eager adds
each fastmae system without them. --real-data adds 3ml on the embedded corpus, packed `full` and packed `doc` (its
micro-batches padded to fixed shapes where graphs replay; tokens and FLOPs count its own sequences).
The `modern-*` systems are fastmae's objectives on ModernBERT's layers (GeGLU of 1.5 x the width, no biases, pre-LN,
a global layer every 3rd, the others over windows of 128 positions; mlm at ModernBERT's 30% masking) and
`hf-modernbert` is transformers' ModernBertForMaskedLM of the same shape at its best CPU/GPU settings (sdpa,
`sparse_prediction`: its head on the masked rows only), so both count the same model FLOPs.

On CUDA every system's step is also profiled (3 steps after the timed ones): `gpu_busy` is the share of the step's
wall time that the GPU spends in kernels (well below 1: the host cannot keep up, or waits), and the busiest kernels
are printed.

Writes benchmarks/results/throughput.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
from pathlib import Path

import torch
from common import RESULTS_DIR, gpu_kernel_profile, median_time, write_results

from fastmae.config import ROLES, ModelConfig, SpecialTokens
from fastmae.flops import training_flops
from fastmae.hardware import DTYPES, PeakFlops, choose_precision, matmul_flops

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


def _embedded_corpus() -> Path:
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

    loader = PackedLoader(_embedded_corpus(), "train", max_seq_len=SEQ_LEN, packing="full", tokens_per_batch=SEQ_LEN)
    tokens, lengths = loader.tokens_of(np.arange(loader.num_sequences))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[lengths == SEQ_LEN][:sequences]
    if len(starts) < sequences:
        raise SystemExit(f"the embedded corpus has {len(starts)} full-length sequences, fewer than {sequences}")
    return torch.from_numpy(np.stack([tokens[s:s + SEQ_LEN] for s in starts]).astype(np.int64))


def doc_micro_batches(sequences: int) -> list:
    """The first DOC_MICRO_BATCHES micro-batches of the embedded corpus packed `doc`, each of at most sequences x
    SEQ_LEN tokens (PackedBatches, as the data loader yields them)."""
    from fastmae.data import PackedLoader

    loader = iter(PackedLoader(_embedded_corpus(), "train", max_seq_len=SEQ_LEN, packing="doc",
                               tokens_per_batch=sequences * SEQ_LEN, grad_accum=DOC_MICRO_BATCHES))
    return [next(loader) for _ in range(DOC_MICRO_BATCHES)]


# ------------------------------------------------------------------------------------------- one system, one process
def _init_world_of_one() -> None:
    from fastmae.distributed import init_distributed, set_world_of_one_env

    set_world_of_one_env()
    init_distributed()


def _default_run():
    """The run config the benchmark's engines train with unless given one: fastmae's defaults at ZeRO-1."""
    from fastmae.config import RunConfig

    run = RunConfig()
    run.train.zero_stage = 1
    return run


def _engine(model: torch.nn.Module, precision: str, device: torch.device, non_finite: torch.Tensor | None = None,
            run=None):
    """The DeepSpeed engine fastmae.engine builds, for a world of one with the train settings of `run` (default: the
    defaults, AdamW with RoBERTa's betas and eps, clipping at 2.0, ZeRO-1, or ZeRO-0 in fp32); `non_finite`: the skip
    flag the trainer's step keeps."""
    from fastmae.engine import build_engine

    run = _default_run() if run is None else run
    if precision == "fp32":  # ZeRO partitions nothing in a world of one; without it fp32 steps plainly
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, zero_stage=0))
    return build_engine(model, run, precision, device, non_finite)[0]


def _hf_step(config: ModelConfig, tokens: torch.Tensor, device: torch.device, precision: str, run=None):
    """A training-step closure for Hugging Face RobertaForMaskedLM, and its model FLOPs per step."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    hf = RobertaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       num_hidden_layers=config.encoder_layers, num_attention_heads=config.num_heads,
                       intermediate_size=config.intermediate_size, max_position_embeddings=SEQ_LEN + 2,
                       type_vocab_size=1, pad_token_id=0, bos_token_id=FASTMAE.bos, eos_token_id=FASTMAE.eos,
                       hidden_dropout_prob=config.dropout, attention_probs_dropout_prob=config.attention_dropout,
                       layer_norm_eps=config.layer_norm_eps, attn_implementation="sdpa")
    step, _ = _masked_lm_step(_engine(RobertaForMaskedLM(hf), precision, device, run=run), config, tokens, device)
    lengths = torch.full((tokens.shape[0],), SEQ_LEN)
    return step, training_flops(config, lengths, lengths, lengths)  # the LM head runs on every row


def _hf_modernbert_step(config: ModelConfig, tokens: torch.Tensor, device: torch.device, precision: str):
    """A training-step closure for transformers' ModernBertForMaskedLM (sdpa, `sparse_prediction`: the head on the
    masked rows only), and its model FLOPs per step (the same count as fastmae's mlm on these layers)."""
    from transformers import ModernBertForMaskedLM

    from fastmae.hf import modernbert

    hf = modernbert.hugging_face_config(config, {})
    hf.sparse_prediction, hf._attn_implementation = True, "sdpa"
    step, chosen = _masked_lm_step(_engine(ModernBertForMaskedLM(hf), precision, device), config, tokens, device)
    lengths = torch.full((tokens.shape[0],), SEQ_LEN)
    return step, training_flops(config, lengths, lengths, chosen.sum(1))


def _masked_lm_step(engine, config: ModelConfig, tokens: torch.Tensor, device: torch.device):
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


def _fastmae_step(config: ModelConfig, tokens: torch.Tensor | list, device: torch.device, precision: str,
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

    model = MaskedLM(config)
    if variant == "compiled":
        model.compile_layers()
    elif variant not in (REAL_DATA, DOC_DATA, EAGER, GRAPHS_TWIN):
        model.set_attention_backend(variant)
    run = _default_run() if run is None else run
    run = dataclasses.replace(run, model=config)  # what plans its CUDA graphs is the system's model, not the default
    if variant == EAGER:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, cuda_graphs="never"))
    batches = [PackedBatch.from_sequences(tokens.tolist())] if isinstance(tokens, torch.Tensor) else tokens
    if variant == DOC_DATA:
        run = dataclasses.replace(run, train=dataclasses.replace(run.train, grad_accum=len(batches)), data=(
            dataclasses.replace(run.data, packing="doc", tokens_per_micro_batch=max(b.num_tokens for b in batches))))
    non_finite = torch.zeros((), dtype=torch.float32, device=device)
    engine = _engine(model, precision, device, non_finite, run)
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
    backend = None if variant in (None, "compiled", REAL_DATA, DOC_DATA, EAGER) else variant
    dtype = DTYPES[precision]
    names = resolve_backend(backend, device, config.attention_dropout, dtype, biased=config.relative_attention_bias,
                            rectangular=variant != DOC_DATA)
    if backend is None:
        for stream, local in local_backends(config, device, dtype, config.attention_dropout).items():
            names += f"; local ({stream}): {local}" + (" in bands" if local_in_bands(local, device, dtype) else "")
    elif "local" in config.layer_kinds:
        names += f"; local: {backend}"
    return names


def _resident_mib() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB (Linux)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure_system(system: str, size: str, sequences: int, precision: str, warmup: int, repeats: int,
                   variant: str | None) -> dict:
    """Median step time, tokens/s, model FLOPs per step and peak memory of one system (run in its own process).
    variant: None, an attention backend, or "compiled"."""
    _init_world_of_one()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # as the trainer does
    baseline_mib, _ = _resident_mib()
    torch.manual_seed(0)
    config = model_config(system, size)
    if variant == "torch_varlen":  # varlen_attn takes no attention dropout: this row measures the kernel without it
        config = dataclasses.replace(config, attention_dropout=0.0)
    tokens = real_tokens(sequences) if variant == REAL_DATA else make_tokens(sequences)
    if system in HF_SYSTEMS:
        make_step = _hf_step if system == "hf-roberta" else _hf_modernbert_step
        step, flops = make_step(config, tokens, device, precision)
        step.tokens = tokens.numel()
    else:
        step, flops = _fastmae_step(config, doc_micro_batches(sequences) if variant == DOC_DATA else tokens, device,
                                    precision, variant)
    seconds = median_time(step, warmup=warmup, repeats=repeats)
    result = {"step_s": seconds, "tokens_per_step": step.tokens, "tokens_per_s": step.tokens / seconds,
              "flops_per_step": flops,
              "attention": attention_backend(system, config, device, precision, variant)}
    graphs = getattr(step, "graphs", None)
    result["cuda_graphs"] = f"{graphs.replayed_batches} replayed" if graphs is not None else "no"
    if device.type == "cuda":
        result["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
        busy_s, result["gpu_kernels_per_step"], result["gpu_kernel_kinds"] = gpu_kernel_profile(
            step, f"{system} [{variant or 'eager'}]", top=25)
        result["gpu_busy"] = busy_s / seconds
    else:
        result["peak_memory_mib"] = _resident_mib()[1] - baseline_mib
    return result


def _run_isolated(*args) -> dict:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure_system, args)


# --------------------------------------------------------------------------------------------------------- report
def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{row['size']} {row['system']}" for row in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.barh(names, [row["tokens_per_s"] for row in rows], color="tab:blue")
    ax1.set_xlabel("training tokens / s")
    ax2.barh(names, [row["mfu"] or 0.0 for row in rows], color="tab:orange")  # none: no measured peak
    ax2.set_xlabel("MFU (model FLOPs / measured GEMM peak)")
    ax2.set_xlim(0, 1)
    for ax in (ax1, ax2):
        ax.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help=f"one of {sorted(SIZES)}, or several, comma-separated")
    parser.add_argument("--quick", action="store_true", help="4 sequences, 1 warm-up + 3 timed steps (< 2 minutes)")
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto",
                        help="training dtype; auto: bf16 where the device multiplies it natively "
                             "(ARCHITECTURE.md section 5)")
    parser.add_argument("--sequences", type=int, default=None, help="sequences of 512 per step (default 8; quick 4)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--backends", action="store_true", help="CUDA: also mlm with each attention backend")
    parser.add_argument("--compile", action="store_true", help="also each fastmae system with compiled layers")
    parser.add_argument("--name", default="throughput", help="results file name under benchmarks/results/ "
                        "(gpu_check: throughput_recipe at the recipes' micro-batch)")
    parser.add_argument("--eager", action="store_true",
                        help="CUDA: also each fastmae system without CUDA graphs (train.cuda_graphs=never)")
    parser.add_argument("--real-data", action="store_true",
                        help="also 3ml on the embedded corpus packed `full` (separators inside, as training sees it) "
                             "and packed `doc` (4 micro-batches a step; padded to fixed shapes where graphs replay)")
    args = parser.parse_args(argv)
    systems, sizes = args.systems.split(","), args.size.split(",")
    if not set(sizes) <= set(SIZES):
        parser.error(f"--size: unknown {sorted(set(sizes) - set(SIZES))}; choose from {sorted(SIZES)}")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {SYSTEMS}")
    if set(HF_SYSTEMS) & set(systems):
        try:
            import transformers  # noqa: F401
        except ImportError:
            parser.error("hf-roberta and hf-modernbert need transformers: pip install -e '.[hf]' (or leave them out "
                         "with --systems)")
    sequences = args.sequences or (4 if args.quick else 8)
    warmup, repeats = (1, 3) if args.quick else (2, 5)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision, line = choose_precision(args.dtype, device)
    if line:
        print(line, flush=True)
    peak = PeakFlops(matmul_flops(device, DTYPES[precision]), lambda: matmul_flops(device, DTYPES[precision]),
                     log=lambda line: print(line, flush=True))
    print(f"{device} GEMM peak in {precision}: {peak.flops / 1e9:.1f} GFLOP/s", flush=True)

    runs = [(system, None) for system in systems]
    if args.backends and device.type == "cuda":
        from fastmae.attention import available_backends

        runs += [("mlm", b) for b in available_backends(device) if b != "reference"]
    if args.compile:
        runs += [(system, "compiled") for system in systems if system not in HF_SYSTEMS]
    if args.eager and device.type == "cuda":
        runs += [(system, EAGER) for system in systems if system not in HF_SYSTEMS]
    if args.real_data:
        runs += [("3ml", REAL_DATA), ("3ml", DOC_DATA)]
    rows = []
    for size in sizes:
        size_rows = []
        for system, variant in runs:
            note = ", no attn dropout" if variant == "torch_varlen" else ""
            name = system if variant is None else f"{system} [{variant}{note}]"
            result = _run_isolated(system, size, sequences, precision, warmup, repeats, variant)
            size_rows.append({"system": name, "size": size, "dtype": precision, **result})
            mfu = peak.mfu(result["flops_per_step"] / result["step_s"], name)
            print(f"{size:>5} {name:>16}: {result['tokens_per_s']:8.1f} tokens/s  step {result['step_s']:.3f} s  "
                  f"MFU {'-' if mfu is None else f'{mfu:.3f}'}  peak memory "
                  f"{result['peak_memory_mib']:.0f} MiB", flush=True)
        peers = {peer: next((row["tokens_per_s"] for row in size_rows if row["system"] == peer), None)
                 for peer in HF_SYSTEMS}
        for row in size_rows:  # each system against the peer of its layers
            modern = row["system"].split(" [")[0] in (*MODERN_SYSTEMS, "hf-modernbert")
            reference = peers["hf-modernbert" if modern else "hf-roberta"]
            row["x_hf"] = row["tokens_per_s"] / reference if reference else None
            row["gflops_per_step"] = row["flops_per_step"] / 1e9
        rows += size_rows
    for row in rows:  # against the final peak: one denominator for every row; none where no GEMM reached a row's rate
        row["mfu"] = None if peak.kind == "achieved" else row["flops_per_step"] / row["step_s"] / peak.flops
        row["peak_source"] = peak.kind
    unseen = graph_rows_without_kernels(rows)

    shapes = ", ".join(f"{size} = {SIZES[size]['encoder_layers']} x {SIZES[size]['hidden_size']}" for size in sizes)
    title = (f"{shapes}; {sequences} x {SEQ_LEN} tokens, vocab {VOCAB_SIZE}, {precision}, peak "
             f"{peak.flops / 1e9:.0f} GFLOP/s")
    notes = (f"{title}. Full training steps (DeepSpeed + AdamW), median of {repeats} after {warmup} warm-up. "
             f"MFU = model FLOPs / (step time x the {peak.source}); Hugging Face RoBERTa's FLOPs include its LM "
             "head on every row; x_hf: against hf-modernbert for the modern-* rows, hf-roberta for the others. "
             "Peak memory: CUDA allocator peak, or resident-set growth of the system's process."
             + (f" gpu_busy left out for {', '.join(unseen)}: its profile saw under half the kernels of the same "
                "system's eager row, so it missed the replayed graphs' kernels." if unseen else ""))
    columns = ["size", "system", "attention", "tokens_per_s", "x_hf", "step_s", "gflops_per_step", "mfu",
               "peak_memory_mib"]
    if device.type == "cuda":
        columns += ["gpu_busy", "cuda_graphs"]
    header = {"dtype": precision, "peak_flops": peak.flops, "peak_source": peak.source, "sizes": sizes,
              "sequences": sequences, "seq_len": SEQ_LEN, "vocab_size": VOCAB_SIZE, "versions": _versions()}
    path = write_results(args.name, rows, columns, "Training throughput and MFU", notes, header)
    _plot(rows, RESULTS_DIR / f"{args.name}.png", title)
    print(f"wrote {path} and {args.name}.json, {args.name}.png")
    return 0


def graph_rows_without_kernels(rows: list[dict]) -> list[str]:
    """Rows whose CUDA graphs replayed but whose profile saw under half the kernels of the same system's eager row:
    the profiler counted the graph launches, not the kernels they ran. Their gpu_busy would read low, so it is set
    to None; returns their names."""
    eager = {(row["size"], row["system"].split(" [")[0]): row for row in rows if row["system"].endswith(f"[{EAGER}]")}
    unseen = []
    for row in rows:
        reference = eager.get((row["size"], row["system"].split(" [")[0]))
        replayed = row.get("cuda_graphs", "no") != "no" and not row["cuda_graphs"].startswith("0 ")
        if replayed and reference is not None and row is not reference and \
                row.get("gpu_kernels_per_step", 0) < 0.5 * reference.get("gpu_kernels_per_step", 0):
            row["gpu_busy"] = None
            unseen.append(row["system"])
    return unseen


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("deepspeed", "triton", "transformers", "flash-attn"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


if __name__ == "__main__":
    from fastmae.malloc import restart_with_malloc_tunables

    restart_with_malloc_tunables()  # as fastmae's entry points do; the systems' processes inherit it
    sys.exit(main())
