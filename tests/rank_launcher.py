"""The suite's per-node launcher: starts a script's ranks on this machine as DeepSpeed's `deepspeed.launcher.launch`
does, with the standard library and psutil alone.

    python tests/rank_launcher.py --world_info=B64 --master_addr=ADDR --master_port=PORT SCRIPT [ARGS...]

The same command line, the same environment for each rank (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK,
LOCAL_SIZE, CROSS_RANK, CROSS_SIZE, CUDA_VISIBLE_DEVICES), the same `--local_rank=N` argument, and the same behaviour:
a rank that exits non-zero stops the others and the launcher exits with its code; SIGTERM or SIGINT to the launcher
stops every rank. What it skips is DeepSpeed's cost on a 2-core CPU: ~4 s importing torch and DeepSpeed before the
first rank starts, a 1-s poll and ~1.5 s of interpreter teardown, every launch. Tests whose subject is the launcher
itself (the two-node run, SIGTERM to the `deepspeed` command, a failing rank's peer, benchmarks/chaos.py's kills) run
DeepSpeed's. Each rank starts through the suite's warm Python (tests/warm_python.py): forked from a process that
has imported torch and DeepSpeed, its command line the one above.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import warm_python


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to every rank still running and to its children, SIGKILL to what is left after 30 s (DeepSpeed's
    `terminate_process_tree`)."""
    family = []
    for process in processes:
        try:
            parent = psutil.Process(process.pid)
            family += [*parent.children(recursive=True), parent]
        except psutil.NoSuchProcess:
            continue
    for member in family:
        try:
            member.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=30)
    for member in alive:
        member.kill()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world_info", required=True)
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, required=True)
    parser.add_argument("--node_rank", type=int, default=0)
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    world = json.loads(base64.urlsafe_b64decode(args.world_info))
    nodes = list(world)
    first_rank = sum(len(world[node]) for node in nodes[:args.node_rank])
    local_ids = world[nodes[args.node_rank]]
    env = {**os.environ, "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port),
           "WORLD_SIZE": str(sum(len(ids) for ids in world.values())), "CROSS_RANK": str(args.node_rank),
           "CROSS_SIZE": str(len(nodes)), "LOCAL_SIZE": str(len(local_ids)),
           "CUDA_VISIBLE_DEVICES": ",".join(map(str, local_ids))}
    processes = [subprocess.Popen([*warm_python.COMMAND, "-u", args.training_script, f"--local_rank={local}",
                                   *args.training_script_args],
                                  env={**env, "RANK": str(first_rank + local), "LOCAL_RANK": str(local)})
                 for local in range(len(local_ids))]

    def on_signal(signum, frame):
        stop(processes)
        sys.exit(1)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while processes:
        for process in list(processes):
            code = process.poll()
            if code is None:
                continue
            if code != 0:
                stop(processes)
                print(f"rank_launcher: {process.args} exits with return code = {code}", file=sys.stderr)
                return code
            processes.remove(process)
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
