"""Trees: one BranchGRPO tree per prompt (Li et al. 2025, arXiv:2509.06040), whose leaves are the prompt's group.

Every live node branches into ``branching`` children at each of ``split_steps``; the other steps advance each node
by one SDE (or ODE) step. A tree of 4 binary splits over 10 steps costs 77 NFEs against 160 for 16 chains. The split
steps draw with ``split_noise_scale`` times the SDE's std and their log-probs use the same density. How leaf rewards
become per-edge advantages (fusion, pruning) is the tree credit's business (``flowalign.credit.tree``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.rollout.base import Batch, RolloutContext, RolloutShape, register_shape
from flowalign.samplers import TreeSchedule, tree_rollout
from flowalign.seeding import Purpose
from flowalign.settings import at_least, check, finite, option


@dataclass
class TreeShapeConfig(ComponentConfig):
    split_steps: list[int] = option([0, 2, 4, 6], "the steps at which every live node branches (increasing)")
    branching: list[int] = option([2], "children per split, one per split step or a single factor for all")
    split_noise_scale: float = option(1.0, "the split steps draw with this multiple of the SDE std (and are scored "
                                      "with it)")

    def factors(self) -> list[int]:
        return list(self.branching) * len(self.split_steps) if len(self.branching) == 1 else list(self.branching)

    def leaves(self) -> int:
        return math.prod(self.factors())

    def validate(self) -> None:
        steps = self.split_steps
        check(len(steps) > 0, "split_steps", "must list at least one step")
        check(min(steps) >= 0, "split_steps", f"must be >= 0, got {steps}")
        check(all(b > a for a, b in zip(steps, steps[1:])), "split_steps", f"must strictly increase, got {steps}")
        check(len(self.branching) in (1, len(steps)), "branching",
              f"has {len(self.branching)} factors for {len(steps)} split steps: give one per split or a single one")
        for i, factor in enumerate(self.branching):
            at_least(f"branching[{i}]", factor, 1)
        finite("split_noise_scale", self.split_noise_scale, 0.0, strict=True)


@register_shape("tree", config=TreeShapeConfig)
class Trees(RolloutShape):
    """one branching tree per prompt, its leaves the prompt's group (BranchGRPO)."""

    whole_prompts = True
    fields = frozenset({"velocity"})

    def check(self, config) -> None:
        settings, sampling = self.config, config.sampling
        stochastic = sampling.always_stochastic_steps()
        outside = [s for s in settings.split_steps if s not in stochastic]
        check(not outside, "rollout.split_steps",
              f"{outside} are not stochastic (trained) steps of every rollout; the steps that are: {sorted(stochastic)} "
              f"of 0..{sampling.num_steps - 1}")
        check(settings.leaves() == config.data.group_size, "data.group_size",
              f"= {config.data.group_size} must equal the leaves of one tree, the product of rollout.branching "
              f"{settings.factors()} = {settings.leaves()}")

    def schedule(self) -> TreeSchedule:
        return TreeSchedule(tuple(self.config.split_steps), tuple(self.config.factors()), self.config.split_noise_scale)

    def grow(self, context: RolloutContext, ids: Tensor, cond) -> Batch:
        sampling = context.config.sampling
        groups = torch.unique_consecutive(ids // context.config.data.group_size)
        roots = context.model.prepare_noise(
            len(groups), sampling.image_size, generator=[context.generator(g, Purpose.INIT_NOISE) for g in groups])
        chunk_cond = cond.index(groups)
        result = tree_rollout(
            context.rollout_velocity(chunk_cond), roots, context.sigmas, context.levels, self.schedule(),
            kind=sampling.kind, reduce=sampling.log_prob_reduce,
            generator=[context.generator(g, Purpose.SDE_NOISE) for g in groups],
            group_ids=groups, prompt_ids=torch.arange(len(groups)), keep_velocity=context.keeps("velocity"),
        )
        return Batch(result, ids, chunk_cond, prompt_index=groups)
