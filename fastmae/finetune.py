"""`fastmae finetune`: sequence classification and regression on GLUE-format data, the median over seeds.

    fastmae finetune --model RUN_OR_EXPORT --task rte --data glue/RTE --out ft/rte [--seeds 5] [--epochs 10]
    fastmae finetune --model RUN_OR_EXPORT --task custom --train train.jsonl --dev dev.jsonl \\
        --text-fields premise,hypothesis --label-field label --problem classification --out ft/mine

The network is the pretrained encoder (decoder dropped; for 0 < k < L the insertion's positions and LayerNorm
stay) and RoBERTa's classification head on each sequence's `<s>` row. Inputs are `<s> A </s>` or
`<s> A </s></s> B </s>`, packed varlen. Per seed: AdamW (0.9, 0.98, eps 1e-6), linear warm-up over 6% of the
steps then linear decay, dev scored after every epoch, and the best epoch's weights kept. The same seed gives the
same score from a run directory and from its `fastmae export` (both read the same fp32 weights and tokenizer).
Without --lr the learning rate follows the model's width (`width_learning_rate`); with --precision auto the forward
runs under bf16 autocast where the device multiplies bf16 natively (CUDA sm_80+), fp32 elsewhere; each epoch logs
its training tokens/s.

    OUT/results.json             task, metric, per_seed (best epoch, its scores, the history with tokens/s, why it
                                 did not train if it did not), median per metric (MNLI's mismatched dev beside),
                                 the config as asked and as resolved (lr, precision), mean tokens/s
    OUT/seed{S}/best.safetensors the classifier at seed S's best dev score
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .atomic import atomic_path, atomic_write_text
from .attention import PADDED_VIEW_BACKENDS, resolve_backend
from .batch import PackedBatch
from .config import ModelConfig, add_arguments, from_arguments, option
from .data.tokenizer import Tokenizer
from .dropout import Dropout
from .errors import FastmaeError, run_command
from .evaluation import unigram_baselines
from .hardware import choose_precision
from .model import MaskedLM
from .optim import param_groups
from .pretrained import MODEL_HELP, Pretrained, load_pretrained
from .schedule import lr_multiplier
from .tasks import GLUE_TASKS, Examples, Task, custom_task, load_split, read_rows, score


@dataclass
class FinetuneConfig:
    """Hyper-parameters of one fine-tuning sweep (the defaults are RoBERTa's GLUE recipe, median of 5 seeds, with
    the learning rate scaled to the model's width)."""

    seeds: int = option(5, "fine-tuning runs, seeds 0..N-1")
    epochs: int = option(10, "passes over the training split")
    lr: float = option(0.0, "peak learning rate (0: 2e-5 x (768 / width)^2, RoBERTa's rate at base scaled to the "
                            "model's width)")
    batch_size: int = option(32, "sequences per step")
    warmup_ratio: float = option(0.06, "share of the steps spent warming up")
    weight_decay: float = option(0.1, "AdamW weight decay")
    max_seq_len: int = option(0, "longest input in tokens (0: the model's max_seq_len); longer pairs lose tokens "
                                 "from the longer text")
    max_train_examples: int = option(0, "use only the first N training examples (0: all)")
    precision: str = option("auto", "auto (bf16 autocast where the device multiplies bf16 natively, e.g. CUDA sm_80+; "
                            "fp32 elsewhere), fp32 or bf16 (autocast; weights and optimizer stay fp32)",
                            choices=("auto", "fp32", "bf16"))


def width_learning_rate(hidden_size: int) -> float:
    """The default fine-tuning learning rate for a model of width `hidden_size`: 2e-5 x (768 / width)^2, which gives
    RoBERTa's GLUE rates at its widths (base 2e-5; large, 1024, 1.1e-5 against the paper's 1e-5) and ~7e-4 at a
    CPU model's 128 (where RoBERTa-base's 2e-5 leaves a small encoder's classifier barely trained)."""
    return 2e-5 * (768 / hidden_size) ** 2


class SequenceClassifier(nn.Module):
    """encoder -> `<s>` row -> dropout -> dense -> tanh -> dropout -> projection to `num_outputs` (RoBERTa's head)."""

    def __init__(self, encoder: MaskedLM, num_outputs: int):
        super().__init__()
        config = encoder.config
        self.encoder = encoder
        self.dropout = Dropout(config.dropout)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out = nn.Linear(config.hidden_size, num_outputs)
        for layer in (self.dense, self.out):
            nn.init.normal_(layer.weight, std=config.initializer_range)
            nn.init.zeros_(layer.bias)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """[B, num_outputs] logits (or the regression value) of each sequence of the packed batch."""
        first = self.encoder.encode(batch).index_select(0, batch.cu_seqlens[:-1].long())
        return self.out(self.dropout(torch.tanh(self.dense(self.dropout(first)))))


def pair_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths of a pair's texts after longest-first truncation to `budget` tokens (tokens leave the longer text
    one at a time; at equal lengths the first text gives one up)."""
    if len_a + len_b <= budget:
        return len_a, len_b
    shorter = min(len_a, len_b)
    if budget - shorter >= shorter:  # only the longer text is cut
        return (budget - len_b, len_b) if len_a > len_b else (len_a, budget - len_a)
    return budget // 2, budget - budget // 2


def frame(tokenizer: Tokenizer, texts: list[tuple[str, ...]], max_seq_len: int) -> list[list[int]]:
    """Token ids of each example with its tokenizer's specials (`Tokenizer.frame`: `<s> A </s>` or
    `<s> A </s></s> B </s>`, `[CLS] A [SEP] B [SEP]` for BERT's), at most `max_seq_len` long."""
    if len(texts[0]) == 1:
        return [tokenizer.frame(ids[:max_seq_len - 2]) for ids in tokenizer.encode([t[0] for t in texts])]
    sequences = []
    for a, b in zip(tokenizer.encode([t[0] for t in texts]), tokenizer.encode([t[1] for t in texts])):
        len_a, len_b = pair_lengths(len(a), len(b), max_seq_len - 2 - tokenizer.pair_separators)
        sequences.append(tokenizer.frame(a[:len_a], b[:len_b]))
    return sequences


