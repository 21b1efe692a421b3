"""Known noise of the libraries a training rank runs on, quieted before they are imported (`quiet_known_noise`).

Each rule names one message that says nothing to a fastmae user, so every other warning still shows:
- DeepSpeed warns "Setting accelerator to CPU" in every rank where no GPU is visible: it is told so (DS_ACCELERATOR).
- DeepSpeed warns "You are using ZeRO with an untested optimizer" at every start: fastmae's ClippingAdamW is its own
  (fastmae/optim.py), tested by fastmae's suite.
- torch deprecates `all_gather_into_tensor`, which DeepSpeed's ZeRO calls: a FutureWarning for DeepSpeed to act on.
"""

from __future__ import annotations

import logging
import os
import warnings

KNOWN_DEEPSPEED_WARNINGS = ("ZeRO with an untested optimizer",)
KNOWN_FUTURE_WARNINGS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",)


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(known in record.getMessage() for known in KNOWN_DEEPSPEED_WARNINGS)


def quiet_known_noise() -> None:
    """Call before deepspeed is imported (its accelerator is chosen then)."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    deepspeed_logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed creates under this name
    if not any(isinstance(f, _DropKnown) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_DropKnown())
    for message in KNOWN_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
