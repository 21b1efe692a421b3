"""Claims held to the seed spread: the one rule by which the study and `fastmae glue` say that one set of per-seed
numbers differs from another (ARCHITECTURE.md section 10)."""

from __future__ import annotations

import numpy as np


def spread(values: list[float]) -> float | None:
    """max - min over seeds (None with one seed: the noise was not measured)."""
    return float(max(values) - min(values)) if len(values) > 1 else None


def compare(name: str, a: list[float], b: list[float], unit: str, higher_is: str, reference: str = "mlm") -> str:
    """One sentence comparing per-seed values `a` (objective) and `b` (`reference`'s) that never claims a difference
    smaller than the seed spread (the larger of the two ranges)."""
    diff = float(np.mean(a) - np.mean(b))
    values = f"{np.mean(a):.4g} vs {reference}'s {np.mean(b):.4g}" + (f" {unit}" if unit else "")
    noise = [s for s in (spread(a), spread(b)) if s is not None]
    if not noise:
        return f"{name}: {values}; one seed each, so the seed noise is unmeasured and no difference is claimed"
    noise_level = max(noise)
    if abs(diff) <= noise_level:
        return (f"{name}: {values}: the difference ({diff:+.3g}) is within the seed spread ({noise_level:.3g}); no "
                "difference is claimed")
    direction = "higher" if diff > 0 else "lower"
    verdict = "better" if (direction == higher_is) else "worse"
    return f"{name}: {values}: {direction} by {abs(diff):.3g}, beyond the seed spread ({noise_level:.3g}) - {verdict}"
