"""Step rewards from the rewards of ODE-completed (or x0-projected) intermediate states: DenseGRPO's increments,
the return to go, and TP-GRPO's turning points (the math is in ``flowalign.credit.step_rewards`` and, for TP-GRPO as
its released code runs, ``flowalign.credit.tp_grpo``).

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
from flowalign.credit.base import BatchScores, Credit, CreditContext, CreditEstimator, register_credit, trained_mask
from flowalign.advantages import group_normalize
from flowalign.credit.step_rewards import dense_increments, return_to_go, turning_point_rewards
from flowalign.credit.tp_grpo import RELEASED_OPTIONS, released_process_rewards
from flowalign.settings import at_least, check, option

__all__ = ["StepRewardConfig", "TurningPointConfig", "intermediate_rewards", "normalized_step_credit"]


@dataclass
class StepRewardConfig(ComponentConfig):
    clean: Literal["ode", "x0"] = option(
        "ode", "clean estimate of an intermediate state: an ODE completion, or the one-step x0 projection")
    ode_steps: int | None = option(None, "ODE completion steps; null = the rollout's whole remaining schedule")

    def validate(self) -> None:
        at_least("ode_steps", self.ode_steps, 1)


_R = RELEASED_OPTIONS


@dataclass
class TurningPointConfig(StepRewardConfig):
    process_rewards: Literal["released_code", "paper"] = option(
        "released_code", "whose rule makes the process rewards: released_code: the public code's (every step the "
        "global gain R_T - R_0, turning points add their local gain; the settings below are its options); paper: the "
        "paper's reading (local gains, replaced by R_T - R_t at turning points)")
    balanced: bool = option(False, "process_rewards paper: keep as many positive as negative turning points per group")
    take_delta_global_as_main: bool = option(
        _R["take_delta_global_as_main"], "released: every step gets the global gain, turning points add d_t; false: "
        "every step gets d_t, turning points add the global gain (or R_T - R_t with use_sde_minus_rt)")
    use_delta_global: bool = option(_R["use_delta_global"], "released: the global gain is R_T - R_0 (false: R_T)")
    use_sde_minus_rt: bool = option(
        _R["use_sde_minus_rt"], "released, take_delta_global_as_main false: the bonus is R_T - R_t")
    eta: float = option(_R["eta"], "released: the bonus coefficient")
    apply_first_step_bonus: bool = option(
        _R["apply_first_step_bonus"], "released: the first step can be a turning point")
    select_first_step_only_from_consistent_trajectory: bool = option(
        _R["select_first_step_only_from_consistent_trajectory"],
        "released: the first step needs sign(d_0) sign(R_T - R_1) > 0 instead of agreeing with the global trend")
    select_only_positive_intermediate_step: bool = option(
        _R["select_only_positive_intermediate_step"],
        "released: later turning points only on trajectories with R_T > R_0")
    select_inter_step_only_from_consistent_trajectory: bool = option(
        _R["select_inter_step_only_from_consistent_trajectory"],
        "released: later turning points need sign(d_t) sign(R_T - R_{t+1}) > 0")
    indicator_wo_delta_global_constraint: bool = option(
        _R["indicator_wo_delta_global_constraint"],
        "released: a later turning point is any sign change of d (d_{t-1} d_t < 0)")
    use_balanced_bonus: bool = option(
        _R["use_balanced_bonus"],
        "released: keep as many positive as negative bonuses per group, largest |d_t| (or |global gain|) first")
    drop_original_reward_when_having_bonus: bool = option(
        _R["drop_original_reward_when_having_bonus"],
        "released: a step with a nonzero bonus drops its main term")
    propagate_bonus_to_future_steps: bool = option(
        _R["propagate_bonus_to_future_steps"],
        "released: spread each turning point's R_T - R_t over the steps after it (positive) or before it (negative)")
    turn_on_bonus_global_step: int = option(
        _R["turn_on_bonus_global_step"], "released: no bonus before this iteration")

    def validate(self) -> None:
        super().validate()
        if self.process_rewards == "paper":
            changed = [key for key in RELEASED_OPTIONS if getattr(self, key) != RELEASED_OPTIONS[key]]
            check(not changed, changed[0] if changed else "process_rewards",
                  "is an option of credit.process_rewards = 'released_code'; with 'paper' leave it at its default, or "
                  "set credit.process_rewards = released_code")
        else:
            check(not self.balanced, "balanced", "is the paper variant's setting; with credit.process_rewards = "
                  "'released_code' balance with credit.use_balanced_bonus = true, or set "
                  "credit.process_rewards = paper")
        check(math.isfinite(self.eta), "eta", f"must be a finite number, got {self.eta}")
        at_least("turn_on_bonus_global_step", self.turn_on_bonus_global_step, 0)


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
    """TP-GRPO: step rewards as its released code computes them (process_rewards released_code) or as its paper reads
    (paper).

    ``released_code``: the public code's process rewards over the SDE window (``released_process_rewards``), with
    ``R_0`` from the trajectory's own initial noise and the GRPO groups as the pools of its balancing; ``paper``:
    incremental rewards, and the aggregated R_T - R_t at turning points."""

    def positions(self, steps, num_steps):
        return set(range(num_steps + 1))

    def assign(self, batch, scores, context):
        if self.config.process_rewards == "paper":
            return super().assign(batch, scores, context)
        t = batch.rollout.transitions
        window = sorted({int(s) for s in t.step[t.stochastic]})
        first, end = window[0], window[-1] + 1  # the SDE window x_first -> .. -> x_end; the rest of the steps are ODE
        rewards, nfe = intermediate_rewards(batch, set(range(first, end)), scores, context, clean=self.config.clean,
                                            ode_steps=self.config.ode_steps)
        return normalized_step_credit(batch, context, self.released_values(rewards, first, end, batch, context), nfe)

    def released_values(self, rewards: Tensor, first: int, end: int, batch, context: CreditContext) -> Tensor:
        """Process rewards ``[B, T]`` of the window's transitions ``first .. end - 1`` (NaN elsewhere, and on a
        trajectory with an invalid reward). ``R_0`` is the reward of ``x_first`` completed (the ODE continuation of the
        trajectory's own initial noise), ``R_i`` of ``x_{first + i}``; the last, ``x_end``, completes to the final
        image, so ``R_n = R_T`` as in the released code."""
        final = rewards[:, -1]
        sequence = torch.cat([rewards[:, first:end], final[:, None]], dim=1)  # R_0 .. R_n
        options = {key: getattr(self.config, key) for key in RELEASED_OPTIONS}
        out = released_process_rewards(final, sequence[:, 0], sequence[:, 1:], global_step=context.iteration,
                                       pools=batch.sample_ids // context.config.data.group_size, **options)
        values = torch.full_like(rewards[:, 1:], math.nan)
        finite = torch.isfinite(sequence).all(dim=1, keepdim=True)
        values[:, first:end] = torch.where(finite, out["process_rewards"], torch.full_like(out["process_rewards"],
                                                                                           math.nan))
        return values

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
