"""Learning-rate schedules as a scale of the base rate, a pure function of the step (so resuming needs no state)."""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "learning_rate_scale"]

SCHEDULES = ("constant", "cosine")


def learning_rate_scale(step: int, total: int, *, warmup: int = 0, schedule: str = "constant",
                        floor: float = 0.0) -> float:
    """The factor on the base learning rate at ``step`` (0-based) of ``total``.

    Linear warmup ``(step + 1) / warmup`` over the first ``warmup`` steps, then ``constant`` (1) or ``cosine``:
    ``floor + (1 - floor) (1 + cos(pi p)) / 2`` with ``p = (step - warmup) / (total - warmup)`` clipped to [0, 1],
    which falls from 1 to ``floor`` (a fraction of the base rate) at ``step = total``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
