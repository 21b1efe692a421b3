"""The DeepSpeed training loop (DESIGN.md section 5): one rank's view of a run.

A step reads top to bottom in `Trainer.run`: next micro-batch -> model (mask, encode, insert, decode, loss) ->
engine.backward -> engine.step; every N steps log, evaluate and checkpoint. This is the only module that calls
`deepspeed.initialize`; the model knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import deepspeed
import psutil
import torch
import torch.distributed as dist
import yaml
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.utils import safe_get_full_fp32_param
from tqdm import tqdm

from . import checkpoint
from .atomic import atomic_write_bytes
from .batch import to_device_ahead
from .config import PRECISIONS, RunConfig
from .data import PackedLoader
from .data.order import DIGEST_MODULUS, sequences_digest
from .data.tokenizer import TOKENIZER_FILE
from .errors import FastmaeError
from .evaluation import HeldOutSet
from .flops import batch_training_flops, plan_budget
from .hardware import DTYPES, all_cpu_cores, choose_precision, cpu_cores, matmul_flops, spec_peak_flops
from .masking import mask_rows, predicted_count
from .metrics import MetricsWriter, peak_memory_mib
from .model import MaskedLM
from .optim import lr_multiplier, param_groups
from .plot import plot_run


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` merged in, recursively for nested mappings."""
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def deepspeed_config(config: RunConfig, precision: str) -> dict:
    """The DeepSpeed config derived from the run config and the resolved `precision` (fp32, bf16 or fp16);
    `config.deepspeed` entries override it.

    One micro-batch is one token-budgeted PackedBatch, so DeepSpeed's micro-batch size is 1 "batch". Gradients
    accumulate in fp32 whatever the training dtype (DESIGN.md section 5); DeepSpeed does that only under ZeRO.
    """
    train = config.train
    if precision != "fp32" and train.zero_stage == 0:
        raise FastmaeError(f"train.precision={precision} with train.zero_stage=0: DeepSpeed then accumulates "
                           "gradients in the half-precision dtype; use train.zero_stage >= 1 (or precision fp32)")
    derived = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.clip,
        "zero_optimization": {"stage": train.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "data_types": {"grad_accum_dtype": "fp32"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if train.optimizer == "lamb":
        derived["optimizer"] = {"type": "Lamb", "params": {"lr": train.lr, "betas": list(train.betas),
                                                           "eps": train.eps, "weight_decay": train.weight_decay}}
    return deep_merge(derived, config.deepspeed)


def init_distributed(timeout_s: float = 1800.0) -> None:
    """deepspeed.init_distributed, without DeepSpeed's shared-memory op on CPU ranks. That op serves only its
    inference all-reduce, yet DeepSpeed compiles it with the C++ compiler in every new environment (~40 s on 2 cores,
    before the first step of the first run) and maps a 69 MB /dev/shm file per rank that it never removes. Marked
    incompatible, it is neither built nor loaded; training's collectives are gloo's either way."""
    if deepspeed.get_accelerator().device_name() == "cpu":
        from deepspeed import ops
        from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

        ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s), verbose=False)


def launch_processes() -> list[psutil.Process]:
    """This process's ancestors that belong to its DeepSpeed launch (the `deepspeed` command and
    `deepspeed.launcher.launch`), nearest first; none for a plain `python -m fastmae.train`."""
    chain, process = [], psutil.Process().parent()
    while process is not None and process.pid > 1:
        try:
            if "deepspeed" not in " ".join(process.cmdline()):
                break
        except psutil.Error:
            break
        chain.append(process)
        process = process.parent()
    return chain


