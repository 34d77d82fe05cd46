"""Step rewards from the rewards of ODE-completed (or x0-projected) intermediate states: DenseGRPO's increments,
the return to go, and TP-GRPO's turning points (the math is in ``flowalign.credit.step_rewards``).

Each state ``x_k`` of a chain gets ``R_k``, the weighted sum of the raw rewards of its clean estimate
(``flowalign.reward_models.intermediate.IntermediateScorer``: an ODE completion over the rest of the schedule, capped
at ``ode_steps``, or the one-step x0 projection); ``R_T`` is the terminal reward already computed. The step rewards
are normalised per (group, step) over the trained transitions and clipped like group advantages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.credit import BatchScores, Credit, CreditContext, CreditEstimator, register_credit, trained_mask
from flowalign.normalization import group_normalize
from flowalign.credit.step_rewards import dense_increments, return_to_go, turning_point_rewards
from flowalign.settings import at_least, check, option

__all__ = ["StepRewardConfig", "TurningPointConfig", "intermediate_rewards", "normalized_step_credit"]


@dataclass
class StepRewardConfig(ComponentConfig):
    clean: Literal["ode", "x0"] = option(
        "ode", "clean estimate of an intermediate state: an ODE completion, or the one-step x0 projection")
    ode_steps: int | None = option(None, "ODE completion steps; null = the rollout's whole remaining schedule")

    def validate(self) -> None:
        at_least("ode_steps", self.ode_steps, 1)


@dataclass
class TurningPointConfig(StepRewardConfig):
    balanced: bool = option(False, "keep as many positive as negative turning points per group")


class StepRewardCredit(CreditEstimator):
    """Per-step rewards from intermediate states, normalised per step within each group."""

    shapes = ("group",)
    whole_prompts = True

    def check(self, config) -> None:
        check(config.reward.combine == "sum_then_normalize", "reward.combine",
              f"must be 'sum_then_normalize' with credit.name = {self.name!r}: intermediate states are scored with the "
              "weighted sum of the raw rewards")
        check(config.advantage.std == "group", "advantage.std",
              f"must be 'group' with credit.name = {self.name!r} (step rewards are normalised per step within each "
              "group)")

    def positions(self, steps: list[int], num_steps: int) -> set[int]:
        """The states whose rewards the step rewards of ``steps`` read."""
        return set(steps)

    def step_values(self, rewards: Tensor, batch, context: CreditContext) -> Tensor:
        raise NotImplementedError

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        num_steps = context.config.sampling.num_steps
        rewards, nfe = intermediate_rewards(batch, self.positions(context.steps, num_steps), scores, context,
                                            clean=self.config.clean, ode_steps=self.config.ode_steps)
        return normalized_step_credit(batch, context, self.step_values(rewards, batch, context), nfe)


@register_credit("dense", config=StepRewardConfig)
class DenseCredit(StepRewardCredit):
    """DenseGRPO: transition t gets dR_t = R_{t+1} - R_t of the clean estimates."""

    def positions(self, steps, num_steps):
        return {k for s in steps for k in (s, s + 1)}

    def step_values(self, rewards, batch, context):
        return dense_increments(rewards)


@register_credit("return_to_go", config=StepRewardConfig)
class ReturnToGoCredit(StepRewardCredit):
    """transition t gets R_T - R_t, what the rest of the trajectory added."""

    def step_values(self, rewards, batch, context):
        return return_to_go(rewards)


@register_credit("turning_point", config=TurningPointConfig)
class TurningPointCredit(StepRewardCredit):
    """TP-GRPO: incremental rewards, and the aggregated R_T - R_t at turning points."""

    def positions(self, steps, num_steps):
        return set(range(num_steps + 1))

    def step_values(self, rewards, batch, context):
        values, _ = turning_point_rewards(rewards, balanced=self.config.balanced,
                                          pools=batch.sample_ids // context.config.data.group_size)
        return values


@torch.no_grad()
def intermediate_rewards(batch, positions: set[int], scores: BatchScores, context: CreditContext, *,
                         clean: str = "ode", ode_steps: int | None = None) -> tuple[Tensor, int]:
    """``R [B, T + 1]`` (float64, NaN where not computed or invalid) of a chain batch's states, and the NFEs spent.

    ``R_T`` is the terminal reward already computed; ``R_k`` for the other ``positions`` comes from an
    ``IntermediateScorer``: the clean estimate of ``x_k``, decoded and scored with ``context.state_reward``.
    """
    from flowalign.reward_models.intermediate import IntermediateScorer

    config, model = context.config, context.model
    t = batch.rollout.transitions
    size, num_steps = len(batch.sample_ids), config.sampling.num_steps
    metadata = batch.sample_metadata

    groups = batch.sample_ids // config.data.group_size

    def reward(images: Tensor, rows: Tensor) -> Tensor:
        return context.state_reward(images, [metadata[int(r)] for r in rows], groups[torch.as_tensor(rows).cpu()])

    sigmas = model.sigmas(num_steps, config.sampling.image_size)
    scorer = IntermediateScorer(context.per_row_velocity(batch.cond), model.decode, reward, sigmas, estimate=clean,
                                ode_steps=ode_steps)
    rewards = torch.full((size, num_steps + 1), math.nan, dtype=torch.float64)
    combined = scores.combined.double()
    rewards[:, num_steps] = torch.where(scores.valid, combined, torch.full_like(combined, math.nan))
    rows = torch.arange(size)
    with context.autocast():
        for k in sorted(set(positions) - {num_steps}):
            states = t.states[k * size: (k + 1) * size]  # node id = step * batch + row
            rewards[:, k] = scorer.score(states, [k] * size, rows, keys=[(k, r) for r in range(size)])
    return rewards, scorer.nfe


def normalized_step_credit(batch, context: CreditContext, values: Tensor, nfe: int) -> Credit:
    """Step rewards ``values [B, T]`` as per-transition advantages normalised per (group, step) and clipped; the
    weights mark the trained transitions with a finite step reward."""
    config = context.config
    t = batch.rollout.transitions
    per_transition = values.to(t.step.device)[t.sample_id, t.step]  # chain transitions are (step, row) pairs
    finite = torch.isfinite(per_transition) & trained_mask(t, context.steps)
    groups = t.group_id * config.sampling.num_steps + t.step
    advantages, _ = group_normalize(torch.where(finite, per_transition, 0.0).float(), groups, finite)
    clip = config.advantage.clip
    return Credit(advantages.clamp(-clip, clip), finite.float(), nfe)
