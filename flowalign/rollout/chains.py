"""Chains: ``data.group_size`` independent trajectories per prompt (Flow-GRPO, Flow-GRPO-Fast, DanceGRPO, MixGRPO).

Sample ``j``'s initial noise is keyed by ``j`` (by its group with ``sampling.shared_noise``, DanceGRPO's shared
initial noise) and its SDE noise by ``j``, so a chain is the same in any chunk and on any process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowalign.rollout.base import Batch, RolloutContext, RolloutShape, register_shape
from flowalign.components import ComponentConfig
from flowalign.samplers import rollout
from flowalign.seeding import Purpose


@register_shape("group", config=ComponentConfig)
class Chains(RolloutShape):
    """group_size independent trajectories per prompt."""

    fields = frozenset({"velocity"})
    independent_trajectories = True

    def grow(self, context: RolloutContext, ids: Tensor, cond) -> Batch:
        sampling, group_size = context.config.sampling, context.config.data.group_size
        rows = [int(j) // group_size for j in ids]
        noise_keys = [int(j) // group_size if sampling.shared_noise else int(j) for j in ids]
        x_init = context.model.prepare_noise(
            len(ids), sampling.image_size, generator=[context.generator(k, Purpose.INIT_NOISE) for k in noise_keys])
        chunk_cond = cond.index(rows)
        velocity = context.with_base_tail(context.model.velocity_fn(chunk_cond, sampling.guidance_scale))
        with context.watch(velocity) as (velocity, readings), context.guide(rows, chunk_cond) as (shift, under, finish):
            result = rollout(
                velocity, x_init, context.sigmas, context.levels, kind=sampling.kind, reduce=sampling.log_prob_reduce,
                generator=[context.generator(int(j), Purpose.SDE_NOISE) for j in ids],
                group_ids=ids // group_size, prompt_ids=torch.arange(len(ids)), guidance=shift, log_prob_under=under,
                keep_velocity=context.keeps("velocity"),
            )
            guided = finish(result.final)
        return Batch(result, ids, chunk_cond, prompt_index=torch.tensor(rows), extras={**readings(), **guided})