def build_engine(model: torch.nn.Module, config: RunConfig, precision: str, device: torch.device,
                 found_inf: torch.Tensor | None = None, load_universal: bool = False):
    """(engine, DeepSpeed config) for `model`: the one call of deepspeed.initialize, shared by the trainer
    and benchmarks/throughput.py so that both time the same step. `found_inf` (a device fp32 scalar): while it
    is non-zero, AdamW steps change nothing (the trainer's skip of a step with a non-finite loss). `load_universal`:
    the engine will load a universal checkpoint (one saved by another number of ranks).

    AdamW is torch's fused kernel (one pass over the fp32 master weights: 19 ms against 183 for the per-tensor loop
    on 36M parameters, 2-core CPU). In a world of one, DeepSpeed's gradient all-reduce only flattens, casts and copies
    back every gradient (~0.3 s of a 2.3 s step, small model on CPU); it is turned off where the ZeRO stage leaves
    nothing else in it (stage 0, or the bf16 optimizer of stage 1).
    """
    train = config.train
    optimizer = None
    if train.optimizer == "adamw":
        optimizer = torch.optim.AdamW(param_groups(model, train.weight_decay), lr=train.lr,
                                      betas=tuple(train.betas), eps=train.eps, fused=True)
        optimizer.found_inf = found_inf  # read by the fused kernel on every step (None: never skip)
    elif device.type != "cuda":
        raise FastmaeError("train.optimizer=lamb needs DeepSpeed's CUDA LAMB; use adamw on CPU")
    ds_config = deepspeed_config(config, precision)
    if load_universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    if train.compile:
        model.compile_layers()
    schedule = lambda step: lr_multiplier(step, train.warmup_steps, train.steps,  # noqa: E731
                                          train.power if train.schedule == "polynomial" else 1.0,
                                          train.min_lr_ratio)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        lr_scheduler=(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule)),
        model_parameters=None if optimizer is not None else param_groups(model, train.weight_decay))
    if dist.get_world_size() == 1 and (train.zero_stage == 0 or isinstance(optimizer, BF16_Optimizer)):
        engine.enable_backward_allreduce = False
    return engine, ds_config


