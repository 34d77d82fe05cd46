"""The kinds of component a run is built from, in one table, and ``Components``: the parts one config names, built.

Each row of ``COMPONENT_KINDS`` is one kind: its config section (``credit``), the attribute of ``Components`` that
holds it (``credit``), its registry (``"module:NAME"``, imported on first use), its default and its help. Everything
that lists the kinds reads the table: the sections of ``TrainConfig`` (``component_sections``), the parts a config
builds (``TrainConfig.components``), ``Components.named`` and the resumable keys. A new kind of component is one row.

A kind with ``many`` is a mapping of sections keyed by registered name (``loss.grpo``, ``objectives.sft``), several
on at once; its default is the tuple of names on by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from flowalign.components import ComponentConfig
from flowalign.config import component, component_map, resolve_reference
from flowalign.settings import check

__all__ = ["COMPONENT_KINDS", "ComponentKind", "Components", "component_sections"]


@dataclass(frozen=True)
class ComponentKind:
    """One kind of component (module docstring)."""

    section: str  # its config section: ``credit``, ``loss``
    attribute: str  # the attribute of ``Components`` that holds it: ``credit``, ``losses``
    registry: str  # ``"module:NAME"`` of its ``Registry``
    default: str | tuple[str, ...]  # the component used when no layer names one; the names on by default for ``many``
    help: str
    many: bool = False

    def build(self, settings: ComponentConfig) -> Any:
        """The component these settings name, built from them."""
        return resolve_reference(self.registry).build(settings.name, settings)


COMPONENT_KINDS: tuple[ComponentKind, ...] = (
    ComponentKind("rollout", "shape", "flowalign.rollout:SHAPES", "group",
                  "rollout shape: independent chains, branching trees or probed trunks"),
    ComponentKind("credit", "credit", "flowalign.credit:CREDIT", "group",
                  "how rewards become per-transition advantages"),
    ComponentKind("step_selection", "step_selection", "flowalign.credit.steps:STEP_SELECTIONS", "all",
                  "which stochastic steps are trained each iteration"),
    ComponentKind("step_weighting", "step_weighting", "flowalign.credit.steps:STEP_WEIGHTINGS", "uniform",
                  "the weight of each trained step's loss"),
    ComponentKind("loss", "losses", "flowalign.losses:LOSSES", ("grpo",),
                  "loss terms on the rollout's transitions, summed; none (every term null) with an objective = an "
                  "objective-only run: no rollout, no rewards", many=True),
    ComponentKind("objectives", "objectives", "flowalign.objectives:OBJECTIVES", (),
                  "losses on data units, interleaved into the minibatches", many=True),
    ComponentKind("reference", "reference", "flowalign.losses.reference:REFERENCES", "base",
                  "the reference policy the KL terms read: the base model, or GARDO's adaptive reference "
                  "(periodically reset to the policy)"),
)


def component_sections(after: str) -> Callable[[type], type]:
    """A class decorator, applied under ``@dataclass``: one field per row of ``COMPONENT_KINDS``, in the table's
    order, placed after the field ``after``."""

    def add(cls: type) -> type:
        declared = dict(cls.__dict__.get("__annotations__", {}))
        if after not in declared:
            raise TypeError(f"{cls.__name__} has no field {after!r} to place the component sections after")
        annotations: dict[str, Any] = {}
        for name, annotation in declared.items():
            annotations[name] = annotation
            if name == after:
                for kind in COMPONENT_KINDS:
                    annotations[kind.section] = dict[str, ComponentConfig] if kind.many else ComponentConfig
                    setattr(cls, kind.section, component_map(kind.registry, kind.default, kind.help) if kind.many
                            else component(kind.registry, kind.default, kind.help))
        cls.__annotations__ = annotations
        return cls

    return add


class Components:
    """The registered parts a ``TrainConfig`` names, built from its settings (cheap: nothing is loaded); one attribute
    per kind (``shape``, ``credit``, ``step_selection``, ``step_weighting``, ``losses``, ``objectives``,
    ``reference``), a mapping of names to parts for a kind with ``many``."""

    def __init__(self, **parts: Any):
        expected = {kind.attribute for kind in COMPONENT_KINDS}
        if set(parts) != expected:
            raise TypeError(f"Components takes one part per kind, {sorted(expected)}; got {sorted(parts)}")
        for kind in COMPONENT_KINDS:
            setattr(self, kind.attribute, parts[kind.attribute])

    @classmethod
    def build(cls, config: Any) -> Components:
        """The parts ``config`` names, each built from its section."""
        parts = {}
        for kind in COMPONENT_KINDS:
            settings = getattr(config, kind.section)
            parts[kind.attribute] = ({name: kind.build(s) for name, s in settings.items()} if kind.many
                                     else kind.build(settings))
        return cls(**parts)

    def named(self) -> dict[str, Any]:
        """Every part by its config section (``credit``, ``loss.grpo``, ``objectives.sft``, ``reference``), in the
        table's order."""
        parts = {}
        for kind in COMPONENT_KINDS:
            value = getattr(self, kind.attribute)
            if kind.many:
                parts.update({f"{kind.section}.{name}": part for name, part in value.items()})
            else:
                parts[kind.section] = value
        return parts

    def all(self) -> list[Any]:
        return list(self.named().values())

    def sampling_policy(self) -> str | None:
        """The policy the rollouts sample with (``Component.sampling_policy``): the one a component names, else None
        (the trained weights). Two components naming different ones are a ConfigError."""
        named = {part.sampling_policy() for part in self.all()} - {None}
        check(len(named) <= 1, "objectives",
              f"name different sampling policies ({', '.join(sorted(named))}): the rollouts sample with one; set "
              "the others' sampling options off")
        return named.pop() if named else None

    def prepare_update(self, context: Any) -> dict[str, float]:
        """Every part's ``prepare_update`` (``flowalign.components``), their stats merged."""
        return {key: value for part in self.all() for key, value in part.prepare_update(context).items()}

    def after_update(self, context: Any, metrics: dict[str, float]) -> dict[str, float]:
        """Every part's ``after_update`` with the iteration's metrics, their stats merged."""
        return {key: value for part in self.all() for key, value in part.after_update(context, metrics).items()}

    def rolls_out(self) -> bool:
        """Whether an iteration rolls out and scores: a loss term trains transitions, or an objective trains on the
        rollouts."""
        return bool(self.losses) or any(o.trains_on_rollouts for o in self.objectives.values())

    def trained_steps(self, transitions, seed: int, iteration: int) -> list[int]:
        """The steps an iteration trains: the step selection's choice among the rollout's stochastic steps.

        Args:
            transitions: a batch's rollout transitions (every batch of an iteration has the same steps).
            seed: the run's ``train.seed``.
            iteration: the iteration.

        Returns:
            The trained step indices.
        """
        stochastic = sorted({int(s) for s in transitions.step[transitions.stochastic]})
        return self.step_selection.select(stochastic, seed, iteration)

    def reads_reference(self) -> bool:
        """Whether a loss term reads the reference velocity (a KL penalty, the velocity MSE logged, RG-OPD's x0)."""
        return any(term.wants_reference() for term in self.losses.values())

    def skip_without_signal(self) -> bool:
        """Whether an iteration in which every group has zero reward variance skips its update: when every part that
        trains in it declares so (``CreditEstimator.skip_without_signal``: the credit, when there are loss terms;
        ``Objective.skip_without_signal``: each objective)."""
        deciders = ([self.credit] if self.losses else []) + list(self.objectives.values())
        return all(part.skip_without_signal for part in deciders)
