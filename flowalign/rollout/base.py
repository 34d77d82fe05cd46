"""The rollout protocol: its registry, base class and dataclasses (the package's docstring, ``flowalign.rollout``,
describes them). Built-in and user modules import it from here, not from the package, whose ``__init__`` imports them.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import Tensor

from flowalign.components import Component, ComponentConfig
from flowalign.registry import Registry
from flowalign.seeding import generator

__all__ = ["SHAPES", "Batch", "RolloutContext", "RolloutGuidance", "RolloutHook", "RolloutShape", "per_row_velocity",
           "register_shape"]

SHAPES: Registry = Registry("rollout shape")
register_shape = SHAPES.register
"""Register a rollout shape: ``@register_shape("name", config=Settings)`` on its class, or
``register_shape("name", factory, config=...)`` (``Registry.register``)."""


@dataclass
class Batch:
    """One rollout chunk of a process: its rollout, its samples' global ids and its conditioning rows.

    ``cond`` has one row per ``transitions.prompt_id`` (per sample for chains, per tree or trunk otherwise) and
    ``prompt_index[r]`` is the iteration prompt of row ``r``, ``metadata[r]`` that prompt's entry;
    ``sample_metadata[i]`` is the entry of final image ``i``. ``extras`` holds what rollout hooks read. ``advantages`` and ``weights`` (one per transition) are filled in by the credit.
    """

    rollout: Any
    sample_ids: Tensor
    cond: Any
    prompt_index: Tensor
    metadata: list[dict] = field(default_factory=list)
    sample_metadata: list[dict] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    advantages: Tensor | None = None
    weights: Tensor | None = None

    @property
    def transitions(self):
        return self.rollout.transitions


class RolloutHook:
    """Reads the policy's passes during a chain rollout. ``watch(velocity)`` is a context manager yielding the
    velocity to roll out with (the hook's reads must leave its values unchanged) and a function returning what was
    read once the rollout is over."""

    name: ClassVar[str] = "hook"

    @contextmanager
    def watch(self, velocity: Callable) -> Iterator[tuple[Callable, Callable[[], Any]]]:
        yield velocity, lambda: None


class RolloutGuidance(RolloutHook):
    """Shifts the mean of a chain rollout's SDE steps (``sde_step(..., mean_shift=...)``). A component returns it
    from ``rollout_hooks()``; ``guide(context, metadata, cond)`` is a context manager, entered once per chunk with
    its prompts' entries and its conditioning (``cond``, one row per sample, so a guidance may run the model at the
    chunk's states: ``context.per_row_velocity(cond)``), yielding ``shift(x, v, sigma, sigma_next, step) -> [B, ...]
    or None`` (called on every step after the velocity; a shift only on SDE steps) and ``finish(final) -> what lands
    in Batch.extras[name]``. ``log_prob_under`` is the mean the
    stored log-prob is taken under (``"unguided"`` or ``"guided"``), and training recomputes it under the same one, so
    the first ratio stays exactly 1. It leaves the velocity unchanged (its ``watch`` passes it through)."""

    name: ClassVar[str] = "guidance"
    log_prob_under: str = "unguided"

    @contextmanager
    def guide(self, context: "RolloutContext", metadata: list[dict],
              cond: Any) -> Iterator[tuple[Callable, Callable[[Tensor], Any]]]:
        yield (lambda x, v, sigma, sigma_next, step: None), (lambda final: None)


@dataclass
class RolloutContext:
    """What a shape needs to grow one iteration's chunks: the model, the run's config, the iteration's noise
    schedule (``sigmas``, per-step ``levels``), the hooks of the run's components and the iteration's ``prompts``
    (entries, indexed like the conditioning rows)."""

    model: Any
    config: Any
    iteration: int
    sigmas: Tensor
    levels: Tensor
    hooks: list[RolloutHook] = field(default_factory=list)
    prompts: list[dict] = field(default_factory=list)
    fields: frozenset[str] = frozenset()

    def keeps(self, name: str) -> bool:
        """Whether a component asked the rollout to store the optional transition field ``name``."""
        return name in self.fields

    def with_base_tail(self, velocity: Callable) -> Callable:
        """``velocity`` (``(x, sigma, ...)``), except on the last ``sampling.base_tail_steps`` steps of the schedule,
        where it runs inside ``model.reference()`` (the base model: the LoRA disabled). Unchanged with no tail."""
        tail = int(getattr(self.config.sampling, "base_tail_steps", 0) or 0)
        if tail <= 0:
            return velocity
        first = float(self.sigmas[len(self.sigmas) - 1 - tail])  # sigma of the first tail step
        model = self.model

        def tailed(x: Tensor, sigma, *rest):
            if float(sigma) <= first:
                with model.reference():
                    return velocity(x, sigma, *rest)
            return velocity(x, sigma, *rest)

        tailed.evals_per_sample = getattr(velocity, "evals_per_sample", 1)
        return tailed

    def guidance(self) -> RolloutGuidance | None:
        """The one ``RolloutGuidance`` among the hooks, or None (two are refused: their shifts would not compose)."""
        guides = [hook for hook in self.hooks if isinstance(hook, RolloutGuidance)]
        if len(guides) > 1:
            raise ValueError(f"two components guide the rollout ({', '.join(g.name for g in guides)}): use one")
        return guides[0] if guides else None

    @contextmanager
    def guide(self, rows: list[int],
              cond: Any = None) -> Iterator[tuple[Callable | None, str, Callable[[Tensor], dict[str, Any]]]]:
        """``(shift or None, log_prob_under, finish(final) -> {guidance.name: what it recorded})`` for a chunk whose
        samples belong to the prompts ``rows`` and whose conditioning is ``cond`` (one row per sample)."""
        guidance = self.guidance()
        if guidance is None:
            yield None, "unguided", lambda final: {}
            return
        metadata = [self.prompts[r] for r in rows] if self.prompts else [{} for _ in rows]
        with guidance.guide(self, metadata, cond) as (shift, finish):
            yield shift, guidance.log_prob_under, lambda final: {guidance.name: finish(final)}

    def generator(self, key: int, purpose: int) -> torch.Generator:
        """The generator of draw ``(seed, iteration, key, purpose)``."""
        return generator(self.config.train.seed, self.iteration, int(key), purpose)

    @contextmanager
    def watch(self, velocity: Callable) -> Iterator[tuple[Callable, Callable[[], dict[str, Any]]]]:
        """``velocity`` wrapped by every hook; yields it and a function returning ``{hook.name: what it read}``."""
        with ExitStack() as stack:
            readers = {}
            for hook in self.hooks:
                if isinstance(hook, RolloutGuidance):  # it guides through guide(), not by reading passes
                    continue
                velocity, readers[hook.name] = stack.enter_context(hook.watch(velocity))
            yield velocity, lambda: {name: read() for name, read in readers.items()}

    def per_row_velocity(self, cond) -> Callable:
        return per_row_velocity(self.model, cond, self.config.sampling.guidance_scale)

    def rollout_velocity(self, cond) -> Callable:
        """The per-row velocity a shape grows its rollout with: ``per_row_velocity`` with the base-model tail."""
        return self.with_base_tail(self.per_row_velocity(cond))


def per_row_velocity(model, cond, guidance_scale: float) -> Callable:
    """``velocity(x, sigma, row)``: each state with the conditioning row ``row`` of ``cond`` (trees, probes, the
    completions of intermediate states), ``evals_per_sample`` 2 with CFG."""

    def velocity(x: Tensor, sigma: Tensor, row: Tensor) -> Tensor:
        return model.velocity(x, sigma, cond.index(row), guidance_scale)

    velocity.evals_per_sample = 2 if model.uses_cfg(guidance_scale) else 1
    return velocity


class RolloutShape(Component):
    """How an iteration's samples are grown (module docstring)."""

    # A chunk and a process hold whole prompts (the shape grows a prompt's samples in one batched pass).
    whole_prompts: ClassVar[bool] = False
    # The optional transition fields it can store when a component asks (module docstring).
    fields: ClassVar[frozenset[str]] = frozenset()
    # Every final image ends its own trajectory, drawn independently of the others (no shared trunk): what DenseGRPO's
    # noise calibration (flowalign.prep.calibrate) measures its dense rewards on.
    independent_trajectories: ClassVar[bool] = False

    def samples_per_prompt(self, group_size: int) -> int:
        """Final images per prompt."""
        return group_size

    def groups_per_prompt(self) -> int:
        """GRPO groups (of ``data.group_size`` samples) per prompt."""
        return 1

    def stochastic_steps(self, sampling) -> int:
        """How many steps of each rollout are stochastic (the most a step selection may train)."""
        return sampling.stochastic_steps()

    def stochastic_step_source(self) -> str:
        """The setting that decides ``stochastic_steps`` (named in batch-arithmetic errors)."""
        return "stochastic steps of the noise schedule"

    def grow(self, context: RolloutContext, sample_ids: Tensor, cond) -> Batch:
        raise NotImplementedError
