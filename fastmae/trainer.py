"""One rank's view of a training run: set up, then optimizer steps in stages until the last one.

`Trainer.__init__` prepares in order: data (and its loader), the model config (vocabulary from the data), the FLOP
budget's plan, the held-out set, the precision, the model and its DeepSpeed engine (fastmae.engine), the MFU peak,
the checkpoint to resume. `Trainer.run` then loops:

    micro-batches -> train_step (fastmae.step) -> counters -> stop agreement -> log window -> evaluator -> checkpoint

and each of the last four decides for itself whether it acts at this step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from . import __version__, checkpoint
from .atomic import atomic_write_text
from .batch import to_device_ahead
from .config import RunConfig
from .continuation import checkpoint_to_continue, continue_from, elastic_batches, global_batch, kept_batch
from .data import PackedLoader
from .data.order import DIGEST_MODULUS
from .data.tokenizer import load_tokenizer
from .distributed import (
    StopAgreement,
    agreed_precision,
    job_mfu_peak,
    log_line,
    progress_bar,
    rank_device,
    ranks_on_node,
)
from .engine import build_engine, gradient_norm, master_weights
from .errors import FastmaeError
from .evaluation import Evaluator, HeldOutSet, plateau_note
from .faults import FaultHooks
from .flops import plan_budget
from .graphs import plan_graphs
from .hardware import DTYPES, cpu_cores, device_name, use_cublas_workspace
from .layers import local_attention_note
from .metrics import LogWindow, MetricsWriter, eval_table, peak_memory_mib, read_metrics
from .model import MaskedLM
from .pipeline import masked_ahead
from .plot import plot_run
from .pretrained import Pretrained, continued, initialise, positions_note, write_origin
from .schedule import MaskRates, Schedule, branch_plan, schedules_line
from .step import RunCounters, train_step


# -------------------------------------------------------------------------------------------------------- setup
def prepare_builtin_data(config: RunConfig) -> None:
    """Collective: with data.path=builtin, rank 0 prepares the embedded corpus once (the others wait)."""
    data = config.data
    if data.path == "builtin" and not (data.directory / "meta.json").is_file():
        if dist.get_rank() == 0:
            from .prepare import prepare

            log_line(f"preparing the embedded corpus in {data.directory} (once)")
            prepare([], data.directory, fmt="builtin", vocab_size=data.builtin_vocab_size,
                    valid_fraction=data.builtin_valid_fraction, workers=1, progress=False)
        dist.barrier()


def with_budget_planned(config: RunConfig, loader: PackedLoader) -> tuple[RunConfig, set[int] | None]:
    """`config` with train.flops_budget turned into train.steps, and the evaluation steps eval.every_flops asks for
    (None: evaluate every eval.every steps), planned from the batches every rank will draw; each rank plans the same,
    so no collective is needed."""
    train = config.train
    if train.flops_budget <= 0:
        return config, None
    plan = plan_budget(loader.every_rank(), config.model, loader.micro_batches_per_step, train.flops_budget,
                       config.eval.every_flops)
    if plan.steps == 0:
        raise FastmaeError(f"train.flops_budget={train.flops_budget:.4g} is less than one optimizer step "
                           f"({plan.flops_per_step:.4g} FLOPs here)")
    log_line(f"FLOP budget {train.flops_budget:.4g}: {plan.steps} steps of {plan.flops_per_step:.4g} FLOPs "
             f"({plan.planned_flops:.4g} in all, {'exact' if plan.exact else 'extrapolated'})")
    planned = dataclasses.replace(config, train=dataclasses.replace(train, steps=plan.steps))
    return planned, (set(plan.eval_steps) if config.eval.every_flops else None)


def model_engine(config: RunConfig, precision: str, device: torch.device, non_finite: torch.Tensor,
                 checkpoint_dir: Path | None, source: Pretrained | None = None):
    """Collective: (engine, DeepSpeed config). The model gets identical initial weights on every rank, the weights of
    `source` where it has them (train.init_from, a fresh start only); a checkpoint to continue (`checkpoint_dir`)
    saved by another number of ranks is made universal first. `non_finite` is the skip flag the engine's optimizer
    reads."""
    train, rank, world = config.train, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(train.seed)  # identical initial weights on every rank
    model = MaskedLM(config.model)
    log_line(f"model: {config.model.describe()}; {sum(p.numel() for p in model.parameters()):,} parameters; a step: "
             f"{world} rank(s) x {train.grad_accum} micro-batch(es) of {config.data.tokens_per_micro_batch:,} tokens")
    # cuBLAS's workspace is set before the process's first GEMM: the model moves to the device below
    for line in (local_attention_note(config.model, device, DTYPES[precision]),
                 use_cublas_workspace(train.cublas_workspace, device)):
        if line:
            log_line(line)
    if source is not None and checkpoint_dir is None:
        new = initialise(model, source, train.init_decoder)
        log_line(f"initialised from {source.describe()}; "
                 f"new: {', '.join(sorted({name.split('.')[0] for name in new})) or 'nothing'}"
                 f"{positions_note(config.model, source.config)}")
    model.activation_checkpointing = train.activation_checkpointing
    if train.zero_stage == 3:
        for param in model.functional_parameters():
            deepspeed.zero.register_external_parameter(model, param)
    torch.manual_seed(train.seed + rank)
    elastic = checkpoint_dir is not None and checkpoint.saved_world_size(checkpoint_dir) != world
    if elastic:  # saved by another number of ranks: DeepSpeed re-shards its universal form
        if rank == 0:
            log_line(f"{checkpoint_dir} was saved by {checkpoint.saved_world_size(checkpoint_dir)} rank(s): "
                     f"converting it to DeepSpeed's universal checkpoint for {world}")
            checkpoint.make_universal(checkpoint_dir)
        dist.barrier()
    engine, ds_config = build_engine(model, config, precision, device, non_finite, load_universal=elastic)
    return engine, ds_config


def write_run_files(config: RunConfig, ds_config: dict, run_info: dict, source: Pretrained | None) -> None:
    """Rank 0: the resolved configs, the tokenizer (so the run directory stands alone for export, finetune and
    analyze, wherever the data goes later), `run_info.json` (device, ranks, precision, MFU peaks, the command and
    fastmae's version) and, continued from a `source`, what its exports write back of it (`write_origin`)."""
    run_dir = Path(config.log.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if source is not None:
        write_origin(run_dir, source.origin)
    arguments = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's, not the user's
    run_info = {**run_info, "command": shlex.join(["fastmae/train.py", *arguments]), "fastmae_version": __version__}
    atomic_write_text(run_dir / "config.yaml", config.to_yaml())
    atomic_write_text(run_dir / "model_config.json", json.dumps(dataclasses.asdict(config.model), indent=1))
    atomic_write_text(run_dir / "deepspeed_config.json", json.dumps(ds_config, indent=1))
    atomic_write_text(run_dir / "run_info.json", json.dumps(run_info, indent=1))
    load_tokenizer(config.data.directory).save(run_dir)


def held_out_evaluator(config: RunConfig, eval_steps, rank: int, world: int, device: torch.device) -> Evaluator | None:
    """The run's evaluator (the same held-out tokens and masks for every objective), or None when it never
    evaluates (`eval_steps`: the FLOP budget's planned evaluation steps, if any)."""
    if config.eval.every <= 0 and not eval_steps:
        return None
    data = config.data
    held_out = HeldOutSet(data.directory, max_seq_len=config.model.max_seq_len, packing=data.packing,
                          tokens_per_batch=data.tokens_per_micro_batch, sequences=config.eval.sequences,
                          mask_rate=config.eval.mask_rate, seed=config.eval.seed, rank=rank, world_size=world,
                          verify_checksum=data.verify_checksums)
    return Evaluator(held_out, config.model, config.eval.every, eval_steps, config.train.steps, device)


def held_out_summary(records: list[dict]) -> list[str]:
    """The run's held-out evaluations as the table README shows, with their unigram baselines (none: no lines)."""
    evals = [r for r in records if r["kind"] == "eval"]
    if not evals:
        return []
    last = evals[-1]
    gap = last["unigram_entropy"] - last["loss"]
    return ["held-out masked-token loss and accuracy:", *eval_table(evals).splitlines(),
            f"unigram baselines of these {last['predicted_tokens']:,} tokens: entropy {last['unigram_entropy']:.2f} "
            f"nats, most frequent token {last['unigram_accuracy']:.3f} (the last evaluation: "
            f"{abs(gap):.2f} nats {'below' if gap >= 0 else 'above'} the entropy, "
            f"{last['accuracy'] / max(last['unigram_accuracy'], 1e-9):.1f}x that accuracy){plateau_note(evals)}"]


def closing_lines(run_dir: Path, graphs, finished: bool, records: list[dict]) -> list[str]:
    """What a run's log ends with: what its CUDA graphs did (`fastmae.graphs.StepGraphs` or None) and, when it
    finished, its held-out table (from `records`, its metrics) and what to run next."""
    lines = [] if graphs is None else [graphs.summary()]
    if finished:
        lines += held_out_summary(records)
        lines.append(f"next: fastmae export {run_dir} exports/{run_dir.name} (a Hugging Face directory), or "
                     f"fastmae finetune --model {run_dir} --task TASK --data GLUE_DIR --out ft/{run_dir.name}")
    return lines


# -------------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Builds data, model and engine for this rank, then runs, evaluates and checkpoints."""

    def __init__(self, config: RunConfig, resume: str | None = "auto"):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        resumed_from = checkpoint_to_continue(config, resume)
        config = kept_batch(config, resumed_from, self.world)  # train.tokens_per_step -> grad_accum
        self.run_dir = Path(config.log.dir)
        self.device = device = rank_device()
        torch.manual_seed(config.train.seed + self.rank)  # dropout differs per rank; restored on resume
        if device.type == "cpu":
            torch.set_flush_denormal(True)  # CPU matmuls slow down ~40x on denormals from confident softmaxes
            if "OMP_NUM_THREADS" not in os.environ:  # ranks sharing a CPU split its cores instead of oversubscribing
                torch.set_num_threads(max(1, cpu_cores() // ranks_on_node()))
        prepare_builtin_data(config)
        config, self.source = continued(config)  # train.init_from: the source's shape (and its weights, below)
        config = branch_plan(config)  # train.branch_from: the branch's length
        data = config.data
        self.loader = PackedLoader.for_run(config, self.rank, self.world, data.verify_checksums)
        self.loader.data.check_vocab(config.model.vocab_size, "model.vocab_size")
        config, eval_steps = with_budget_planned(config, self.loader)
        self.config = config
        train = config.train
        self.schedule, self.mask_rates = Schedule.of(train), MaskRates.of(config.model, train.steps)
        log_line(schedules_line(self.schedule, self.mask_rates, self.loader.step_sizes, data.tokens_per_micro_batch))
        self.evaluator = held_out_evaluator(config, eval_steps, self.rank, self.world, device)
        self.precision = agreed_precision(train.precision, device)
        # 1.0 when some rank saw a non-finite loss in the current step: the fused AdamW then skips it (on the device)
        self.non_finite = torch.zeros((), dtype=torch.float32, device=device)
        self.engine, ds_config = model_engine(config, self.precision, device, self.non_finite, resumed_from,
                                              self.source)
        self.graph_plan = plan_graphs(config, device, self.precision)  # build_engine installs its recordings
        log_line(f"cuda graphs: {self.graph_plan.reason}")
        self.faults = FaultHooks.from_environment(device)
        self.peak, self.spec_peak_flops = job_mfu_peak(device, self.precision, self.faults.startup_peak,
                                                       self.faults.pinned_peak(self.precision))
        self.faults.poison_losses(self.engine.module, self.rank, lambda: self.counters.step + 1)
        self.counters = RunCounters(torch.zeros((), dtype=torch.float32, device=device),
                                    torch.zeros((), dtype=torch.float32, device=device))
        self.stop = StopAgreement(device, log_line)
        self.checkpointer = checkpoint.Checkpointer.of_run(config)
        if resumed_from is not None:  # last: nothing may draw from the restored RNG before the loop
            self._restore(continue_from(self.engine, resumed_from, config, self.schedule, self.mask_rates,
                                        self.loader))
            how = "resumed" if resumed_from.parent == self.checkpointer.root else "branched"
            log_line(f"{how} from {resumed_from} at step {self.counters.step}")
        self.metrics = MetricsWriter(self.run_dir, config.log.tensorboard) if self.rank == 0 else None
        if self.rank == 0:
            write_run_files(config, ds_config, {
                "device": device_name(device), "ranks": self.world, "precision": self.precision, "peak_flops":
                self.peak.flops, "spec_peak_flops": self.spec_peak_flops, "schedule": self.schedule.describe(),
                "init_from": self.source and self.source.provenance(config.model)},
                self.source)

    # ------------------------------------------------------------------------------------------------ state
    def _trainer_state(self) -> dict:
        cuda = {"cuda_rng": torch.cuda.get_rng_state(self.device)} if self.device.type == "cuda" else {}
        return {**self.counters.state(), "torch_rng": torch.get_rng_state(), **cuda,
                "loader": self.loader.state_dict(self.counters.step), "schedule": self.schedule.record(),
                "mask_rates": self.mask_rates.record(), "batch": global_batch(self.loader)}

    def _restore(self, states: list[dict]) -> None:
        """Continue from the trainer states of a checkpoint's ranks. On as many ranks, each takes its own. On another
        number (elastic), the data cursor, step and counters carry over (this rank's shares of the token and FLOP
        totals go to rank 0) and each rank's RNG starts afresh from (seed, rank, step)."""
        mine, counters = states[self.rank] if len(states) == self.world else states[0], self.counters
        counters.restore(mine, shares=len(states) == self.world)
        self.loader.load_state_dict(mine["loader"])
        if len(states) == self.world:
            torch.set_rng_state(mine["torch_rng"])
            if "cuda_rng" in mine and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda_rng"], self.device)
            return
        counters.tokens_seen, counters.flops_done = (sum(state[key] for state in states) if self.rank == 0 else 0
                                                     for key in ("tokens_seen", "flops_done"))
        torch.manual_seed(hash((self.config.train.seed, self.rank, counters.step)) % 2**63)
        log_line(f"resuming {len(states)} rank(s)' run on {self.world}: "
                 f"{elastic_batches(self.loader.step_sizes, counters.step)}; dropout draws anew")

    def save_checkpoint(self) -> None:
        """Collective: a complete checkpoint of this step (DeepSpeed's state, every rank's own, the fp32 weights)."""
        with self.faults.disk(self.rank, self.counters.step):
            path = self.checkpointer.save(self.engine, self.counters.step, self._trainer_state(),
                                          master_weights(self.engine))
        log_line(f"saved {path}")

    # ------------------------------------------------------------------------------------------------- loop
    def run(self) -> None:
        """Train until config.train.steps optimizer steps; checkpoint at the end (or on SIGTERM/SIGINT)."""
        self.stop.install_signal_handlers()
        with progress_bar(self.config.train.steps, self.counters.step, self.loader.step_sizes) as bar:
            self._loop(bar)
        finished = self.counters.step == self.config.train.steps
        if finished:
            self.export_weights(self.run_dir / checkpoint.WEIGHTS)
        records = read_metrics(self.run_dir) if self.metrics is not None else []  # rank 0's
        for line in closing_lines(self.run_dir, self.engine.module.graphs, finished, records):
            log_line(line)
        if self.metrics is not None:
            self.metrics.close()
            if self.config.log.curves:
                log_line(f"wrote {plot_run(self.run_dir)}")

    def _loop(self, bar) -> None:
        """Optimizer steps until the last one (or a stop request), each followed by the stages that act on it.

        The host never waits for the device inside a step: a background thread masks batches and lays them out (padded
        to the shapes graphs replay; `masked_ahead`), each is copied ahead in one copy (`to_device_ahead`), and the
        step's statistics stay on the device (`train_step`), read on logged steps only."""
        masked = masked_ahead(iter(self.loader), self.engine.module.config, self.config.train.seed,
                              pin_memory=self.device.type == "cuda", shapes=self.graph_plan.shapes,
                              rate_of=self.mask_rates.by_index(self.loader.micro_batches_per_step))
        try:
            self._steps(bar, to_device_ahead(masked, self.device))
        finally:
            masked.close()  # stops and joins the masking thread (a thread left running aborts the exit)

    def _steps(self, bar, batches) -> None:
        """The loop of `_loop` over the device batches."""
        cfg, counters = self.config, self.counters
        window = LogWindow(cfg.log.every, cfg.train.steps, self.device)
        self.engine.train()
        while counters.step < cfg.train.steps:
            logged = window.due(counters.step + 1)  # accuracy costs an argmax over the vocabulary: logged steps only
            self.faults.forbid_syncs(counters.step >= 2 and not logged)  # steady state: past warm-up, not logged
            micro_batches = [next(batches) for _ in range(self.loader.step_sizes.per_rank(counters.step))]
            stats = train_step(self.engine, micro_batches, seed=cfg.train.seed, non_finite=self.non_finite,
                               compute_accuracy=logged)
            self.faults.forbid_syncs(False)  # the whole step, DeepSpeed's optimizer step included
            counters.add(stats)
            window.add(stats)
            bar.update(1)
            stop = self.stop.agreed()
            if logged:
                self._log_train(window, bar)
                window.reset()
            with window.paused():  # evaluation and checkpoints do not count as training time
                if self.evaluator is not None and self.evaluator.due(counters.step):
                    self.evaluate()
                if self.checkpointer.due(counters.step, stop, counters.inside_bad_streak):
                    self.save_checkpoint()
            self.faults.after_step(counters.step)
            if stop:
                log_line(f"stop requested: checkpoint saved at step {counters.step}, exiting")
                break

    def _log_train(self, window: LogWindow, bar) -> None:
        """Collective: the train record of the window (sums over ranks), and the stop after too many bad steps."""
        counters, elapsed = self.counters, window.elapsed_s()
        host = torch.tensor([float(window.tokens), float(window.flops), float(counters.flops_done),
                             float(counters.tokens_seen), float(window.digest), elapsed / self.world],
                            dtype=torch.float64, device=self.device)
        totals = torch.cat([window.sums, host])
        dist.all_reduce(totals)
        # the step flags were agreed across ranks, so every rank holds the same counters: read, not reduced; elapsed
        # is the ranks' mean, so that every rank takes the same rate to the (collective) peak check
        values = torch.cat([totals, counters.bad_streak_device.double()[None], counters.skipped_device.double()[None]])
        (loss_sum, predicted, correct, scored, tokens, flops, flops_done, tokens_seen, digest, elapsed, bad_streak,
         skipped) = values.tolist()
        averaged = window.steps - (int(skipped) - counters.skipped_logged)  # less the window's skipped steps
        counters.check_bad_streak(int(bad_streak), int(skipped), self.config.train.max_bad_steps)
        grad_norm = gradient_norm(self.engine)
        record = {"kind": "train", "step": counters.step, "loss": loss_sum / max(predicted, 1),
                  "averaged_steps": averaged,  # since the last record (or the resume), skipped ones left out
                  "accuracy": correct / max(scored, 1),
                  "lr": self.engine.get_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else None,
                  "tokens_per_s": tokens / elapsed, "mfu": self.peak.mfu(flops / elapsed, f"step {counters.step}"),
                  "peak_flops": self.peak.flops, "peak_source": self.peak.kind,
                  "memory_mib": peak_memory_mib(self.device),
                  "tokens_seen": int(tokens_seen),
                  "flops": flops_done, "skipped": counters.skipped_logged, "epoch": self.loader.epoch,
                  "mask_rate": self.mask_rates.rate(counters.step - 1),  # the rate of the record's last step
                  "data_digest": int(digest) % DIGEST_MODULUS}
        if self.spec_peak_flops:
            record["mfu_spec"] = flops / elapsed / self.spec_peak_flops
        if self.metrics is not None:
            self.metrics.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")

    def evaluate(self) -> dict:
        """Collective: the held-out record at this step, written and logged by rank 0."""
        record = self.evaluator.run(self.engine, self.counters.step, self.counters.flops_done)
        if self.config.eval.keep_weights:
            kept = checkpoint.eval_weights_dir(self.run_dir, self.counters.step) / checkpoint.WEIGHTS
            self.export_weights(kept, checkpoint.write_eval_weights)
        if self.metrics is not None:
            self.metrics.write(record)
            log_line(f"eval at step {record['step']}: loss {record['loss']:.3f} (held-out unigram entropy "
                     f"{record['unigram_entropy']:.3f}), accuracy {record['accuracy']:.3f} (most frequent "
                     f"token {record['unigram_accuracy']:.3f})")
        return record

    def export_weights(self, path: Path, write=checkpoint.write_weights) -> None:
        """Collective: rank 0 writes the fp32 master weights with `write` (model config and step as metadata)."""
        weights = master_weights(self.engine)
        if self.rank == 0:
            write(path, weights, dataclasses.asdict(self.config.model), self.counters.step)
            log_line(f"wrote {path}")
        dist.barrier()
