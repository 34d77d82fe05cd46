"""What the trainer hands the components each iteration, built from the trainer's state: the ``RolloutContext`` a
rollout shape grows its batches in (``flowalign.rollout``), the ``IterationContext`` of ``prepare_update`` and
``after_update`` (``flowalign.components``), the ``CreditContext`` of a credit estimator
(``flowalign.credit``), and the ``ObjectiveContext`` of an objective's units (``flowalign.objectives``), with the
rollout's final samples for an objective on rollouts (``RolloutSamples``).
"""

from __future__ import annotations

import torch

from flowalign.components import IterationContext
from flowalign.credit import CreditContext
from flowalign.data.condition_images import encode_kwargs
from flowalign.objectives import ObjectiveContext, RolloutSamples
from flowalign.rollout import RolloutContext, per_row_velocity
from flowalign.seeding import Purpose, generator
from flowalign.training.scoring import state_reward

__all__ = ["credit_context", "iteration_context", "objective_context", "rollout_context", "rollout_samples"]


def rollout_context(trainer, iteration: int, prompts: list[dict], schedule=None):
    """``(context, cond)`` of the rollout of ``iteration`` on ``prompts``: its noise levels (``schedule``, else the
    run's), sigmas, the components' hooks and the transition fields they need stored; and the prompts' conditioning
    (every prompt encoded on every process, so the text encoders see the same batch whatever the process layout; the
    negative prompts under CFG; an editing prompt's images), one row per prompt."""
    config, model, parts = trainer.config, trainer.model, trainer.parts
    sampling = config.sampling
    levels = (schedule or trainer.schedule).levels(sampling.num_steps, progress=trainer.progress(iteration),
                                                   generator=generator(config.train.seed, iteration, Purpose.WINDOW))
    sigmas = model.sigmas(sampling.num_steps, sampling.image_size)
    texts = [entry["prompt"] for entry in prompts]
    cond = model.encode(texts, negative_prompts=[""] * len(texts) if model.uses_cfg(sampling.guidance_scale) else None,
                        **encode_kwargs(prompts))
    hooks = [hook for part in parts.all() for hook in part.rollout_hooks()]
    fields = frozenset().union(*(part.rollout_fields() for part in parts.all()))
    return RolloutContext(model, config, iteration, sigmas, levels, hooks, prompts, fields), cond


def iteration_context(trainer, iteration: int, batches, scores) -> IterationContext:
    """The iteration as the components' ``prepare_update`` and ``after_update`` see it; ``mean_over_processes`` is
    collective (every process calls it alike)."""
    accelerator = trainer.accelerator

    def mean_over_processes(value: float) -> float:
        if accelerator.num_processes == 1:
            return float(value)
        gathered = accelerator.gather(torch.tensor([float(value)], dtype=torch.float64, device=accelerator.device))
        return float(gathered.mean())

    return IterationContext(iteration, trainer.config, batches, scores, accelerator.process_index,
                            accelerator.num_processes, mean_over_processes)


def credit_context(trainer, iteration: int, steps: list[int]) -> CreditContext:
    """What a credit estimator reads besides the batch: the model, the run's progress, the trained ``steps``, the
    state reward and the per-row velocity at the rollout's guidance scale."""
    config, model = trainer.config, trainer.model
    return CreditContext(config, model, iteration, trainer.progress(iteration), steps, state_reward(trainer.rewards),
                         trainer.accelerator.autocast,
                         lambda cond: per_row_velocity(model, cond, config.sampling.guidance_scale))


def objective_context(trainer, iteration: int, batches=(), scores=None) -> ObjectiveContext:
    """What an objective makes its units from; ``rollout`` holds the iteration's samples when it rolled out."""
    accelerator = trainer.accelerator
    rollout = rollout_samples(trainer, batches, scores) if batches and scores is not None else None
    return ObjectiveContext(trainer.model, trainer.config, trainer.config.train.seed, iteration,
                            accelerator.process_index, accelerator.num_processes, accelerator.device, rollout)


def rollout_samples(trainer, batches, scores) -> RolloutSamples:
    """This process's final samples and their rewards, for the objectives on rollouts."""
    config = trainer.config
    ids = torch.cat([b.sample_ids for b in batches])
    return RolloutSamples(
        x0=torch.cat([b.rollout.final for b in batches]), sample_ids=ids,
        group_ids=ids // config.data.group_size, advantages=scores.advantages, rewards=scores.combined,
        valid=scores.valid, cond=trainer.iteration_cond, prompt_index=ids // config.samples_per_prompt(),
        sigmas=trainer.model.sigmas(config.sampling.num_steps, config.sampling.image_size))
