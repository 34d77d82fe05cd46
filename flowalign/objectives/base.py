"""The objectives protocol: its registry, base class and dataclasses (the package's docstring, ``flowalign.objectives``,
describes them). Built-in and user modules import it from here, not from the package, whose ``__init__`` imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from flowalign.components import Component
from flowalign.losses.base import PolicyOutput
from flowalign.registry import Registry
from flowalign.seeding import Purpose, generator

__all__ = ["OBJECTIVES", "DataUnit", "Objective", "ObjectiveContext", "PolicyOutput", "RolloutSamples", "process_slice",
           "register_objective", "unit_keys"]

OBJECTIVES: Registry = Registry("objective")
register_objective = OBJECTIVES.register
"""Register an objective: ``@register_objective("name", config=Settings)`` on its class, or
``register_objective("name", factory, config=...)`` (``Registry.register``)."""


@dataclass
class DataUnit:
    """One micro-batch of data: latents ``x`` ``[B, ...]``, noise levels ``sigma`` ``[B]``, conditioning rows ``cond``
    (one per sample) and what the loss needs in ``data``. ``nfe``: the per-sample model evaluations spent making the
    unit (SOAR's rollout step), counted in the trainer's ``nfe`` with its own evaluations of the unit."""

    x: Tensor
    sigma: Tensor
    cond: Any
    data: dict[str, Any] = field(default_factory=dict)
    nfe: int = 0

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass
class RolloutSamples:
    """This process's samples of the iteration's rollout, in sample order, for objectives on rollouts.

    ``x0`` ``[n, ...]``: the final latents; ``sample_ids`` ``[n]``: their global numbers (prompt-major, a contiguous
    slice per process); ``group_ids`` ``[n]``: their GRPO group (``sample_id // data.group_size``); ``advantages``:
    the group-normalised, clipped advantages the credit would get (``advantage.std``, ``advantage.clip``);
    ``rewards``: the combined reward before normalisation; ``valid``: False for a sample a reward could not judge;
    ``cond``: the iteration's conditioning, one row per prompt of the iteration, and ``prompt_index`` ``[n]`` each
    sample's row; ``sigmas``: the rollout's noise levels (``s_0 = 1 > ... > s_N = 0``)."""

    x0: Tensor
    sample_ids: Tensor
    group_ids: Tensor
    advantages: Tensor
    rewards: Tensor
    valid: Tensor
    cond: Any
    prompt_index: Tensor
    sigmas: Tensor

    def __len__(self) -> int:
        return int(self.x0.shape[0])

    def cond_of(self, rows: Tensor | list[int]):
        """The conditioning rows of the samples at local positions ``rows``."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        return self.cond.index(self.prompt_index[rows].to(self.cond.embeds.device))


@dataclass
class ObjectiveContext:
    """What an objective may use to make its units: the model (``encode``, ``encode_images``, ``prepare_noise``),
    the run's config, its seed and the iteration, this process's place among ``num_processes`` and its device;
    for an objective on rollouts, this process's samples of the iteration's rollout (``rollout``, else None)."""

    model: Any
    config: Any
    seed: int
    iteration: int
    process_index: int = 0
    num_processes: int = 1
    device: torch.device | str | None = None
    rollout: RolloutSamples | None = None

    def generator(self, key: int, purpose: int = Purpose.OBJECTIVE) -> torch.Generator:
        """A CPU generator keyed by ``(seed, iteration, key, purpose)`` (``flowalign.seeding``)."""
        return generator(self.seed, self.iteration, int(key), int(purpose))

    def shard(self, items: list) -> list:
        """This process's share of ``items``, the iteration's units in key order (``unit_keys``: its contiguous slice
        with one minibatch; their count must split evenly over the processes, and the minibatches with several)."""
        return [items[k] for k in unit_keys(len(items), self, what="the data units")]


def process_slice(count: int, process_index: int, num_processes: int, *, what: str = "units_per_iteration") -> range:
    """The contiguous slice of ``count`` units process ``process_index`` of ``num_processes`` takes.

    ``count`` must divide evenly: every process then runs the same number of backward passes (a collective each
    under DDP), and the processes' slices, concatenated in process order, are the 1-process list."""
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(f"process_index {process_index} is not in 0..{num_processes - 1}")
    if count % num_processes:
        raise ValueError(f"{what} = {count} must be a multiple of the number of processes ({num_processes}) so "
                         "every process gets the same number of units")
    share = count // num_processes
    return range(process_index * share, (process_index + 1) * share)


def unit_keys(count: int, context: ObjectiveContext, *, what: str = "units_per_iteration") -> list[int]:
    """The keys (global numbers) of the data units this process makes, in its order, for ``count`` units an iteration.

    The trainer gives minibatch ``m`` the ``m``-th of ``optim.minibatches`` (``M``) equal shares of each process's
    units, so the units are numbered minibatch-major, then by process, then in order: with ``c = count / (P M)``,
    process ``p``'s ``j``-th unit is ``(j // c) P c + p c + j % c``. Minibatch ``m`` then trains units
    ``[m count / M, (m + 1) count / M)`` on any number of processes ``P``; one process makes ``range(count)``, and with
    ``M = 1`` process ``p`` makes its contiguous ``process_slice``. ``count`` must be a multiple of ``P`` (``P M`` when
    ``P > 1``)."""
    process_slice(count, context.process_index, context.num_processes, what=what)
    processes = context.num_processes
    minibatches = int(getattr(getattr(context.config, "optim", None), "minibatches", 1))
    if processes == 1:
        return list(range(count))
    if count % (processes * minibatches):
        raise ValueError(f"{what} = {count} must be a multiple of the processes times optim.minibatches "
                         f"({processes} x {minibatches}) so every minibatch trains the same units on any number of "
                         "processes")
    per = count // (processes * minibatches)
    return [m * processes * per + context.process_index * per + i for m in range(minibatches) for i in range(per)]


class Objective(Component):
    """A loss on data units (module docstring)."""

    needs_reference: ClassVar[bool] = False
    # Trains on the iteration's rollouts (context.rollout) instead of a dataset: the trainer rolls out and scores for it.
    trains_on_rollouts: ClassVar[bool] = False
    # The setting that decides samples_per_unit (named in batch-arithmetic errors).
    unit_setting: ClassVar[str] = "batch_size"
    # As CreditEstimator.skip_without_signal; and the CFG scale its units are evaluated at (1: conditional velocity).
    skip_without_signal: ClassVar[bool] = True
    guidance_scale: ClassVar[float] = 1.0

    def samples_per_unit(self, config) -> int | None:
        """For an objective on rollouts: the consecutive samples one unit holds (each process's share of the samples
        must be a multiple of it), or None when units take any share. Unused for objectives on data."""
        return None

    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        raise NotImplementedError

    def loss(self, unit: DataUnit, policy) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError
