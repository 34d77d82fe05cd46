"""Noise-level schedules: which steps are stochastic, and how stochastic.

A schedule turns a step count (and, for the moving ones, a training progress in [0, 1] and a generator) into a
per-step table of noise levels. A level of 0 makes that step a deterministic ODE step; only steps with a positive
level are stochastic, and only stochastic steps are trained.

* ``ConstantNoise``: one level everywhere (Flow-GRPO, DanceGRPO).
* ``PerStepNoise``: an explicit table ``psi(t)`` (DenseGRPO's calibrated per-step levels).
* ``SDEWindow``: SDE inside a window of ``size`` consecutive steps, ODE outside (MixGRPO, Flow-GRPO-Fast). The window
  starts at a fixed step, at a random step drawn from a range for each rollout (Flow-GRPO-Fast), or slides from
  high noise to low noise as training progresses (MixGRPO).

By default the last step is an ODE step (``last_step_ode=True``): its next sigma is 0 (or tiny), where the
transition std vanishes and the likelihood blows up, so it is never trained (docs/design/math.md#noise-schedules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .sde import check_noise_level

WINDOW_STARTS = ("fixed", "random", "sliding")


class NoiseSchedule:
    """Base class: ``levels(num_steps, progress=0.0, generator=None) -> fp32 tensor [num_steps]``."""

    def levels(self, num_steps: int, *, progress: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
        raise NotImplementedError

    def stochastic(self, num_steps: int, **kwargs) -> Tensor:
        """Boolean mask of the stochastic (trained) steps."""
        return self.levels(num_steps, **kwargs) > 0

    def reads_progress(self) -> bool:
        """Whether the levels depend on the training progress (a resumed run of another length would differ)."""
        return False

    def stochastic_step_sets(self, base_levels: Sequence[float], num_steps: int) -> list[set[int]]:
        """The stochastic steps of every rollout this schedule can make, given its levels before any window
        (``base_levels``, one per step): one set, the steps with a positive level."""
        return [{i for i, level in enumerate(base_levels) if level > 0}]


def _check_num_steps(num_steps: int) -> None:
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")


def _check_progress(progress: float) -> None:
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"training progress must lie in [0, 1], got {progress!r}")


@dataclass(frozen=True)
class ConstantNoise(NoiseSchedule):
    """The same ``level`` at every step (the last one excepted when ``last_step_ode``)."""

    level: float
    last_step_ode: bool = True

    def __post_init__(self):
        check_noise_level(self.level)

    def levels(self, num_steps: int, *, progress: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
        _check_num_steps(num_steps)
        table = torch.full((num_steps,), float(self.level))
        if self.last_step_ode:
            table[-1] = 0.0
        return table


@dataclass(frozen=True)
class PerStepNoise(NoiseSchedule):
    """An explicit per-step table ``psi(t)``; its length must equal the number of steps. Used as given."""

    table: Sequence[float]

    def __post_init__(self):
        check_noise_level(torch.as_tensor(list(self.table), dtype=torch.float32))

    def levels(self, num_steps: int, *, progress: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
        _check_num_steps(num_steps)
        if len(self.table) != num_steps:
            raise ValueError(
                f"the per-step noise table has {len(self.table)} entries but the rollout has {num_steps} steps: "
                "give one level per step"
            )
        return torch.as_tensor(list(self.table), dtype=torch.float32).clone()


@dataclass(frozen=True)
class SDEWindow(NoiseSchedule):
    """SDE on ``size`` consecutive steps, ODE elsewhere.

    ``base`` gives the levels inside the window (a constant, or a schedule evaluated on all steps). ``start`` is
    ``"fixed"`` (the window begins at ``first``), ``"random"`` (uniform over ``first..last`` for each call,
    Flow-GRPO-Fast) or ``"sliding"`` (``first`` at progress 0 moving linearly to ``last`` at progress 1, MixGRPO).
    ``last`` defaults to the latest start that keeps the window inside the usable steps.
    """

    base: float | NoiseSchedule
    size: int
    start: str = "fixed"
    first: int = 0
    last: int | None = None
    last_step_ode: bool = True

    def __post_init__(self):
        if self.start not in WINDOW_STARTS:
            raise ValueError(f"unknown SDE window start {self.start!r}: expected one of {', '.join(WINDOW_STARTS)}")
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"SDE window size must be a positive integer, got {self.size!r}")
        if not isinstance(self.base, NoiseSchedule):
            check_noise_level(self.base)
        if self.first < 0:
            raise ValueError(f"SDE window first start must be >= 0, got {self.first}")
        if self.last is not None and self.last < self.first:
            raise ValueError(f"SDE window start range is empty: first={self.first} > last={self.last}")

    def latest_start(self, num_steps: int) -> int:
        """The latest step the window may start at in a ``num_steps``-step rollout, its ``size`` steps inside the
        usable ones (negative: it cannot fit)."""
        usable = num_steps - 1 if self.last_step_ode else num_steps
        return usable - self.size

    def start_range(self, num_steps: int) -> tuple[int, int]:
        """The inclusive range of window starts allowed for ``num_steps``; errors when the window cannot fit."""
        latest = self.latest_start(num_steps)
        if latest < 0:
            usable = latest + self.size
            extra = " (the last step is always ODE; set last_step_ode=False to use it)" if self.last_step_ode else ""
            raise ValueError(
                f"SDE window size {self.size} is larger than the {usable} usable steps of a {num_steps}-step rollout"
                f"{extra}: choose a size in 1..{usable}"
            )
        last = latest if self.last is None else self.last
        if self.first > latest or last > latest:
            raise ValueError(
                f"SDE window starts {self.first}..{last} do not fit: a window of {self.size} steps in a "
                f"{num_steps}-step rollout can start at 0..{latest}"
            )
        return self.first, last

    def starts(self, num_steps: int) -> range:
        """Every step the window may start at: ``first`` alone for a fixed window, ``first..last`` otherwise."""
        first, last = self.start_range(num_steps)
        return range(first, first + 1 if self.start == "fixed" else last + 1)

    def reads_progress(self) -> bool:
        """A sliding window moves with the training progress (MixGRPO)."""
        return self.start == "sliding"

    def stochastic_step_sets(self, base_levels: Sequence[float], num_steps: int) -> list[set[int]]:
        """One set per start the window may take: the steps with a positive base level inside it."""
        (positive,) = super().stochastic_step_sets(base_levels, num_steps)
        return [positive & set(range(start, start + self.size)) for start in self.starts(num_steps)]

    def window_start(self, num_steps: int, *, progress: float = 0.0, generator: torch.Generator | None = None) -> int:
        first, last = self.start_range(num_steps)
        if self.start == "fixed":
            return first
        if self.start == "random":
            return int(torch.randint(first, last + 1, (1,), generator=generator))
        _check_progress(progress)
        return first + round(progress * (last - first))

    def levels(self, num_steps: int, *, progress: float = 0.0, generator: torch.Generator | None = None) -> Tensor:
        _check_num_steps(num_steps)
        begin = self.window_start(num_steps, progress=progress, generator=generator)
        if isinstance(self.base, NoiseSchedule):
            inside = self.base.levels(num_steps, progress=progress, generator=generator)
        else:
            inside = torch.full((num_steps,), float(self.base))
        table = torch.zeros(num_steps)
        table[begin : begin + self.size] = inside[begin : begin + self.size]
        return table


def noise_schedule(spec: float | Sequence[float] | NoiseSchedule | dict) -> NoiseSchedule:
    """Build a schedule from a number (constant), a list (per-step table), a schedule, or a config dict.

    A dict takes ``level`` or ``table`` plus, for a window, ``window`` (size) and optional ``window_start``,
    ``window_first``, ``window_last``; ``last_step_ode`` applies to constants and windows.
    """
    if isinstance(spec, NoiseSchedule):
        return spec
    if isinstance(spec, (int, float)):
        return ConstantNoise(float(spec))
    if isinstance(spec, (list, tuple)):
        return PerStepNoise(tuple(float(x) for x in spec))
    if isinstance(spec, dict):
        known = {"level", "table", "window", "window_start", "window_first", "window_last", "last_step_ode"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown noise schedule keys {unknown}: expected some of {sorted(known)}")
        if ("level" in spec) == ("table" in spec):
            raise ValueError("a noise schedule needs exactly one of 'level' (a constant) or 'table' (per-step levels)")
        last_step_ode = bool(spec.get("last_step_ode", True))
        base: float | NoiseSchedule
        if "table" in spec:
            base = PerStepNoise(tuple(float(x) for x in spec["table"]))
        else:
            base = float(spec["level"])
        if "window" not in spec:
            return base if isinstance(base, NoiseSchedule) else ConstantNoise(base, last_step_ode=last_step_ode)
        return SDEWindow(
            base,
            int(spec["window"]),
            start=spec.get("window_start", "fixed"),
            first=int(spec.get("window_first", 0)),
            last=spec.get("window_last"),
            last_step_ode=last_step_ode,
        )
    raise TypeError(f"cannot build a noise schedule from {type(spec).__name__}: give a number, a list or a dict")
