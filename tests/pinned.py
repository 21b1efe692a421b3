"""Losses of short fixed-seed training runs, pinned so that a refactor that changes what training computes fails.

`check_pinned(name, losses)` compares a run's logged losses with those recorded in tests/pinned_losses.json for this
machine: bit for bit where this machine (torch version, CPU capability, CPU model) recorded them, within
`other_machine_rel` elsewhere (another CPU sums in another order; bf16 is emulated on some CPUs, native on others).
`FASTMAE_RECORD_PINS=1 pytest ...` records this machine's values (one file per pin and machine, merged by hand or by
`python tests/pinned.py merge`), never silently: a recorded run is never also checked.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fastmae.hardware import device_name

PINS = Path(__file__).resolve().parent / "pinned_losses.json"
RECORDED = Path(__file__).resolve().parent / "pinned_losses.recorded"


def machine_key() -> str:
    """What decides the bits of a CPU run: torch's version, the CPU's model and vector capability, and the threads a
    training process gets (OMP_NUM_THREADS, which the suite sets per xdist worker)."""
    threads = os.environ.get("OMP_NUM_THREADS", str(os.cpu_count()))
    return f"torch {torch.__version__} | {device_name(torch.device('cpu'))} | {threads} threads"


def check_pinned(name: str, losses: dict[int, float], other_machine_rel: float = 1e-4) -> None:
    """Assert that `losses` ({step: loss}) are the pinned losses of run `name`."""
    key = machine_key()
    got = {str(step): loss for step, loss in sorted(losses.items())}
    if os.environ.get("FASTMAE_RECORD_PINS") == "1":
        RECORDED.mkdir(exist_ok=True)
        (RECORDED / f"{name}.json").write_text(json.dumps({name: {key: got}}, indent=1))
        return
    pinned = json.loads(PINS.read_text()).get(name)
    assert pinned, f"{PINS} has no losses for {name}: record them (FASTMAE_RECORD_PINS=1)"
    if key in pinned:
        assert got == pinned[key], f"{name}: the losses changed on the machine that pinned them ({key})"
        return
    expected = next(iter(pinned.values()))
    assert got.keys() == expected.keys(), (name, got, expected)
    for step, loss in expected.items():
        assert got[step] == pytest.approx(loss, rel=other_machine_rel), (name, step, got, expected)


def merge() -> None:
    """Fold the files FASTMAE_RECORD_PINS=1 wrote into tests/pinned_losses.json."""
    pins = json.loads(PINS.read_text()) if PINS.is_file() else {}
    for path in sorted(RECORDED.glob("*.json")):
        for name, by_machine in json.loads(path.read_text()).items():
            pins.setdefault(name, {}).update(by_machine)
        path.unlink()
    RECORDED.rmdir()
    PINS.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["merge"]:
    merge()
