"""Loss terms on rollout transitions: the GRPO policy loss (PPO clip + KL) and RG-OPD, as registered components.

The trainer evaluates the policy once per micro-batch (one rollout batch at one step, the rollout's own batch
composition, so the first ratio is exactly 1) and hands every term the same ``MicroBatch`` and ``PolicyOutput``: the
policy velocity at the unique source states (and per transition), and the reference velocity (LoRA off), computed
once when any term ``needs_reference``. A term never runs the policy itself, so no term can re-batch the forward. A
term may hold a teacher set up from the model (RG-OPD's targets on the reference model).

The micro-batch loss is the sum of the terms, in the order of ``loss`` in the config (the default ``grpo`` first), and
the stats of all terms are logged together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from flowalign.components import Component
from flowalign.registry import Registry

__all__ = ["LOSSES", "LossTerm", "MicroBatch", "PolicyOutput", "register_loss", "soar_aux_points", "soar_loss"]

LOSSES: Registry = Registry("loss term")
register_loss = LOSSES.register
"""Register a loss term: ``@register_loss("name", config=Settings)`` on its class, or
``register_loss("name", factory, config=...)`` (``Registry.register``)."""


@dataclass
class MicroBatch:
    """The transitions of one batch at one step. ``sources`` are the unique source nodes (the states the policy is
    evaluated at, ``x``), ``inverse`` maps each transition to its source and ``rows`` each source to its conditioning
    row of ``batch.cond``; ``metadata[i]`` is source ``i``'s prompt entry."""

    batch: Any
    step: int
    transitions: Any
    advantages: Tensor
    weights: Tensor
    sources: Tensor
    inverse: Tensor
    rows: Tensor
    x: Tensor
    sigma: Tensor
    sigma_next: Tensor
    cond: Any
    metadata: list[dict]


@dataclass
class PolicyOutput:
    """The policy velocity per transition ``v`` (with gradient) and at the sources ``v_sources``; the reference
    velocity likewise (``None`` unless a term needs it). ``v_copies``: at an objective's data unit, the velocity of
    each policy copy the objective declares (``Component.policy_copies``), by name, without gradient, computed in the
    same autocast and batch as ``v``."""

    v: Tensor
    v_ref: Tensor | None = None
    v_sources: Tensor | None = None
    v_ref_sources: Tensor | None = None
    v_copies: dict[str, Tensor] = field(default_factory=dict)


class LossTerm(Component):
    """One term of the micro-batch loss (module docstring)."""

    needs_reference: ClassVar[bool] = False

    def wants_reference(self) -> bool:
        """Whether this term, with its settings, reads the reference velocity."""
        return self.needs_reference

    def loss(self, micro: MicroBatch, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError


# The built-in terms register themselves on import.
from flowalign.losses import gated_kl, grpo, reference, rg_opd  # noqa: E402,F401
# SOAR's pure math (the objective on data is flowalign.objectives.soar).
from flowalign.losses.soar import soar_aux_points, soar_loss  # noqa: E402
