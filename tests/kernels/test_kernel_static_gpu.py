"""Static GPU check, on CPU: every kernel configuration compiles for sm_80 and sm_90 without spills and within
shared memory (what stands in for running on CUDA until a GPU is lent)."""

import json
import os
import subprocess
import sys

from fastmae.kernels import aot


def test_every_configuration_compiles_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "usage.json"
    proc = subprocess.run([sys.executable, "-m", "fastmae.kernels.aot", "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    expected = {(name, desc) for name, desc, *_ in aot.all_configs()}
    for arch in ("sm_80", "sm_90"):
        assert {(r["kernel"], r["config"]) for r in results if r["arch"] == arch} == expected
    for r in results:
        assert r["local_bytes"] == 0, r
        assert 0 < r["registers"] <= 255, r
        assert r["shared_bytes"] <= r["shared_limit"], r