def framed_split(split: Examples, tokenizer: Tokenizer, max_seq_len: int) -> tuple[list[list[int]], np.ndarray]:
    """(token ids of each example with its specials, labels) of one split (`frame`)."""
    return frame(tokenizer, split.texts, max_seq_len), split.labels


def _loss(task: Task, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if task.is_regression:
        return F.mse_loss(outputs[:, 0], labels)
    return F.cross_entropy(outputs, labels)


def autocast(device: torch.device, precision: str):
    """The forward's autocast: bf16 matmuls and attention when `precision` is bf16 (LayerNorms, softmax and losses
    stay fp32, as torch's autocast keeps them), nothing otherwise."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@torch.no_grad()
def predict(model: SequenceClassifier, task: Task, sequences: list[list[int]], batch_size: int,
            device: torch.device, precision: str = "fp32") -> np.ndarray:
    """Class indices (or regression values) of every sequence, in order."""
    model.eval()
    out = []
    for start in range(0, len(sequences), batch_size):
        batch = PackedBatch.from_sequences(sequences[start:start + batch_size]).to(device)
        with autocast(device, precision):
            outputs = model(batch).float()
        out.append(outputs[:, 0] if task.is_regression else outputs.argmax(-1))
    model.train()
    return torch.cat(out).float().cpu().numpy() if task.is_regression else torch.cat(out).cpu().numpy()


CHANCE_SHARE = 0.98
"""A fine-tune whose last training loss is above this share of the loss of predicting the training labels' own
frequencies (their entropy; for regression their variance) did not train."""


def chance_loss(task: Task, labels: np.ndarray) -> float:
    """The training loss of a classifier that ignores its input: the entropy of the labels' frequencies (ln of the
    class count when they are balanced), or for regression the labels' variance (MSE of predicting their mean)."""
    if task.is_regression:
        return float(np.var(labels.astype(np.float64)))
    return unigram_baselines(np.asarray(labels))["unigram_entropy"]


