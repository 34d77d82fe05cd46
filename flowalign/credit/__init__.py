"""Credit estimators: how an iteration's rewards become one advantage (and a weight) per transition.

A ``CreditEstimator`` is registered in ``CREDIT`` with its settings (``credit: {name: tree, fusion: mean}``). It
declares which rollout shapes it accepts (``shapes``), whether a rollout chunk and a process must hold whole prompts
(``whole_prompts``: step rewards are normalised per group from the states of one chunk), the rollout hooks it needs
(``rollout_hooks``), and ``assign(batch, scores, context) -> Credit``: per-transition advantages, per-transition weights
that multiply the step weighting's (``None``: all 1), the NFEs it spent (ODE completions, register reads) and stats.

Built in: ``group`` (the terminal group advantage on every transition, Flow-GRPO), ``tree`` (BranchGRPO's depth-wise
tree advantages with fusion and pruning), ``dense``, ``return_to_go`` and ``turning_point`` (step rewards from
ODE-completed states: DenseGRPO, TP-GRPO), ``registers`` (step rewards from latent reward registers) and ``vgpo``
(VGPO's value-anchored advantages from the instant rewards of one-step clean estimates;
``value_anchored_advantages`` is its math for one group) and ``euphonium`` (Euphonium's process-reward-guided rollouts
and outcome plus process advantages; ``euphonium_advantages`` is its math) and ``diversity`` (GARDO's
diversity-aware advantages from image embeddings within a group; ``diversity_advantages`` is its math).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import Tensor

from flowalign.components import Component
from flowalign.registry import Registry

__all__ = ["CREDIT", "BatchScores", "Credit", "CreditContext", "CreditEstimator", "diversity_advantages",
           "euphonium_advantages", "register_credit", "value_anchored_advantages"]

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


# The built-in estimators and step components register themselves on import.
from flowalign.credit import diversity, euphonium, group, registers, steps, step_credit, tree, vgpo  # noqa: E402,F401
from flowalign.credit.diversity import diversity_advantages  # noqa: E402
from flowalign.credit.euphonium import euphonium_advantages  # noqa: E402
from flowalign.credit.value_anchored import value_anchored_advantages  # noqa: E402
