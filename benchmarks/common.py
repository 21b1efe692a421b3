"""Shared benchmark plumbing: timing with warm-up and medians, and results stamped with device and versions."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def read_json(path: Path) -> dict:
    """A committed result's JSON."""
    return json.loads(path.read_text())


def measured_when(result: dict) -> str:
    """When and at which commit a result was measured (its `stamp`)."""
    return f"{result['date'][:10]}, git {result['git_sha']}"


def mfu_text(value: float | None) -> str:
    """An MFU figure to three places (issue 55's targets sit at 0.48 and 0.50: two places would round 0.498 up to one),
    or a dash where no measured peak stood behind it (the peak was a rate achieved)."""
    return "—" if value is None else f"{value:.3f}"


def _warmed_up(fn, warmup: int):
    """Call fn `warmup` times untimed and drain the device; returns the drain (CUDA's synchronize, or nothing)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    return sync


def median_time(fn, warmup: int = 2, repeats: int = 5, host_only: bool = False) -> float:
    """Median wall time of `fn()` in seconds, after `warmup` untimed calls (synchronising CUDA). `host_only`: until
    `fn()` returns, the device then drained untimed (the host's time to issue the work)."""
    sync = _warmed_up(fn, warmup)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if host_only:
            times.append(time.perf_counter() - start)
        sync()
        if not host_only:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def steady_time(fn, warmup: int = 2, windows: int = 5, calls: int = 3) -> float:
    """Median wall time of one call of `fn()` in seconds, in steady state: `windows` runs of `calls` calls back to
    back, each run's time over its calls, the device drained at the end of each run only (after `warmup` untimed
    calls). The host issues a call while the device still runs the one before, as a training loop whose steps read
    nothing back does (fastmae's train_step); a call that waits on the device itself pays for that wait."""
    sync = _warmed_up(fn, warmup)
    times = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def gpu_kernel_time(fn, label: str, repeats: int = 3, top: int = 8) -> float:
    """GPU kernel seconds per call of fn, from the profiler (against the wall time: how busy fn keeps the GPU);
    prints the `top` busiest kernels under `label`."""
    return gpu_kernel_profile(fn, label, repeats, top)["busy_s"]


# What each GPU kernel of a step does, read from its name (first match wins): the profile's table by kind says which
# non-GEMM costs a fused kernel would remove (issue 55).
KERNEL_KINDS = (
    # cudnn::fusion: cuDNN's SDPA backward's rowsum(o * do) and dq cast; _local_: kernels/local_window.py
    ("attention", re.compile(r"sdpa|flash|fmha|attention|flex|triton_tem_fused|cudnn::fusion|_local_(fwd|bwd)",
                             re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|cublas|wgmma|splitK", re.I)),
    ("norm", re.compile(r"layer_norm|GammaBeta|rms_norm|_rows_fwd|_rows_bwd|norm", re.I)),
    ("cross-entropy", re.compile(r"_ce_(rows|grad)|cross_entropy|log_softmax|nll_loss", re.I)),
    # not "lamb": elementwise kernels' names hold "{lambda(int)#1}"
    ("optimizer", re.compile(r"multi_tensor|adam|foreach|lamb(?!da)", re.I)),
    ("masking", re.compile(r"_rank_kernel|_compact_kernel", re.I)),
    ("rotary", re.compile(r"rotary|rope", re.I)),
    # _segment_: the embedding tables' gradients (kernels/table_grad.py)
    ("indexing", re.compile(r"index|gather|scatter|embedding|_segment_(sums|carry)", re.I)),
    ("copy", re.compile(r"copy|memcpy|memset|cat_|CatArray|fill", re.I)),
    # _sum_parts: the fused backwards' weight- and bias-gradient partial sums (kernels/rows.py)
    ("reduction", re.compile(r"reduce|_sum_parts", re.I)),
    ("pointwise", re.compile(r"elementwise|gelu|geglu|dropout|triton_poi|fused|pointwise|where|mul|add", re.I)),
)


def kernel_kind(name: str) -> str:
    """The kind of GPU work a kernel's name says it does (KERNEL_KINDS), or 'other'."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def _kernel_events(fn, repeats: int, host_ops: bool = False) -> tuple[list, list]:
    """(the profiler's CUDA kernel entries, one per kernel name summed, over `repeats` calls of fn; its host events,
    each holding the kernels it launched, where `host_ops`, else []), after one call outside the profile, as each
    measured one follows others."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if host_ops else [])]
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
    return kernels, (list(prof.events()) if host_ops else [])


def _table(events, repeats: int) -> dict[str, list[float]]:
    """{kernel: [GPU ms, launches] per call}, busiest first, from `_kernel_events`' kernel entries."""
    return {e.key[:200]: [round(e.device_time_total / 1e3 / repeats, 4), round(e.count / repeats, 1)]
            for e in sorted(events, key=lambda e: -e.device_time_total)}


def gpu_kernel_table(fn, repeats: int = 3) -> dict[str, list[float]]:
    """{kernel: [GPU ms, launches] per call of fn}, busiest first, printing nothing (scripts/gemm_probe.py)."""
    return _table(_kernel_events(fn, repeats)[0], repeats)


def gpu_kernel_seconds(fn, repeats: int = 5) -> float:
    """GPU kernel seconds per call of fn, printing nothing: what a replayed CUDA graph of it would keep the GPU busy
    for, with none of the host's gaps between launches."""
    return sum(e.device_time_total for e in _kernel_events(fn, repeats)[0]) / 1e6 / repeats


def _host_chain(event, depth: int) -> str:
    """A host op and the ops around it, innermost first, `depth` in all ("aten::fill_ < aten::zero_ < aten::zeros")."""
    chain, parent = [event.name], event.cpu_parent
    while parent is not None and len(chain) < depth:
        chain.append(parent.name)
        parent = parent.cpu_parent
    return " < ".join(name[:60] for name in chain)


def kernel_launchers(events, depth: int = 3) -> dict[str, Counter]:
    """Kernel name -> how often each chain of host ops launched it (`_host_chain`). `events`: a profile's events, the
    host ones holding the kernels they launched (`kernels`) and their enclosing op (`cpu_parent`), as torch.profiler
    links them by correlation id."""
    launchers: dict[str, Counter] = {}
    for event in events:
        for kernel in event.kernels:
            launchers.setdefault(kernel.name, Counter())[_host_chain(event, depth)] += 1
    return launchers


def gpu_idle(events, repeats: int, depth: int = 3, top: int = 6) -> dict[str, float]:
    """Where the GPU waits, ms per call: each stretch with none of its kernels running, between the first and the last
    kernel of the profiled calls, charged to the host ops that launched the kernel after it (what the GPU waited
    for), the `top` largest. `events`: a profile's events, kernels linked to the op that launched them by
    `linked_correlation_id` (the op's `id`). Measured under the profiler, whose recording of every host op slows the
    host: where the GPU waits on the host, it waits longer than unprofiled (a step's own idle time is 1 - gpu_busy
    of its step time)."""
    host = {e.id: e for e in events  # the ops (the runtime's launch calls are linked to a kernel themselves)
            if e.device_type == torch.autograd.DeviceType.CPU and not getattr(e, "linked_correlation_id", 0)}
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    waits: Counter = Counter()
    busy_until = None
    for kernel in kernels:
        if busy_until is not None and kernel.time_range.start > busy_until:
            launcher = host.get(getattr(kernel, "linked_correlation_id", 0))
            waits[_host_chain(launcher, depth) if launcher else "(no host op linked)"] += (
                kernel.time_range.start - busy_until)
        busy_until = max(busy_until or 0, kernel.time_range.end)
    return {chain: round(us / 1e3 / repeats, 3) for chain, us in waits.most_common(top)}


def host_self_time(events, repeats: int, top: int = 8) -> dict[str, float]:
    """Where the host's time goes, ms per call: each host event's own time (its span less its children's: an autograd
    node's Python, a launch call's cost) summed by name, the `top` largest, and "(all host ops)", their sum. Under the
    profiler, whose recording slows every op alike: a step whose GPU waits on its host (gpu_busy well below 1) says
    here which ops hold it."""
    spent: Counter = Counter()
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CPU:
            spent[event.name] += event.self_cpu_time_total
    table = {name: round(us / 1e3 / repeats, 3) for name, us in spent.most_common(top)}
    return {**table, "(all host ops)": round(sum(spent.values()) / 1e3 / repeats, 3)}


def gpu_kernel_profile(fn, label: str, repeats: int = 3, top: int = 8) -> dict:
    """Per call of fn: {"busy_s": GPU kernel seconds, "kernels": kernels the profiler saw, "kinds": {kind: [ms,
    kernels]}, "launchers": {kernel: {host ops: per call}} of the `top` most launched, "idle": `gpu_idle`, "host":
    `host_self_time`, "table": {kernel: [ms, launches] of every kernel, busiest first}}; prints the `top` busiest
    kernels under `label`, the time by kind (kernel_kind), the most launched kernels (what the count is made of) with
    the host ops that launched them (`kernel_launchers`), where the GPU waited and where the host's time went. The
    count tells whether the profile saw the kernels of CUDA graph replays or only their launches."""
    events, timeline = _kernel_events(fn, repeats, host_ops=True)
    launchers = kernel_launchers(timeline)
    kernels = sorted(((e.device_time_total / 1e6 / repeats, e.key) for e in events), reverse=True)
    busy = sum(seconds for seconds, _ in kernels)
    count = sum(e.count for e in events) / repeats
    print(f"{label}: {1e3 * busy:.3f} ms of GPU kernels per call; busiest:", flush=True)
    for seconds, key in kernels[:top]:
        print(f"  {1e3 * seconds:8.3f} ms  {key[:170]}", flush=True)
    kinds: dict[str, list[float]] = {}
    for event in events:
        entry = kinds.setdefault(kernel_kind(event.key), [0.0, 0.0])
        entry[0] += event.device_time_total / 1e3 / repeats
        entry[1] += event.count / repeats
    kinds = {kind: [round(ms, 3), round(n, 1)] for kind, (ms, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])}
    print(f"{label} by kind: " + ", ".join(f"{kind} {ms:.2f} ms ({n:.0f})" for kind, (ms, n) in kinds.items()),
          flush=True)
    others = [key for _, key in kernels if kernel_kind(key) == "other"][:5]
    if others:
        print(f"  kind 'other' holds: {'; '.join(key[:80] for key in others)}", flush=True)
    # what a step's kernel count is made of (issue 55's kernels-a-step target): the names launched most often
    launched = sorted(((e.count / repeats, e.key) for e in events), reverse=True)[:top]
    print(f"{label}: most launched kernels per call, and the host ops that launched them:", flush=True)
    launched_by = {}
    for n, key in launched:
        print(f"  {n:6.0f} x  {kernel_kind(key):<13} {key[:150]}", flush=True)
        chains = launchers.get(key, Counter()).most_common(4)
        launched_by[key] = {ops: round(times / repeats, 1) for ops, times in chains}
        for ops, per_call in launched_by[key].items():
            print(f"  {per_call:14.0f} x  {ops}", flush=True)
    idle = gpu_idle(timeline, repeats)
    print(f"{label}: GPU idle per call under the profiler (its host slowed by the recording), by the host ops that "
          "launched the kernel it waited for:", flush=True)
    for ops, ms in idle.items():
        print(f"  {ms:8.3f} ms  {ops}", flush=True)
    host = host_self_time(timeline, repeats, top)
    print(f"{label}: host time per call under the profiler, each op's own (without its children's):", flush=True)
    for name, ms in host.items():
        print(f"  {ms:8.3f} ms  {name[:150]}", flush=True)
    return {"busy_s": busy, "kernels": count, "kinds": kinds, "launchers": launched_by, "idle": idle,
            "host": host, "table": _table(events, repeats)}


def stamp() -> dict:
    """Where and with what a result was measured: the commit is FASTMAE_COMMIT where the GPU check names it (a lent
    machine's copy of the tree is not that commit's checkout), else git's HEAD."""
    sha = os.environ.get("FASTMAE_COMMIT", "")[:7] or None
    try:
        sha = sha or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=False).stdout.strip() or None
    except OSError:
        sha = None
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "python": platform.python_version(), "git_sha": sha}


def write_results(name: str, rows: list[dict], columns: list[str], title: str, notes: str = "",
                  header: dict | None = None) -> Path:
    """Write benchmarks/results/NAME.json ({stamp, **header, "results": rows}) and a Markdown table NAME.md;
    return the Markdown path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    meta = {**stamp(), **(header or {})}
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    lines = [f"# {title}", "", f"{meta['date']} · {meta['device']} · CPU {meta['cpu_capability']} · torch "
             f"{meta['torch']} · git {meta['git_sha']}", ""]
    if notes:
        lines += [notes, ""]
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    path = RESULTS_DIR / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def dataset_or_builtin(data: Path | None, scratch: str, vocab_size: int) -> Path:
    """`data` (a prepared dataset), or the embedded corpus prepared into `scratch` at `vocab_size`."""
    if data is not None:
        return data
    from fastmae.prepare import prepare

    directory = Path(scratch) / "builtin"
    prepare([], directory, fmt="builtin", vocab_size=vocab_size, valid_fraction=0.02, workers=1, progress=False)
    return directory