def did_not_train(task: Task, history: list[dict], best_epoch: int, chance: float) -> str | None:
    """Why a fine-tune's result says nothing about its encoder, or None: its dev predictions at the best epoch are one
    class (a constant, for regression), or its last training loss stayed at the chance loss (`chance_loss`)."""
    best = history[best_epoch - 1]
    if best["distinct_predictions"] <= 1:
        return f"predicts one {'value' if task.is_regression else 'class'} for every dev example"
    last = history[-1]["train_loss"]
    if last >= CHANCE_SHARE * chance:
        return f"training loss {last:.4f} stayed at chance ({chance:.4f}, the labels' own " + (
            "variance)" if task.is_regression else "entropy)")
    return None


def train_one_seed(pretrained: Pretrained, task: Task, train: tuple[list, np.ndarray], dev: tuple[list, np.ndarray],
                   config: FinetuneConfig, seed: int, device: torch.device, best_file: Path | None,
                   other_devs: dict[str, tuple[list, np.ndarray]] | None = None) -> dict:
    """Fine-tune from the pretrained weights with `seed`; score dev (and each of `other_devs`, its scores named
    `NAME_METRIC`) after every epoch; write the best epoch's classifier to `best_file` (None: not kept). Returns
    {seed, best_epoch, scores (at the best epoch), history, did_not_train (None, or why its scores mean nothing)}."""
    torch.manual_seed(seed)
    model = SequenceClassifier(pretrained.encoder(), task.num_outputs).to(device)
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98),
                                  eps=1e-6)
    per_epoch = math.ceil(len(train[0]) / config.batch_size)
    total = per_epoch * config.epochs
    warmup = max(1, round(config.warmup_ratio * total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, warmup, total))
    label_dtype = torch.float32 if task.is_regression else torch.long
    rng = np.random.default_rng(seed)
    primary = task.metrics[0]
    history, best = [], None
    bar = tqdm(total=total, desc=f"seed {seed}", unit="step", dynamic_ncols=True, mininterval=1.0, leave=False)
    for epoch in range(1, config.epochs + 1):
        order = rng.permutation(len(train[0]))
        losses, tokens, started = [], 0, time.perf_counter()
        for start in range(0, len(order), config.batch_size):
            rows = order[start:start + config.batch_size]
            batch = PackedBatch.from_sequences([train[0][i] for i in rows]).to(device)
            labels = torch.as_tensor(train[1][rows], dtype=label_dtype).to(device)
            with autocast(device, config.precision):
                loss = _loss(task, model(batch).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach())
            tokens += batch.num_tokens
            bar.update()
        train_loss = float(torch.stack(losses).mean())  # reads the device: the epoch's steps are done
        tokens_per_s = tokens / (time.perf_counter() - started)
        predictions = predict(model, task, dev[0], config.batch_size, device, config.precision)
        scores = {metric: score(metric, predictions, dev[1]) for metric in task.metrics}
        for name, (sequences, labels) in (other_devs or {}).items():
            other = predict(model, task, sequences, config.batch_size, device, config.precision)
            scores.update({f"{name}_{metric}": score(metric, other, labels) for metric in task.metrics})
        if not math.isfinite(train_loss):
            raise FastmaeError(f"seed {seed}, epoch {epoch}: training loss is {train_loss}; lower --lr")
        distinct = len(np.unique(predictions.round(6) if task.is_regression else predictions))
        history.append({"epoch": epoch, "train_loss": train_loss, "tokens_per_s": round(tokens_per_s, 1),
                        "distinct_predictions": distinct, **scores})
        bar.set_postfix(loss=f"{train_loss:.3f}", tokens_per_s=f"{tokens_per_s:.0f}",
                        **{primary: f"{scores[primary]:.4f}"})
        if best is None or scores[primary] > best["scores"][primary]:
            best = {"epoch": epoch, "scores": scores}
            if best_file is None:
                continue
            from safetensors.torch import save_file

            with atomic_path(best_file) as tmp:
                save_file({k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()},
                          str(tmp), metadata={"task": task.name, "seed": str(seed), "epoch": str(epoch)})
    bar.close()
    return {"seed": seed, "best_epoch": best["epoch"], "scores": best["scores"], "history": history,
            "did_not_train": did_not_train(task, history, best["epoch"], chance_loss(task, train[1]))}


