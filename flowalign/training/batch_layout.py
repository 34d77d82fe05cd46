"""The batch arithmetic of one iteration: how its samples, rollout chunks, trained steps and minibatches split over
the processes, checked so that every split is even (the config's vocabulary: ``flowalign.training.config``).

``TrainConfig.validate`` checks it for one process, and the trainer again once it knows how many processes it runs
on (``TrainConfig.check_batch``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowalign.config import ConfigError
from flowalign.settings import check as _check

__all__ = ["BatchLayout", "batch_layout"]


@dataclass(frozen=True)
class BatchLayout:
    """The batch arithmetic of one iteration on ``num_processes`` processes (all counts per process but the first)."""

    num_processes: int
    global_samples: int
    samples_per_process: int
    rollout_batch_size: int
    trained_steps: int
    transitions_per_process: int
    micro_batches_per_process: int
    micro_batches_per_minibatch: int


def _processes(n: int) -> str:
    return "1 process" if n == 1 else f"{n} processes"


def batch_layout(config: Any, num_processes: int) -> BatchLayout:
    """The sizes of one iteration of ``config`` (a ``TrainConfig``) on ``num_processes`` processes; a ConfigError
    names the setting whose value does not split evenly, and how to fix it."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ConfigError(f"the number of processes must be an integer >= 1, got {num_processes!r}")
    data, sampling, optim = config.data, config.sampling, config.optim
    parts = config.components()
    shape = parts.shape
    per_prompt = shape.samples_per_prompt(data.group_size)
    samples = data.prompts_per_iteration * per_prompt
    groups = shape.groups_per_prompt()
    probes = f" * {groups} rollout.probe_steps" if groups > 1 else ""
    _check(
        samples % num_processes == 0,
        "data.prompts_per_iteration",
        f"* data.group_size{probes} = {samples} samples cannot be split over {_processes(num_processes)} "
        f"({data.prompts_per_iteration} prompts x {per_prompt} images): make it a multiple of {num_processes}",
    )
    local = samples // num_processes
    rollout_batch = sampling.batch_size or local
    _check(
        local % rollout_batch == 0,
        "sampling.batch_size",
        f"= {rollout_batch} does not divide the {local} samples per process "
        f"(data.prompts_per_iteration * data.group_size / {_processes(num_processes)})",
    )
    if shape.whole_prompts or parts.credit.whole_prompts:
        # A tree or a probed trunk is grown in one batched pass, and step rewards are normalised per group from
        # the states of one chunk, so these cannot span processes or rollout chunks.
        which = f"rollout.name = {config.rollout.name!r} and credit.name = {config.credit.name!r}"
        _check(
            local % per_prompt == 0,
            "data.prompts_per_iteration",
            f"= {data.prompts_per_iteration} prompts cannot be split evenly over {_processes(num_processes)}: "
            f"with {which} every process takes whole prompts ({per_prompt} samples each)",
        )
        _check(
            rollout_batch % per_prompt == 0,
            "sampling.batch_size",
            f"= {rollout_batch} is not a multiple of the {per_prompt} samples of one prompt: with {which} a rollout "
            "chunk holds whole prompts",
        )
    for name, objective in parts.objectives.items():
        count = getattr(objective.config, "units_per_iteration", None)
        if not objective.trains_on_rollouts and isinstance(count, int) and num_processes > 1:
            share = num_processes * optim.minibatches  # flowalign.objectives.unit_keys
            _check(count % share == 0, f"objectives.{name}.units_per_iteration",
                   f"= {count} must be a multiple of the processes times optim.minibatches ({num_processes} x "
                   f"{optim.minibatches}) so every minibatch trains the same units on any number of "
                   "processes: make it a multiple of " + str(share))
        per_unit = objective.samples_per_unit(config) if objective.trains_on_rollouts else None
        if per_unit:
            _check(local % per_unit == 0, f"objectives.{name}.{objective.unit_setting}",
                   f"makes units of {per_unit} consecutive samples, which do not divide the {local} samples per "
                   f"process (data.prompts_per_iteration * data.group_size / {_processes(num_processes)}): make "
                   "the samples per process a multiple of it, or change it")
    stochastic = shape.stochastic_steps(sampling) if config.loss else 0  # no loss term: no transition is trained
    steps = parts.step_selection.count(stochastic) if config.loss else 0
    steps_from = parts.step_selection.count_source() or shape.stochastic_step_source()
    transitions = local * steps
    micro_batches = (local // rollout_batch) * steps
    if optim.minibatch_split == "steps":
        _check(
            steps % optim.minibatches == 0,
            "optim.minibatches",
            f"= {optim.minibatches} does not divide the {steps} {steps_from}: a minibatch is a share of the "
            "trained steps over all samples, so that the updates do not depend on the number of processes (or "
            "set optim.minibatch_split: samples)",
        )
    elif config.loss:
        chunks = local // rollout_batch
        _check(
            chunks % optim.minibatches == 0,
            "optim.minibatches",
            f"= {optim.minibatches} does not divide the {chunks} rollout chunks per process ({local} samples / "
            f"sampling.batch_size {rollout_batch}): with optim.minibatch_split: samples a minibatch trains a share "
            "of the chunks: " + (f"set sampling.batch_size to {local // optim.minibatches} (or a divisor of it)"
                                 if local % optim.minibatches == 0 else
                                 f"make the samples per process a multiple of {optim.minibatches}"),
        )
    return BatchLayout(
        num_processes=num_processes,
        global_samples=samples,
        samples_per_process=local,
        rollout_batch_size=rollout_batch,
        trained_steps=steps,
        transitions_per_process=transitions,
        micro_batches_per_process=micro_batches,
        micro_batches_per_minibatch=micro_batches // optim.minibatches,
    )
