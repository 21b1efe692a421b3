"""The micro-batch that fills a GPU, from measured memory: the GPU recipes' `data.tokens_per_micro_batch`.

    python benchmarks/micro_batch.py [--budget 0.4]

A training step's peak memory is a part that does not depend on the micro-batch (weights, gradients, optimizer state)
plus activations that grow linearly with its tokens (packed rows, no padding; flash-attn's attention memory is linear
too). The fixed part is counted: 20 bytes per parameter under bf16 ZeRO on one GPU (bf16 weights and gradients, fp32
master weights and gradient accumulation, Adam's two fp32 moments). The slope comes from the peaks that GPU runs
measured (`peak_memory_mib` in benchmarks/results/gpu/DEVICE/throughput*.json, at their tokens per step): the
least-squares line through them when a system was measured at two micro-batch sizes or more, else
(peak - fixed) / tokens. A recipe not measured takes a measured one's slope (of its size if any) scaled by rows per
token summed over the layers and by width (marked as such until a GPU run measures it): that rule predicts 3ml's
measured base slope from mlm's 8% low, well inside the budget's margin.

Where CUDA graphs replay (the recipes' default on a GPU), two activation sets count: the recording's private pool
keeps one for good, and a micro-batch of another shape (a shard's last piece) runs eagerly beside it.
The choice is the largest power of two whose predicted peak stays within --budget of the device's memory (0.4: room
for the allocator's fragmentation, `doc` packing's uneven micro-batches, evaluation, and GPUs with half the memory),
at most RoBERTa's 8,192 x 512 tokens per step over 8 GPUs. Writes benchmarks/results/micro_batch.{json,md}; the
recipes in configs/ take its `chosen_tokens`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import torch
from common import RESULTS_DIR, write_results

from fastmae import MaskedLM, ModelConfig
from fastmae.config import load_run_config

REPO = Path(__file__).resolve().parent.parent

FIXED_BYTES_PER_PARAMETER = 20  # bf16 weight + bf16 grad + fp32 master + fp32 accumulation + 2 fp32 Adam moments
RECIPES = ("roberta-base", "mae-lm-base", "3ml-base", "roberta-large", "mae-lm-large", "3ml-large")
MAX_TOKENS = 8192 * 512 // 8
VOCAB_SIZE = 32000  # benchmarks/throughput.py's, where the peaks were measured
SYSTEM = {"mlm": "mlm", "mae-lm": "mae-lm", "3ml": "3ml"}  # ModelConfig.objective -> throughput.py's system


def recipe_model(recipe: str) -> ModelConfig:
    return load_run_config(str(REPO / "configs" / f"{recipe}.yaml"), [f"model.vocab_size={VOCAB_SIZE}"]).model


def parameters(config: ModelConfig) -> int:
    """Parameter count of the model (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sum(p.numel() for p in MaskedLM(config).parameters())


def layer_rows(config: ModelConfig) -> float:
    """Rows per input token summed over the layers (activations scale with it): layers [0, k) run on the visible
    rows, the rest and the decoder on every row."""
    visible = 1 - config.mask_rate * config.mask_token_prob
    return config.insert_layer * visible + (config.encoder_layers - config.insert_layer) + config.decoder_layers


def measured_points(gpu_dir: Path) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """(system, size) -> [(tokens per micro-batch, peak MiB)] from every throughput result of one device."""
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for path in sorted(gpu_dir.glob("throughput*.json")):
        for row in json.loads(path.read_text())["results"]:
            if row["system"] in SYSTEM.values() and row.get("peak_memory_mib"):
                points.setdefault((row["system"], row["size"]), []).append(
                    (int(row["tokens_per_step"]), float(row["peak_memory_mib"])))
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=0.4, help="fraction of the device's memory a step may peak at")
    parser.add_argument("--eager", action="store_true",
                        help="size for eager steps (one activation set) instead of replayed CUDA graphs (two)")
    parser.add_argument("--device-dir", default=None,
                        help="benchmarks/results/gpu/DEVICE with the measurements (default: the one whose name says "
                             "80GB)")
    args = parser.parse_args(argv)
    gpu_dirs = sorted((RESULTS_DIR / "gpu").glob("*80GB*")) if args.device_dir is None else [Path(args.device_dir)]
    if not gpu_dirs:
        parser.error("no GPU results with measured memory under benchmarks/results/gpu/: run scripts/gpu_check.sh")
    gpu_dir = gpu_dirs[0]
    device_gib = float(re.search(r"(\d+)GB", gpu_dir.name).group(1))
    points = measured_points(gpu_dir)
    activation_sets = 1 if args.eager else 2
    rows, slopes, measured_slopes = [], {}, {}
    for recipe in RECIPES:
        config = recipe_model(recipe)
        size = recipe.rsplit("-", 1)[1]
        params = parameters(config)
        fixed_mib = params * FIXED_BYTES_PER_PARAMETER / 2**20
        measured = points.get((SYSTEM[config.objective], size), [])
        if len(measured) >= 2:
            slope = float(np.polyfit(*zip(*measured), 1)[0])
            source = f"fit of {len(measured)} measured peaks"
        elif measured:
            slope = (measured[0][1] - fixed_mib) / measured[0][0]
            source = f"measured peak at {measured[0][0]} tokens"
        else:  # a measured recipe's slope (of this size if any), scaled by rows per token over the layers and width
            same_size = [r for r in measured_slopes if r.endswith(size)]
            known = (same_size or list(measured_slopes))[0]
            other = recipe_model(known)
            slope = slopes[known] * (layer_rows(config) * config.hidden_size) / (
                layer_rows(other) * other.hidden_size)
            source = f"{known}'s, scaled by layer rows x width (not measured)"
        slopes[recipe] = slope
        if measured:
            measured_slopes[recipe] = slope
        limit_mib = args.budget * device_gib * 1024
        per_token = slope * activation_sets
        tokens = 1 << 10
        while tokens * 2 <= MAX_TOKENS and fixed_mib + per_token * tokens * 2 <= limit_mib:
            tokens *= 2
        rows.append({"recipe": recipe, "objective": config.objective, "parameters": params,
                     "fixed_mib": fixed_mib, "mib_per_token": slope, "slope_from": source,
                     "chosen_tokens": tokens, "activation_sets": activation_sets,
                     "predicted_peak_mib": fixed_mib + per_token * tokens,
                     "predicted_peak_fraction": (fixed_mib + per_token * tokens) / (device_gib * 1024)})
        print(f"{recipe:>14}: {tokens:>6} tokens per micro-batch, predicted peak "
              f"{rows[-1]['predicted_peak_mib'] / 1024:.1f} GiB ({source})")
    notes = (f"Peak memory of a bf16 ZeRO training step on one {gpu_dir.name} ({device_gib:.0f} GB) = fixed "
             f"({FIXED_BYTES_PER_PARAMETER} bytes per parameter) + activation_sets x mib_per_token x tokens (two sets "
             "where CUDA graphs replay: the recording's pool and an eager micro-batch beside it), the slope from the "
             f"measurements in benchmarks/results/gpu/{gpu_dir.name}/throughput*.json; chosen: the largest power of "
             f"two within {args.budget:.0%} of the device, at most {MAX_TOKENS} (benchmarks/micro_batch.py).")
    columns = ["recipe", "parameters", "fixed_mib", "mib_per_token", "slope_from", "activation_sets", "chosen_tokens",
               "predicted_peak_mib", "predicted_peak_fraction"]
    path = write_results("micro_batch", rows, columns, "Tokens per micro-batch that fill the GPU", notes,
                         {"budget": args.budget, "device_gib": device_gib, "measurements": str(gpu_dir.name)})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
