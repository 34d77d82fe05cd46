"""The losses protocol: its registry, base class and dataclasses (the package's docstring, ``flowalign.losses``,
describes them). Built-in and user modules import it from here, not from the package, whose ``__init__`` imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from flowalign.components import Component
from flowalign.registry import Registry

__all__ = ["LOSSES", "LossTerm", "MicroBatch", "PolicyOutput", "register_loss"]

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
