"""The DeepSpeed engine of a run: its config, the one call of `deepspeed.initialize`, and reading its weights back.

The trainer and benchmarks/throughput.py build their engines here, so both time the same optimizer.
"""

from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.zero import stage3
from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

from .atomic import atomic_stream
from .config import RunConfig
from .errors import FastmaeError
from .flat import FlatParameters
from .graphs import StepGraphs, plan_graphs
from .model import MaskedLM
from .optim import ClippingAdamW, decay_groups, param_groups
from .schedule import Schedule
from .zero_patches import ZeroOptimizer  # patches DeepSpeed's ZeRO optimizers (fewer device ops, same values)


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` merged in, recursively for nested mappings."""
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


ZERO_OPTIMIZERS = (ZeroOptimizer, stage3.DeepSpeedZeroOptimizer_Stage3, BF16_Optimizer)
SKIPPED_BUCKET_SIZE = 1
"""ZeRO-1/2's gradient bucket (`reduce_bucket_size`, elements) where it would only stage copies (`build_engine`):
every gradient larger reaches the all-reduce and the fp32 partition without it."""


def deepspeed_config(config: RunConfig, precision: str) -> dict:
    """The DeepSpeed config derived from the run config and the resolved `precision` (fp32, bf16 or fp16);
    `config.deepspeed` entries override it.

    One micro-batch is one token-budgeted PackedBatch, so DeepSpeed's micro-batch size is 1 "batch". Gradients
    accumulate in fp32 whatever the training dtype (ARCHITECTURE.md section 5); DeepSpeed does that only under ZeRO.
    """
    train = config.train
    if precision != "fp32" and train.zero_stage == 0:
        raise FastmaeError(f"train.precision={precision} with train.zero_stage=0: DeepSpeed then accumulates "
                           "gradients in the half-precision dtype; use train.zero_stage >= 1 (or precision fp32)")
    # Clipping is fastmae's (optim.ClippingAdamW, on the device): DeepSpeed's reads the norm back to decide. Under
    # ZeRO its optimizer still computes the global norm (on the device, fastmae/zero_patches.py), which fastmae's
    # clips by (`build_engine`); in bf16 its overflow check (a host read) is off, fastmae's skip flag covers a
    # non-finite norm.
    # fp16's loss scaler needs DeepSpeed's overflow check.
    derived = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": 0.0 if train.optimizer == "adamw" else train.clip,
        "zero_optimization": {"stage": train.zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision == "bf16", **({"check_grad_overflow": False} if train.optimizer == "adamw"
                                                      else {})},
        "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "data_types": {"grad_accum_dtype": "fp32"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronizes the device at every micro-batch's start and end (4 waits per
        # optimizer step of 2 micro-batches, counted); fastmae times steps itself, from the host
        "timers": {"throughput": {"enabled": False}},
    }
    if train.optimizer == "lamb":
        derived["optimizer"] = {"type": "Lamb", "params": {"lr": train.lr, "betas": list(train.betas),
                                                           "eps": train.eps, "weight_decay": train.weight_decay}}
    return deep_merge(derived, config.deepspeed)


def lamb_obstacle(device: torch.device) -> str | None:
    """Why DeepSpeed's fused LAMB cannot run on `device`, or None. It is CUDA only, and unless DeepSpeed was installed
    with it prebuilt it is compiled at its first use, which needs nvcc: found out here, before DeepSpeed starts,
    rather than as a build failure inside deepspeed.initialize."""
    if device.type != "cuda":
        return "DeepSpeed's fused LAMB runs on CUDA only; use train.optimizer=adamw on this device"
    from deepspeed.ops.op_builder.fused_lamb import FusedLambBuilder
    from torch.utils.cpp_extension import CUDA_HOME

    builder = FusedLambBuilder()
    if importlib.util.find_spec(builder.absolute_name()) is not None:  # prebuilt (DS_BUILD_FUSED_LAMB=1)
        return None
    if not builder.is_compatible():
        return "DeepSpeed's fused LAMB builder says this CUDA setup cannot build it; use train.optimizer=adamw"
    if CUDA_HOME is None:
        return ("DeepSpeed's fused LAMB is not prebuilt in this install and compiling it at first use needs nvcc, "
                "which is not here (no CUDA_HOME); use train.optimizer=adamw, or install DeepSpeed with "
                "DS_BUILD_FUSED_LAMB=1 where nvcc is")
    return None


def build_engine(model: torch.nn.Module, config: RunConfig, precision: str, device: torch.device,
                 found_inf: torch.Tensor | None = None, load_universal: bool = False):
    """(engine, DeepSpeed config) for `model`: the one call of deepspeed.initialize, shared by the trainer
    and benchmarks/throughput.py so that both time the same step. `found_inf` (a device fp32 scalar): while it
    is non-zero, AdamW steps change nothing (the trainer's skip of a step with a non-finite loss). `load_universal`:
    the engine will load a universal checkpoint (one saved by another number of ranks). Where `plan_graphs` allows,
    the model's training forward and backward are recorded as CUDA graphs (`model.graphs`, fastmae/graphs.py).

    AdamW is torch's fused kernel (one pass over the fp32 master weights: 19 ms against 183 for the per-tensor loop
    on 36M parameters, 2-core CPU). In a world of one, DeepSpeed's gradient all-reduce only flattens, casts and copies
    back every gradient (~0.3 s of a 2.3 s step, small model on CPU); it is turned off where the ZeRO stage leaves
    nothing else in it (stage 0, or the bf16 optimizer of stage 1).
    """
    train = config.train
    if train.flat_parameters and train.zero_stage < 3:
        model.flat = FlatParameters(model, decay_groups(model))
    optimizer = None  # fastmae's, or DeepSpeed's LAMB made from the config
    if train.optimizer == "adamw":
        optimizer = ClippingAdamW(param_groups(model, train.weight_decay), lr=train.lr, betas=tuple(train.betas),
                                  eps=train.eps, max_norm=train.clip, found_inf=found_inf)
    elif (obstacle := lamb_obstacle(device)) is not None:
        raise FastmaeError(f"train.optimizer=lamb: {obstacle}")
    ds_config = deepspeed_config(config, precision)
    if dist.get_world_size() == 1 and train.zero_stage in (1, 2):
        # in a world of one, ZeRO-1/2's reduce-scatter path divides the gradient bucket by 1, gathers it into another
        # buffer and copies it back: three whole-model passes that its all-reduce path (an identity there) skips
        ds_config = deep_merge({"zero_optimization": {"reduce_scatter": False}}, ds_config)  # a config's own wins
        if getattr(model, "flat", None) is not None and not ds_config["zero_optimization"]["reduce_scatter"]:
            # there the gradient bucket only stages a copy of each gradient before the all-reduce: a flat parameter
            # larger than the bucket is reduced where autograd left its gradient (DeepSpeed's path for a parameter
            # that does not fit), a whole-model copy less a step, and the bucket's memory (5e8 elements) not taken
            ds_config = deep_merge({"zero_optimization": {"reduce_bucket_size": SKIPPED_BUCKET_SIZE}}, ds_config)
    if load_universal:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    if train.compile:
        model.compile_layers()
    schedule = Schedule.of(train)
    # DeepSpeed casts the module to the half dtype before it makes the fp32 masters from it: they would start rounded
    # (a source's fp32 weights lost to bf16 at step 0), so the module's own fp32 values are put back into them below
    exact = ({name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
             if precision != "fp32" else {})
    # a function, not the Schedule: LambdaLR saves and restores a callable object's fields with its state, which
    # would bring a checkpoint's plan back over an extended or branched run's
    engine, wrapped, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        lr_scheduler=(lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule.multiplier(step))),
        model_parameters=None if optimizer is not None else param_groups(model, train.weight_decay))
    for name, param in engine.module.named_parameters():
        if name in exact:
            safe_set_full_fp32_param(param, exact[name].to(device))
    # after DeepSpeed placed the parameters
    if isinstance(model, MaskedLM) and plan_graphs(config, device, precision).enabled:
        StepGraphs(model, capture=True)
    if dist.get_world_size() == 1 and (train.zero_stage == 0 or isinstance(wrapped, BF16_Optimizer)):
        engine.enable_backward_allreduce = False
    if isinstance(wrapped, ZERO_OPTIMIZERS) and isinstance(optimizer, ClippingAdamW):
        # DeepSpeed's ZeRO optimizers compute the global norm (all groups, all ranks) before they step fastmae's,
        # ZeRO-1/2 and 3 one parameter group at a time: a norm of what one such step sees would be one group's.
        # (DeepSpeed's engine reads the norm from the same attribute.)
        optimizer.global_norm = lambda: wrapped._global_grad_norm
    if type(engine.checkpoint_engine) is TorchCheckpointEngine:  # DeepSpeed's default: its files by fastmae's write
        engine.checkpoint_engine = AtomicCheckpointEngine(engine._config)
    # the recovery scripts DeepSpeed copies beside its ZeRO shards (zero_to_fp32.py, ...) by the same write
    engine._copy_recovery_script = copy_recovery_scripts
    return engine, ds_config


def copy_recovery_scripts(save_path: str) -> None:
    """DeepSpeed's `_copy_recovery_script` (its ZeRO checkpoints carry the scripts that turn them into fp32 weights),
    each file written as fastmae writes its own (`atomic.atomic_stream`), executable: a full disk meets it as it meets
    every other checkpoint file."""
    scripts = Path(deepspeed.__file__).parent / "utils"
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        if not (scripts / name).is_file():
            continue
        destination = Path(save_path) / name
        with atomic_stream(destination) as file:
            file.write((scripts / name).read_bytes())
        destination.chmod(destination.stat().st_mode | stat.S_IEXEC)


class AtomicCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine with its files (model states, ZeRO optimizer shards) written as fastmae
    writes its own (`atomic.atomic_stream`: a temporary name, fsync, rename), so that a crash never leaves a
    half-written shard under its real name and a full disk is named the same way, file and directory, whichever
    library wrote."""

    def save(self, state_dict, path: str):
        with atomic_stream(path) as file:
            torch.save(state_dict, file, _use_new_zipfile_serialization=self.zipfile_serialization)


def gradient_norm(engine) -> torch.Tensor | float | None:
    """The global gradient norm of the engine's last optimizer step, before clipping, on the device where it was
    computed there (reading it is a sync: logged steps only): DeepSpeed's where its ZeRO optimizer computed one, else
    fastmae's optimizer's."""
    norm = engine.get_global_grad_norm()
    if norm is not None:
        return norm
    optimizer = engine.optimizer
    return optimizer.last_norm if isinstance(optimizer, ClippingAdamW) else None


def master_weights(engine) -> dict[str, torch.Tensor] | None:
    """Collective: the fp32 master weights by parameter name on rank 0 (None on the others).

    Under bf16 the module holds a rounded copy; the fp32 values live in the optimizer's (possibly partitioned)
    groups, which DeepSpeed gathers parameter by parameter. In fp32 without ZeRO the module's own are the master.
    """
    first = dist.get_rank() == 0
    weights = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        if first:
            weights[name] = (param if full is None else full).detach().float().cpu().clone()
    if not first:
        return None
    flat = getattr(engine.module, "flat", None)
    return weights if flat is None else flat.unflatten(weights)