def training_attention(config: ModelConfig, device: torch.device, precision: str) -> str:
    """The attention backend fine-tuning's forward runs on `device` (fastmae/attention.py's choice for the dtype and
    the attention dropout, for the ragged batches fine-tuning packs: on CUDA in bf16 torch's FlashAttention-2 varlen
    kernels) and how it lays the batch out, for the log and results.json."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    backend = resolve_backend(None, device, config.attention_dropout, dtype, biased=config.relative_attention_bias,
                              rectangular=False)
    layout = "the batch padded to its longest sequence" if backend in PADDED_VIEW_BACKENDS else "packed varlen rows"
    return f"{backend} ({layout})"


def resolve_task(args) -> tuple[Task, Path, Path]:
    """(task, train file, dev file) from the command line, every file checked to exist (further dev sets:
    `other_dev_sets`)."""
    if args.task == "custom":
        if not (args.train and args.dev and args.text_fields and args.label_field and args.problem):
            raise FastmaeError("--task custom needs --train, --dev, --text-fields, --label-field and --problem")
        fields = args.text_fields.split(",")
        probe = Task("custom", tuple(fields), args.label_field, None, ("pearson",))
        train_labels = [row.get(args.label_field) for _, row in read_rows(Path(args.train), probe)]
        return custom_task(fields, args.label_field, args.problem, train_labels), Path(args.train), Path(args.dev)
    if args.data is None:
        raise FastmaeError(f"--task {args.task} needs --data GLUE_TASK_DIR (holding train.tsv and dev.tsv)")
    task, data = GLUE_TASKS[args.task], Path(args.data)
    if not data.is_dir():
        raise FastmaeError(f"--data {data}: no such directory")
    dev = next((data / name for name in task.dev_files if (data / name).is_file()), data / task.dev_files[0])
    return task, data / "train.tsv", dev


def other_dev_sets(task: Task, dev_file: Path) -> dict[str, Path]:
    """{name: file} of the task's further dev sets found beside `dev_file` (MNLI's mismatched one)."""
    return {name: dev_file.parent / file for name, file in task.other_dev_files
            if (dev_file.parent / file).is_file()}


def finetune(model_path: str | Path, task: Task, train_file: Path, dev_file: Path, out: Path,
             config: FinetuneConfig) -> dict:
    """Fine-tune `config.seeds` times and write OUT/results.json; return the results. Inputs are read and checked
    before anything is written."""
    pretrained = load_pretrained(model_path)
    pretrained.refuse_pairs(task.name, len(task.text_fields) == 2)
    requested = config
    if not config.lr:
        config = dataclasses.replace(config, lr=width_learning_rate(pretrained.config.hidden_size))
        print(f"fastmae finetune: learning rate {config.lr:.3g} for width {pretrained.config.hidden_size} "
              "(2e-5 x (768 / width)^2; --lr sets another)", file=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision, line = choose_precision(config.precision, device)
    config = dataclasses.replace(config, precision=precision)
    if line:
        print(f"fastmae finetune: {line}", file=sys.stderr)
    attention = training_attention(pretrained.config, device, precision)
    print(f"fastmae finetune: attention {attention}", file=sys.stderr)
    train_split, dev_split = load_split(train_file, task), load_split(dev_file, task)
    if config.max_train_examples:
        train_split = Examples(train_split.source, train_split.texts[:config.max_train_examples],
                               train_split.labels[:config.max_train_examples])
    max_len, most = config.max_seq_len or pretrained.config.max_seq_len, pretrained.config.position_capacity
    if not 4 < max_len <= most:
        raise FastmaeError(f"--max-seq-len {max_len}: must be in (4, {most}] (the model's positions)")
    tokenizer = pretrained.tokenizer
    train, dev = framed_split(train_split, tokenizer, max_len), framed_split(dev_split, tokenizer, max_len)
    others = {name: framed_split(load_split(file, task), tokenizer, max_len)
              for name, file in other_dev_sets(task, dev_file).items()}
    out = Path(out)
    started = time.time()
    per_seed = [train_one_seed(pretrained, task, train, dev, config, seed, device,
                               out / f"seed{seed}" / "best.safetensors", others)
                for seed in tqdm(range(config.seeds), desc="seeds", unit="seed")]
    metrics = [*task.metrics, *(f"{name}_{m}" for name in others for m in task.metrics)]
    results = {
        "task": task.name, "metric": task.metrics[0],
        "median": {m: float(np.median([s["scores"][m] for s in per_seed])) for m in metrics},
        "per_seed": per_seed, "did_not_train": [s["seed"] for s in per_seed if s["did_not_train"]],
        "model": str(model_path), "weights": str(pretrained.weights_file),
        "pretraining_step": pretrained.step, "objective": pretrained.config.objective,
        "train": {"file": str(train_file), "examples": len(train[0])},
        "dev": {"file": str(dev_file), "examples": len(dev[0])},
        "labels": list(task.labels) if task.labels else None, "config": dataclasses.asdict(requested),
        "resolved": {"lr": config.lr, "precision": config.precision, "attention": attention},
        "device": str(device), "seconds": round(time.time() - started, 1),
        "tokens_per_s": float(np.mean([e["tokens_per_s"] for s in per_seed for e in s["history"]])),
    }
    atomic_write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=MODEL_HELP)
    parser.add_argument("--task", required=True, choices=[*GLUE_TASKS, "custom"])
    parser.add_argument("--data", help="GLUE task directory holding train.tsv and dev.tsv")
    parser.add_argument("--out", required=True, help="output directory (results.json, seed*/best.safetensors)")
    parser.add_argument("--train", help="custom task: training file (.tsv with a header, or .jsonl)")
    parser.add_argument("--dev", help="custom task: dev file")
    parser.add_argument("--text-fields", help="custom task: one field, or two separated by a comma (a pair)")
    parser.add_argument("--label-field", help="custom task: the label's field")
    parser.add_argument("--problem", choices=["classification", "regression"], help="custom task: kind of label")
    add_arguments(parser, FinetuneConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = from_arguments(FinetuneConfig, args)

    def run():
        if config.seeds < 1 or config.epochs < 1 or config.batch_size < 1 or config.lr < 0:
            raise FastmaeError("--seeds, --epochs and --batch-size must be positive, --lr positive (or 0: by width)")
        task, train_file, dev_file = resolve_task(args)
        results = finetune(args.model, task, train_file, dev_file, Path(args.out), config)
        median = ", ".join(f"{k} {v:.4f}" for k, v in results["median"].items())
        for seed in results["per_seed"]:
            if seed["did_not_train"]:
                print(f"fastmae finetune: seed {seed['seed']} did not train: {seed['did_not_train']} (its score "
                      "says nothing about the encoder; try another --lr)", file=sys.stderr)
        untrained = len(results["did_not_train"])  # their scores stay in the median: it says so
        whose = "its score" if untrained == 1 else "theirs"
        counted = f" ({untrained} of them did not train; the median counts {whose})" if untrained else ""
        print(f"fastmae finetune: {task.name}, median of {config.seeds} seeds{counted}: {median}, "
              f"{results['tokens_per_s']:,.0f} training tokens/s "
              f"(wrote {Path(args.out) / 'results.json'}); next: fastmae analyze --model {args.model} --data "
              f"TEXT_OR_DATASET --out analysis/{Path(args.model).name}", file=sys.stderr)

    return run_command("fastmae finetune", run)


if __name__ == "__main__":
    sys.exit(main())
