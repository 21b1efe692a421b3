"""Test-only hooks, read from the environment once: the trainer builds `FaultHooks.from_environment` and is the only
production code that names this module.

- FASTMAE_FAULT_AT_STEP=N: the process dies hard (exit 17, no cleanup) right after optimizer step N and its
  checkpoint when one is due, as a killed node would.
- FASTMAE_SYNC_DEBUG=1 (CUDA): `torch.cuda.set_sync_debug_mode("error")` around every steady-state step, so any
  host-device synchronisation raises.
- FASTMAE_FAULT_STARTUP_PEAK=F: the matmul peak measured at start-up reads F times what it measured (F < 1: as on
  a machine far busier than a test can make it reliably), so the first logged window beats it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FaultHooks:
    exit_after_step: int = 0  # 0: never
    sync_debug: bool = False
    startup_peak_factor: float = 1.0

    @classmethod
    def from_environment(cls, device: torch.device) -> FaultHooks:
        return cls(exit_after_step=int(os.environ.get("FASTMAE_FAULT_AT_STEP", "0")),
                   sync_debug=device.type == "cuda" and os.environ.get("FASTMAE_SYNC_DEBUG") == "1",
                   startup_peak_factor=float(os.environ.get("FASTMAE_FAULT_STARTUP_PEAK", "1")))

    def startup_peak(self, measured: float) -> float:
        """The matmul peak measured at start-up, as FASTMAE_FAULT_STARTUP_PEAK has it read."""
        return measured * self.startup_peak_factor

    def forbid_syncs(self, on: bool) -> None:
        """While `on`, a host-device synchronisation raises (FASTMAE_SYNC_DEBUG=1 on CUDA only)."""
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    def after_step(self, step: int) -> None:
        """Die hard after step FASTMAE_FAULT_AT_STEP."""
        if self.exit_after_step and step == self.exit_after_step:
            os._exit(17)
