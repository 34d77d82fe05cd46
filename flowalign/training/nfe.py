"""The model evaluations an iteration spends, counted per sample (``nfe`` in the metrics).

``nfe`` is the rollout's evaluations (``nfe/rollout``: every process's chains), the completions a credit estimator
runs (``nfe/completion``), and, with objectives, what their units cost (``nfe/objectives``): what making a unit spent
(``DataUnit.nfe``) plus the trainer's evaluations of each of its rows in every inner epoch, one per policy pass (the
policy, the reference when the objective reads it, each policy copy it evaluates), doubled when the run's sampling
guidance scale makes the model evaluate with CFG.
"""

from __future__ import annotations

from flowalign.training.collectives import summed

__all__ = ["iteration_nfe", "objective_nfe"]


def objective_nfe(trainer, data: dict[str, list]) -> int:
    """This process's evaluations for its objectives' units ``data`` (objective name -> units)."""
    config = trainer.config
    evals = 2 if trainer.model.uses_cfg(config.sampling.guidance_scale) else 1
    total = 0
    for name, units in data.items():
        objective = trainer.parts.objectives[name]
        passes = 1 + int(objective.needs_reference) + sum(copy.evaluated for copy in objective.policy_copies())
        per_row = evals * passes * config.optim.inner_epochs
        total += sum(unit.nfe + per_row * len(unit) for unit in units)
    return total


def iteration_nfe(trainer, batches, completion_nfe: int, objective_nfe: float) -> dict[str, float]:
    """The iteration's ``nfe``, ``nfe/rollout`` and ``nfe/completion`` over every process (collective: the
    completions are summed over the processes); ``objective_nfe`` is already summed."""
    rollout = sum(b.rollout.nfe for b in batches) * trainer.accelerator.num_processes
    completion = summed(trainer.accelerator, completion_nfe)
    return {"nfe": float(rollout + completion + objective_nfe), "nfe/rollout": float(rollout),
            "nfe/completion": float(completion)}
