"""Probes: TempFlow-GRPO's branch-at-step rollouts (He et al. 2025, "TempFlow-GRPO").

One deterministic ODE trunk per prompt; at each of ``probe_steps`` it branches into ``data.group_size`` SDE children,
each completed by the ODE and scored, so each reward is the process reward of exactly one stochastic transition,
normalised over its siblings. A prompt therefore holds ``len(probe_steps)`` groups of ``data.group_size`` samples,
and every probe step is trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.rollout.base import Batch, RolloutContext, RolloutShape, register_shape
from flowalign.samplers import probe_rollout
from flowalign.seeding import Purpose
from flowalign.settings import check, option


@dataclass
class ProbeShapeConfig(ComponentConfig):
    probe_steps: list[int] = option([0, 2, 4, 6], "the trunk steps that branch; each gives one group of "
                                    "data.group_size children")

    def validate(self) -> None:
        probes = self.probe_steps
        check(len(probes) > 0, "probe_steps", "must list at least one step")
        check(min(probes) >= 0, "probe_steps", f"must be >= 0, got {probes}")
        check(all(b > a for a, b in zip(probes, probes[1:])), "probe_steps", f"must strictly increase, got {probes}")


@register_shape("probe", config=ProbeShapeConfig)
class Probes(RolloutShape):
    """an ODE trunk per prompt with group_size ODE-completed SDE children at each probe step (TempFlow-GRPO)."""

    whole_prompts = True
    fields = frozenset({"velocity"})

    def samples_per_prompt(self, group_size: int) -> int:
        return group_size * self.groups_per_prompt()

    def groups_per_prompt(self) -> int:
        return len(self.config.probe_steps)

    def stochastic_steps(self, sampling) -> int:
        return len(self.config.probe_steps)

    def stochastic_step_source(self) -> str:
        return "rollout.probe_steps"

    def check(self, config) -> None:
        stochastic = config.sampling.always_stochastic_steps()
        outside = [s for s in self.config.probe_steps if s not in stochastic]
        check(not outside, "rollout.probe_steps",
              f"{outside} are not stochastic steps of the noise schedule (the steps that are: {sorted(stochastic)} of "
              f"0..{config.sampling.num_steps - 1})")

    def grow(self, context: RolloutContext, ids: Tensor, cond) -> Batch:
        config = context.config
        sampling = config.sampling
        owners = torch.unique_consecutive(ids // self.samples_per_prompt(config.data.group_size))
        x_init = context.model.prepare_noise(
            len(owners), sampling.image_size, generator=[context.generator(p, Purpose.INIT_NOISE) for p in owners])
        chunk_cond = cond.index(owners)
        result = probe_rollout(
            context.rollout_velocity(chunk_cond), x_init, context.sigmas, context.levels, self.config.probe_steps,
            config.data.group_size, kind=sampling.kind, reduce=sampling.log_prob_reduce,
            generator=[context.generator(p, Purpose.SDE_NOISE) for p in owners], prompt_ids=owners,
            keep_velocity=context.keeps("velocity"),
        )
        return Batch(result, ids, chunk_cond, prompt_index=owners)
