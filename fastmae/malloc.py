"""The process restart that keeps freed memory in the process (glibc's malloc tunables), for command-line entry
points. Imports nothing but the standard library, so an entry point restarts before it pays for importing torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

# glibc hands every freed block over 32 MB back to the OS (and trims the heap), so each large CPU tensor of a step
# (logits, embedding gradients, attention scores) faults its pages in afresh: a [308, 32000] fp32 subtraction took
# 20 ms into new memory against 2.8 ms into reused memory. Keeping freed memory in the process, as CUDA's caching
# allocator does, made a small-model CPU training step 1.28x faster (1.77 s -> 1.38 s, bf16). glibc reads these only
# when a process starts.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=68719476736"


def malloc_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with MALLOC_TUNABLES added to GLIBC_TUNABLES (a user's own mmap_threshold setting is kept)."""
    current = env.get("GLIBC_TUNABLES", "")
    if "mmap_threshold" in current:
        return dict(env)
    return {**env, "GLIBC_TUNABLES": f"{current}:{MALLOC_TUNABLES}" if current else MALLOC_TUNABLES}


def restart_with_malloc_tunables() -> None:
    """Re-execute this process (same PID, same command line) with MALLOC_TUNABLES, unless already set or not Linux.
    For command-line entry points only, before any work starts."""
    env = malloc_env(os.environ)
    if sys.platform == "linux" and env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)