class Trainer:
    """Builds data, model and engine for this rank, then runs, evaluates and checkpoints."""

    def __init__(self, config: RunConfig, resume: str | None = "auto"):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        try:
            self.config = config = config.for_world(self.world)  # train.tokens_per_step -> grad_accum
        except ValueError as err:
            raise FastmaeError(str(err)) from None
        self.run_dir = Path(config.log.dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.device = torch.device(deepspeed.get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))
        torch.manual_seed(config.train.seed + self.rank)  # dropout differs per rank; restored on resume
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # CPU matmuls slow down ~40x on denormals from confident softmaxes
            if "OMP_NUM_THREADS" not in os.environ:  # ranks sharing a CPU split its cores instead of oversubscribing
                torch.set_num_threads(max(1, cpu_cores() // int(os.environ.get("LOCAL_SIZE", 1))))

        self._prepare_data_if_asked()
        data, train = config.data, config.train
        # the model config needs the dataset's vocab size, the loader the model's sequence length
        self.loader = PackedLoader.for_run(config, self.rank, self.world, data.verify_checksums)
        try:
            self.model_config = config.model_config(self.loader.vocab_size)
        except ValueError as err:
            raise FastmaeError(f"{data.directory}: {err}") from None
        self.eval_steps = None  # evaluate at these steps (a FLOP budget's plan) instead of every eval.every
        if train.flops_budget > 0:
            self._plan_budget()
            config, train = self.config, self.config.train
        self.held_out = None  # the same sequences and masks for every objective, world size and micro-batch size
        if config.eval.every > 0 or self.eval_steps:
            self.held_out = HeldOutSet(data.directory, max_seq_len=self.model_config.max_seq_len, packing=data.packing,
                                       tokens_per_batch=data.tokens_per_micro_batch, sequences=config.eval.sequences,
                                       mask_rate=config.eval.mask_rate, seed=config.eval.seed, rank=self.rank,
                                       world_size=self.world,
                                       verify_checksum=data.verify_checksums)

        self.precision = self._choose_precision()
        torch.manual_seed(train.seed)  # identical initial weights on every rank
        model = MaskedLM(self.model_config)
        model.activation_checkpointing = train.activation_checkpointing
        if train.zero_stage == 3:
            for param in model.functional_parameters():
                deepspeed.zero.register_external_parameter(model, param)
        torch.manual_seed(train.seed + self.rank)
        # 1.0 when some rank saw a non-finite loss in the current step: the fused AdamW then skips it (on the device)
        self.non_finite = torch.zeros((), dtype=torch.float32, device=self.device)
        checkpoint_dir = self._checkpoint_to_resume(resume)
        elastic = checkpoint_dir is not None and checkpoint.saved_world_size(checkpoint_dir) != self.world
        if elastic:  # saved by another number of ranks: DeepSpeed re-shards its universal form
            if self.rank == 0:
                self._log_line(f"{checkpoint_dir} was saved by {checkpoint.saved_world_size(checkpoint_dir)} "
                               f"rank(s): converting it to DeepSpeed's universal checkpoint for {self.world}")
                checkpoint.make_universal(checkpoint_dir)
            dist.barrier()
        self.engine, self.ds_config = build_engine(model, config, self.precision, self.device, self.non_finite,
                                                   load_universal=elastic)
        self.peak_flops, self.spec_peak_flops = self._measure_peak()
        self.step, self.tokens_seen, self.flops_done = 0, 0, 0  # tokens and FLOPs: this rank's share
        # skipped steps so far and in a row, counted on the device; `skipped` is the count the last log reported
        self.bad_streak_device = torch.zeros((), dtype=torch.float32, device=self.device)
        self.skipped_device = torch.zeros((), dtype=torch.float32, device=self.device)
        self.skipped = 0
        self.stop_requested = False
        self.launchers = launch_processes()
        self.sync_debug = self.device.type == "cuda" and os.environ.get("FASTMAE_SYNC_DEBUG") == "1"
        # stop requests are agreed every step over the CPU (gloo), so that the host never waits for the GPU
        self.host_group = dist.new_group(backend="gloo") if self.device.type == "cuda" and self.world > 1 else None
        if checkpoint_dir is not None:  # last: nothing may draw from the restored RNG before the loop
            self._restore(checkpoint.load(self.engine, checkpoint_dir, dataclasses.asdict(self.model_config)))
            self._log_line(f"resumed from {checkpoint_dir} at step {self.step}")
        self.metrics = MetricsWriter(self.run_dir, config.log.tensorboard) if self.rank == 0 else None
        if self.rank == 0:
            self._write_resolved_config()

    # ------------------------------------------------------------------------------------------------ setup
    def _prepare_data_if_asked(self) -> None:
        data = self.config.data
        if data.path == "builtin" and not (data.directory / "meta.json").is_file():
            if self.rank == 0:
                from .prepare import prepare

                self._log_line(f"preparing the embedded corpus in {data.directory} (once)")
                prepare([], data.directory, fmt="builtin", vocab_size=data.builtin_vocab_size,
                        valid_fraction=data.builtin_valid_fraction,
                        workers=1, progress=False)
            dist.barrier()

    def _checkpoint_to_resume(self, resume: str | None) -> Path | None:
        """The verified checkpoint `--resume` names, chosen by rank 0 (which reads every file of the newest once)
        and broadcast, so that a bad choice is the same one-line error on every rank."""
        choice: list = [None, None]  # path, error
        if self.rank == 0:
            try:
                found = checkpoint.resolve_resume(self.ckpt_root, resume, self._log_line)
                choice[0] = str(found) if found is not None else None
            except FastmaeError as err:
                choice[1] = str(err)
        dist.broadcast_object_list(choice, src=0)
        if choice[1] is not None:
            raise FastmaeError(choice[1])
        return Path(choice[0]) if choice[0] is not None else None

    def _plan_budget(self) -> None:
        """Turn train.flops_budget into train.steps (and eval.every_flops into evaluation steps) from the batches
        every rank will draw; each rank plans the same, so no collective is needed."""
        train = self.config.train
        plan = plan_budget(self.loader.every_rank(), self.model_config, self.loader.micro_batches_per_step,
                           train.flops_budget, self.config.eval.every_flops)
        if plan.steps == 0:
            raise FastmaeError(f"train.flops_budget={train.flops_budget:.4g} is less than one optimizer step "
                               f"({plan.flops_per_step:.4g} FLOPs here)")
        self.config = dataclasses.replace(self.config, train=dataclasses.replace(train, steps=plan.steps))
        if self.config.eval.every_flops:
            self.eval_steps = set(plan.eval_steps)
        self._log_line(f"FLOP budget {train.flops_budget:.4g}: {plan.steps} steps of {plan.flops_per_step:.4g} FLOPs "
                       f"({plan.planned_flops:.4g} in all, {'exact' if plan.exact else 'extrapolated'})")

    def _choose_precision(self) -> str:
        """train.precision resolved on rank 0 (with all of its node's CPU cores) and broadcast: every rank must train
        in the same dtype."""
        choice = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            with all_cpu_cores():
                precision, note = choose_precision(self.config.train.precision, self.device)
            if note:
                self._log_line(note)
            choice[0] = PRECISIONS.index(precision)
        dist.broadcast(choice, src=0)
        return PRECISIONS[int(choice.item())]

    def _measure_peak(self) -> tuple[float, float | None]:
        """(measured, data-sheet or None) peak FLOP/s of the whole job in the training dtype: the denominators of MFU.

        A GPU belongs to one rank, so each rank measures its own. CPU ranks of a node share its cores, so the node's
        first rank measures once with all of them while the others wait, and only it counts.
        """
        dtype = DTYPES[self.precision]
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        measured, spec = 0.0, spec_peak_flops(self.device, dtype) or 0.0
        if self.device.type == "cpu":
            dist.barrier()
            if local_rank == 0:
                with all_cpu_cores():
                    measured = matmul_flops(self.device, dtype)
            dist.barrier()
        else:
            measured = matmul_flops(self.device, dtype)
        totals = torch.tensor([measured, spec, float(spec == 0.0)], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        measured, spec, unknown = totals.tolist()
        self._log_line(f"matmul peak in {self.precision}: {measured / 1e12:.3g} TFLOP/s over the job"
                       + (f" (data sheet: {spec / 1e12:.4g})" if spec and not unknown else ""))
        return measured, (spec if spec and not unknown else None)

    def _write_resolved_config(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resolved = dataclasses.asdict(self.config)
        resolved["train"]["betas"] = list(resolved["train"]["betas"])
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        (self.run_dir / "model_config.json").write_text(json.dumps(dataclasses.asdict(self.model_config), indent=1))
        (self.run_dir / "deepspeed_config.json").write_text(json.dumps(self.ds_config, indent=1))
        # the run directory stands alone for export, finetune and analyze, wherever the data goes later
        atomic_write_bytes(self.run_dir / TOKENIZER_FILE, (self.config.data.directory / TOKENIZER_FILE).read_bytes())

    def _log_line(self, text: str) -> None:
        if self.rank == 0:
            tqdm.write(f"fastmae: {text}", file=sys.stderr)

    # ------------------------------------------------------------------------------------------------ state
    def _trainer_state(self) -> dict:
        state = {"step": self.step, "tokens_seen": self.tokens_seen,
                 "flops_done": self.flops_done, "bad_streak": int(self.bad_streak_device.item()),
                 "skipped": int(self.skipped_device.item()),
                 "torch_rng": torch.get_rng_state(),
                 "loader": self.loader.state_dict(self.step)}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def _restore(self, states: list[dict]) -> None:
        """Continue from the trainer states of a checkpoint's ranks. On as many ranks, each takes its own. On another
        number (elastic), the data cursor, step and counters carry over (this rank's shares of the token and FLOP
        totals go to rank 0) and each rank's RNG starts afresh from (seed, rank, step)."""
        mine = states[self.rank] if len(states) == self.world else states[0]
        self.step = mine["step"]
        self.skipped = mine["skipped"]
        self.bad_streak_device.fill_(mine["bad_streak"])
        self.skipped_device.fill_(self.skipped)
        self.loader.load_state_dict(mine["loader"])
        if len(states) == self.world:
            self.tokens_seen, self.flops_done = mine["tokens_seen"], mine["flops_done"]
            torch.set_rng_state(mine["torch_rng"])
            if "cuda_rng" in mine and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda_rng"], self.device)
            return
        first = self.rank == 0
        self.tokens_seen = sum(state["tokens_seen"] for state in states) if first else 0
        self.flops_done = sum(state["flops_done"] for state in states) if first else 0
        torch.manual_seed(hash((self.config.train.seed, self.rank, self.step)) % 2**63)
        self._log_line(f"resuming {len(states)} rank(s)' run on {self.world}: the same micro-batches follow, "
                       f"{self.loader.micro_batches_per_step} per step; dropout draws anew")

    def save_checkpoint(self) -> None:
        model_config = dataclasses.asdict(self.model_config)
        path = checkpoint.save(self.engine, self.ckpt_root, self.step, self._trainer_state(),
                               self.config.checkpoint.keep, {"model_config": model_config}, self.master_weights())
        self._log_line(f"saved {path}")

    def master_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective: the fp32 master weights by parameter name on rank 0 (None on the others).

        Under bf16 the module holds a rounded copy; the fp32 values live in the optimizer's (possibly partitioned)
        groups, which DeepSpeed gathers parameter by parameter. In fp32 without ZeRO the module's own are the master.
        """
        weights = {}
        for name, param in self.engine.module.named_parameters():
            full = safe_get_full_fp32_param(param)
            if self.rank == 0:
                weights[name] = (param if full is None else full).detach().float().cpu().clone()
        return weights if self.rank == 0 else None

    # ------------------------------------------------------------------------------------------------- loop
    def _any_rank(self, *flags: bool) -> list[bool]:
        """Whether each host flag is set on any rank (one all-reduce on the CPU: the GPU stream is not waited for)."""
        if self.world == 1:
            return list(flags)
        tensor = torch.tensor([float(f) for f in flags])
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.host_group)
        return [bool(v) for v in tensor.tolist()]

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            self.stop_requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, request_stop)

    def _launcher_gone(self) -> bool:
        """Whether a process of this rank's launch (the `deepspeed` command, DeepSpeed's per-node launcher) has died:
        SIGTERM to the `deepspeed` command kills it alone, and its ranks would otherwise train on unattended."""
        for process in self.launchers:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            self._log_line(f"the launcher (pid {process.pid}) is gone: saving a checkpoint and exiting")
            self.launchers = []
            return True
        return False

    def run(self) -> None:
        """Train until config.train.steps optimizer steps; checkpoint at the end (or on SIGTERM/SIGINT)."""
        cfg = self.config
        self._install_signal_handlers()
        fault_at = int(os.environ.get("FASTMAE_FAULT_AT_STEP", "0"))  # tests: die hard right after this step
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=self.rank != 0, desc="train",
                   dynamic_ncols=True, mininterval=1.0)
        try:
            self._loop(bar, fault_at)
        finally:
            bar.close()
        if self.step == cfg.train.steps:
            self.export_weights(self.run_dir / checkpoint.WEIGHTS)
        if self.metrics is not None:
            self.metrics.close()
            self._log_line(f"wrote {plot_run(self.run_dir)}")

    def _loop(self, bar, fault_at: int) -> None:
        """Optimizer steps until the last one (or a stop request), with logs, evals and checkpoints.

        The host never waits for the device inside a step: batches are copied ahead (`to_device_ahead`), the loss,
        accuracy and non-finite flag are summed on the device, and a step with a non-finite loss on any rank is
        skipped on the device (see `_agree_on_non_finite`). The host reads those sums on logged steps only.
        """
        cfg = self.config
        batches = to_device_ahead(iter(self.loader), self.device)
        window = self._new_window()
        self.engine.train()
        stop = False
        while self.step < cfg.train.steps:
            # masked-token accuracy costs an argmax over the vocabulary: only on the micro-batches of logged steps
            logged = (self.step + 1) % cfg.log.every == 0 or self.step + 1 == cfg.train.steps
            self._debug_syncs(self.step >= 2 and not logged)  # steady-state steps: past warm-up, not logged
            micro_batches = [next(batches) for _ in range(cfg.train.grad_accum)]
            weight = self._per_token_weight(micro_batches)
            self.non_finite.zero_()
            step_sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss sum, predicted, correct, scored
            for i, batch in enumerate(micro_batches):
                last = i + 1 == len(micro_batches)
                # masks follow the micro-batch's place in the run, not the rank: the same on any number of ranks
                index = self.step * self.loader.micro_batches_per_step + i * self.world + self.rank
                out = self.engine(batch, seed=cfg.train.seed, step=index, compute_accuracy=logged)
                loss = out.loss.detach()
                torch.maximum(self.non_finite, (~torch.isfinite(loss)).float(), out=self.non_finite)
                if last:
                    self._agree_on_non_finite()
                # the mean over every predicted token of the step, all micro-batches and ranks (DESIGN.md 5)
                self.engine.backward(out.loss * (out.num_predicted * weight))
                if last:
                    self._debug_syncs(False)  # DeepSpeed's optimizer step reads the gradient norm on the host
                self.engine.step()
                step_sums[0] += loss.double() * out.num_predicted
                step_sums[1] += out.num_predicted
                if logged:
                    step_sums[2] += out.num_correct
                    step_sums[3] += out.num_predicted
                window["tokens"] += batch.num_tokens
                window["digest"] = (window["digest"] + sequences_digest(batch.dataset_ids)) % DIGEST_MODULUS
                flops = batch_training_flops(self.model_config, batch, out.masked.counts)
                window["flops"] += flops
                self.flops_done += flops
                self.tokens_seen += batch.num_tokens
            # a skipped step adds nothing to the window but counts towards the streak of skipped steps
            window["sums"] += torch.where(self.non_finite > 0, 0.0, step_sums)
            self.skipped_device += self.non_finite
            self.bad_streak_device.mul_(self.non_finite).add_(self.non_finite)
            self.step += 1
            window["steps"] += 1
            bar.update(1)
            self.stop_requested = self.stop_requested or self._launcher_gone()
            stop = self._any_rank(self.stop_requested)[0]
            if logged:
                self._log_train(window, bar)
                window = self._new_window()
            paused = time.perf_counter()  # evaluation and checkpoints do not count as training time
            if self.held_out is not None and self._evaluation_due():
                self.evaluate()
            if self.step % cfg.checkpoint.every == 0 or self.step == cfg.train.steps or stop:
                self.save_checkpoint()
            window["paused"] += time.perf_counter() - paused
            if fault_at and self.step == fault_at:
                os._exit(17)
            if stop:
                self._log_line(f"stop requested: checkpoint saved at step {self.step}, exiting")
                break

    def _debug_syncs(self, on: bool) -> None:
        """With FASTMAE_SYNC_DEBUG=1 on CUDA (a test), a host-device synchronisation raises while `on`."""
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    def _agree_on_non_finite(self) -> None:
        """Before the step's last backward: agree (on the device) whether any rank saw a non-finite loss in this
        step. The fused AdamW reads the flag as its `found_inf` and leaves weights, moments and step count untouched
        when it is set; where DeepSpeed's optimizer wrapper checks gradients itself (bf16, ZeRO), it skips the same
        step because its gradients are non-finite too."""
        if self.world > 1:
            dist.all_reduce(self.non_finite, op=dist.ReduceOp.MAX)

    def _evaluation_due(self) -> bool:
        if self.step == self.config.train.steps:
            return True
        if self.eval_steps is not None:
            return self.step in self.eval_steps
        return self.config.eval.every > 0 and self.step % self.config.eval.every == 0

    def _per_token_weight(self, micro_batches) -> torch.Tensor:
        """Device scalar w such that the micro-batch losses (means over their own predicted tokens) times
        num_predicted * w add up, after DeepSpeed's 1/grad_accum scaling and its mean over ranks, to the mean over
        every predicted token of the step. The counts are host-side; their sum over ranks is one all-reduce that
        the host does not wait for."""
        local = sum(predicted_count(batch, self.model_config) for batch in micro_batches)
        total = torch.full((), float(local), dtype=torch.float32, device=self.device)
        dist.all_reduce(total)
        return (self.config.train.grad_accum * self.world) / total.clamp(min=1.0)

    def _check_bad_streak(self, bad_streak: int, skipped: int) -> None:
        """On logged steps: report skipped steps, and stop after train.max_bad_steps of them in a row."""
        if skipped > self.skipped:
            self._log_line(f"non-finite loss: {skipped - self.skipped} step(s) skipped up to step {self.step} "
                           f"({skipped} so far)")
        self.skipped = skipped
        if bad_streak >= self.config.train.max_bad_steps:
            raise FastmaeError(f"{bad_streak} optimizer steps in a row with a non-finite loss, up to step {self.step}: "
                               "stopping (lower train.lr, check the data, or raise train.max_bad_steps)")

    def _new_window(self) -> dict:
        """Sums over the optimizer steps since the last log record: `sums` on the device (loss sum, predicted,
        correct, scored, over steps that were not skipped), the rest on the host."""
        return {"sums": torch.zeros(4, dtype=torch.float64, device=self.device), "tokens": 0, "flops": 0,
                "steps": 0, "digest": 0, "paused": 0.0, "start": time.perf_counter()}

    def _log_train(self, window: dict, bar) -> None:
        elapsed = time.perf_counter() - window["start"] - window["paused"]
        host = torch.tensor([float(window["tokens"]), float(window["flops"]), float(self.flops_done),
                             float(self.tokens_seen), float(window["digest"])], dtype=torch.float64, device=self.device)
        totals = torch.cat([window["sums"], host])
        dist.all_reduce(totals)
        # the step flags were agreed across ranks, so every rank holds the same counters: read, not reduced
        values = torch.cat([totals, self.bad_streak_device.double()[None], self.skipped_device.double()[None]])
        (loss_sum, predicted, correct, scored, tokens, flops, flops_done, tokens_seen, digest, bad_streak,
         skipped) = values.tolist()
        averaged = window["steps"] - (int(skipped) - self.skipped)  # the window's steps, less those skipped in it
        self._check_bad_streak(int(bad_streak), int(skipped))
        grad_norm = self.engine.get_global_grad_norm()
        record = {"kind": "train", "step": self.step, "loss": loss_sum / max(predicted, 1),
                  "averaged_steps": averaged,  # since the last record (or the resume), skipped ones left out
                  "accuracy": correct / max(scored, 1),
                  "lr": self.engine.get_lr()[0], "grad_norm": float(grad_norm) if grad_norm is not None else None,
                  "tokens_per_s": tokens / elapsed, "mfu": flops / elapsed / self.peak_flops,
                  "memory_mib": peak_memory_mib(self.device), "tokens_seen": int(tokens_seen),
                  "flops": flops_done,
                  "skipped": self.skipped, "epoch": self.loader.epoch,
                  "data_digest": int(digest) % DIGEST_MODULUS}
        if self.spec_peak_flops:
            record["mfu_spec"] = flops / elapsed / self.spec_peak_flops
        if self.metrics is not None:
            self.metrics.write(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Masked-token loss and accuracy on the held-out set under the fixed protocol (collective)."""
        cfg = self.config
        self.engine.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, correct
        predicted = 0.0
        for item in self.held_out.micro_batches:
            batch = item.batch.to(self.device)
            out = self.engine(batch, masked=mask_rows(batch, self.model_config, item.predicted), compute_accuracy=True)
            sums += item.weight * torch.stack([out.loss.double() * out.num_predicted, out.num_correct.double()])
            predicted += item.weight * out.num_predicted
        totals = torch.cat([sums, torch.tensor([predicted, float(self.flops_done)], dtype=torch.float64,
                                               device=self.device)])
        dist.all_reduce(totals)
        loss_sum, correct, predicted, flops_done = totals.tolist()
        record = {"kind": "eval", "step": self.step, "flops": flops_done, "loss": loss_sum / max(predicted, 1),
                  "accuracy": correct / max(predicted, 1), "mask_rate": cfg.eval.mask_rate,
                  "predicted_tokens": int(predicted), "sequences": self.held_out.num_sequences,
                  **self.held_out.baselines}
        if self.metrics is not None:
            self.metrics.write(record)
            self._log_line(f"eval at step {self.step}: loss {record['loss']:.3f} (held-out unigram entropy "
                           f"{record['unigram_entropy']:.3f}), accuracy {record['accuracy']:.3f} (most frequent "
                           f"token {record['unigram_accuracy']:.3f})")
        self.engine.train()
        return record

    def export_weights(self, path: Path) -> None:
        """Collective: rank 0 writes the fp32 master weights as safetensors (model config and step as metadata)."""
        weights = self.master_weights()
        if self.rank == 0:
            checkpoint.write_weights(path, weights, dataclasses.asdict(self.model_config), self.step)
            self._log_line(f"wrote {path}")
        dist.barrier()
