"""Learning-rate schedules as a scale of the base rate, a pure function of the step (so resuming needs no state)."""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "learning_rate_scale", "set_learning_rate"]

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


def set_learning_rate(optimizer, optim, iteration: int, iterations: int) -> None:
    """Set every parameter group of ``optimizer`` to the rate of ``iteration`` of ``iterations``: ``optim.lr`` times
    ``learning_rate_scale`` with ``optim``'s warmup, schedule and floor (``optim``: the run's ``OptimConfig``)."""
    scale = learning_rate_scale(iteration, iterations, warmup=optim.warmup_iterations, schedule=optim.lr_schedule,
                                floor=optim.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = optim.lr * scale
