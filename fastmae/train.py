"""Pretrain a masked LM (mlm, mae-lm or 3ml) from a YAML config and dotted key=value overrides.

    deepspeed fastmae/train.py --config configs/tiny-cpu.yaml [dotted.key=value ...]      # one or many nodes
    python -m fastmae.train --config configs/tiny-cpu.yaml [dotted.key=value ...]          # one process

`--resume auto` (the default) continues from the newest complete checkpoint in the run directory.
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script (`deepspeed fastmae/train.py`): drop fastmae/ from the path so that its module names
    # (config, data, ...) cannot shadow other packages; fastmae itself is imported from the installed package.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _here]

import argparse  # noqa: E402
import atexit  # noqa: E402
import dataclasses  # noqa: E402
import faulthandler  # noqa: E402
import signal  # noqa: E402
import textwrap  # noqa: E402

from fastmae.config import SECTIONS, ModelConfig, RunConfig, load_run_config  # noqa: E402
from fastmae.errors import run_command  # noqa: E402


def config_keys() -> str:
    """The keys a config file or an override sets, by section, for --help (each one's meaning: its docstring)."""
    model = ["preset", *(f.name for f in dataclasses.fields(ModelConfig) if f.init and f.name != "objective")]
    sections = {"model": model, **{name: [f.name for f in dataclasses.fields(section) if f.init]
                                   for name, section in SECTIONS.items()}, "deepspeed": ["any DeepSpeed config entry"]}
    lines = [textwrap.fill(f"{name}: {', '.join(keys)}", 100, initial_indent="  ", subsequent_indent="    ")
             for name, keys in sections.items()]
    return "\n".join(["config keys, as section.key=value (what each means: fastmae/config/model.py and run.py, "
                      "docs/training.md):", *lines])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastmae train", description=__doc__.split("\n\n")[0],
                                     epilog=config_keys(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (configs/*.yaml)")
    parser.add_argument("--resume", default="auto",
                        help="auto (newest complete checkpoint of the run, if any), none, or a checkpoint directory")
    parser.add_argument("--plan", type=int, metavar="RANKS",
                        help="print what the run would do on RANKS ranks (its model, global batch and warm-up, "
                             "schedules, steps and tokens) and exit: nothing is trained or written")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. model.preset=mlm train.steps=100")
    return parser


def plan_lines(config: RunConfig, world: int) -> list[str]:
    """What `config` would train on `world` ranks, as the run's first log lines say it, and its steps' nominal tokens
    (micro-batches x their token budget), without its data beyond meta.json. Raises ConfigError or FastmaeError as the
    run would."""
    from fastmae.data.order import StepSizes
    from fastmae.schedule import MaskRates, Schedule, branch_plan, schedules_line

    config = branch_plan(config.for_world(world))
    train, micro = config.train, config.data.tokens_per_micro_batch
    sizes = StepSizes.of_train(train, world, micro)
    steps = (f"{train.steps:,} steps, at most {sizes.before(train.steps) * micro:,} tokens" if not train.flops_budget
             else f"the steps of train.flops_budget={train.flops_budget:.4g}, planned from the data as the run starts")
    shape = " (train.init_from gives the shape of its source)" if train.init_from else ""
    return [f"model: {config.model.describe()}{shape}",
            f"global batch: {sizes.batch(micro)}",
            schedules_line(Schedule.of(train), MaskRates.of(config.model, train.steps), sizes, micro),
            f"{steps}; run directory {config.log.dir}"]


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""How gloo reports a collective whose peer process has died: that rank's own error is the cause, not this."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plan is not None and args.plan < 1:
        parser.error(f"--plan {args.plan}: the number of ranks must be at least 1")
    try:
        config = load_run_config(args.config, args.overrides)
    except ValueError as err:
        print(f"fastmae train: error: {err}", file=sys.stderr)
        return 2
    if args.plan is not None:
        return run_command("fastmae train --plan", lambda: print("\n".join(plan_lines(config, args.plan))))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: where a rank is, on its stderr
    from fastmae.noise import quiet_known_noise

    quiet_known_noise()
    from fastmae.distributed import set_world_of_one_env

    set_world_of_one_env()
    import torch.distributed

    from fastmae.distributed import init_distributed
    from fastmae.trainer import Trainer

    init_distributed(config.train.collective_timeout_s)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    prog = "fastmae train" if world == 1 else f"fastmae train [rank {rank} of {world}]"
    try:  # the lines start fresh: rank 0's progress bar shares stderr (and may be mid-line when this one fails)
        code = run_command(prog, lambda: Trainer(config, args.resume).run(), fresh_line=True)
        if code == 0:
            # the process group's threads end here rather than in the interpreter's teardown, where a finished
            # ZeRO-3 run was once seen to abort ("terminate called without an active exception")
            torch.distributed.destroy_process_group()
        return code
    except RuntimeError as err:  # torch.distributed's errors when a peer process has gone
        if world == 1 or not any(sign in str(err) for sign in PEER_GONE):
            raise
        print(f"\n{prog}: stopped: another rank failed (its error is above)", file=sys.stderr)
        return 1


def exit_now(code: int) -> None:
    """End this process with `code` once `main` has returned (every file closed, the process group destroyed): the
    exit handlers run (logging's flush among them) and the standard streams are flushed, but the interpreter's
    teardown of torch's, DeepSpeed's and dynamo's module graph, about 1.5 s a process on a 2-core CPU and where a
    finished ZeRO-3 run was once seen to abort, is skipped."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from fastmae.malloc import restart_with_malloc_tunables

    restart_with_malloc_tunables()
    exit_now(main())
