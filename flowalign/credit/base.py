"""The credit protocol: its registry, base class and dataclasses (the package's docstring, ``flowalign.credit``,
describes them). Built-in and user modules import it from here, not from the package, whose ``__init__`` imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from flowalign.components import Component
from flowalign.registry import Registry

__all__ = ["CREDIT", "BatchScores", "Credit", "CreditContext", "CreditEstimator", "register_credit", "trained_mask"]

CREDIT: Registry = Registry("credit estimator")
register_credit = CREDIT.register
"""Register a credit estimator: ``@register_credit("name", config=Settings)`` on its class, or
``register_credit("name", factory, config=...)`` (``Registry.register``)."""


@dataclass
class Credit:
    """Per-transition ``advantages`` ``[N]``, ``weights`` ``[N]`` multiplying the step weights (None: 1), the
    ``nfe`` spent to compute them and ``stats`` to log (python floats)."""

    advantages: Tensor
    weights: Tensor | None = None
    nfe: int = 0
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class BatchScores:
    """The rewards of one batch's samples: group-normalised ``advantages``, the ``combined`` reward before
    normalisation and ``valid`` (each ``[B]``, CPU), and the decoded ``images`` ``[B, 3, H, W]`` in [0, 1] (CPU; None
    where a caller has none)."""

    advantages: Tensor
    combined: Tensor
    valid: Tensor
    images: Tensor | None = None


@dataclass
class CreditContext:
    """What credit may use: the run's config and model, the iteration and its progress in [0, 1], the trained steps,
    ``state_reward(images, metadata, group_ids)`` (the weighted sum of the raw rewards, float64, NaN where invalid),
    ``autocast()`` and the per-row velocity of a conditioning batch (``RolloutContext.per_row_velocity``)."""

    config: Any
    model: Any
    iteration: int
    progress: float
    steps: list[int]
    state_reward: Callable[[Tensor, list[dict]], Tensor]
    autocast: Callable[[], Any]
    per_row_velocity: Callable[[Any], Callable]


class CreditEstimator(Component):
    """Turns rewards into per-transition credit (module docstring)."""

    shapes: ClassVar[tuple[str, ...]] = ("group", "probe")
    whole_prompts: ClassVar[bool] = False
    # An iteration whose groups all have zero reward variance skips its update if every part training then says so.
    skip_without_signal: ClassVar[bool] = True

    def check_shape(self, config) -> None:
        """The rollout shape must be one this estimator accepts (the error names the setting more likely at fault:
        the shape when the credit is the default one)."""
        from flowalign.settings import check

        shape = config.rollout.name
        if shape in self.shapes:
            return
        hint = "; trees take credit.name = 'tree'" if shape == "tree" else ""
        if self.name == "group":
            check(False, "rollout.name", f"= {shape!r} is not a shape credit.name = 'group' accepts "
                  f"({', '.join(map(repr, self.shapes))}){hint}")
        check(False, "credit.name", f"= {self.name!r} accepts rollout shapes {', '.join(map(repr, self.shapes))}, "
              f"not rollout.name = {shape!r}{hint}")

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        raise NotImplementedError


def trained_mask(transitions, steps: list[int]) -> Tensor:
    """Whether each transition's step is one of the trained ``steps``."""
    return torch.isin(transitions.step, torch.tensor(steps, device=transitions.step.device))
