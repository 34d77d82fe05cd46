"""The ``vgpo`` credit estimator: VGPO's value-anchored advantages from instant rewards (Shao et al., arXiv:2512.12387;
a reconstruction, see ``flowalign.credit.value_anchored`` for the math and docs/methods/vgpo.md).

Instant rewards (Eq. 9 as reconstructed): transition ``i`` (``x_i -> x_{i+1}``) gets the weighted raw reward
(``context.state_reward``) of the decoded one-step clean estimate of the state it lands on,
``x0_hat(x_{i+1}) = x_{i+1} - s_{i+1} v(x_{i+1}, s_{i+1})``; the last transition gets the terminal reward already
computed. The velocity at ``x_{i+1}`` is the one the rollout's next step evaluates anyway, so with
``x0_pass = rollout`` a rollout hook (``CleanEstimateReader``) keeps ``x0_hat`` of every pass and credit spends no NFE;
``x0_pass = recompute`` evaluates it again after the rollout (``IntermediateScorer`` with the one-step estimate,
``T - 1`` NFEs per sample, the same values while nothing changed the policy in between). Either way it costs ``T - 1``
extra decodes and reward calls per image (counted in ``vgpo/decodes`` and ``vgpo/reward_calls``).

Each GRPO group's instant rewards go through ``value_anchored_advantages`` (trajectories with an invalid reward are
left out of their group and get weight 0); the advantages are clipped to ``advantage.clip`` like every step credit's.
Both variants are computed every iteration, so the run logs which one keeps a signal: ``vgpo/signal_frac/<variant>``
is the fraction of groups with a non-zero advantage on a trained transition, and ``vgpo/converged_signal_frac/
<variant>`` the same among the groups whose terminal rewards agree (those Flow-GRPO counts in ``zero_std_frac``).

Rewards must be >= 0 (``omega = Q / mean Q``): a negative weight or a reward known to score below 0 is refused when
the config is checked, and a negative instant reward met during training is an error naming the reward settings.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.credit.base import BatchScores, Credit, CreditContext, register_credit, trained_mask
from flowalign.credit.step_credit import StepRewardCredit, intermediate_rewards
from flowalign.credit.value_anchored import VARIANTS, value_anchored_advantages
from flowalign.advantages import ZERO_STD
from flowalign.rollout import RolloutHook
from flowalign.rewards import negative_scores_reason
from flowalign.samplers import predict_x0
from flowalign.settings import at_least, check, finite, option

__all__ = ["CleanEstimateReader", "VGPOConfig", "VGPOCredit"]


@dataclass
class VGPOConfig(ComponentConfig):
    gamma: float = option(0.9, "discount of the instant rewards in the values Q_i = R_i + gamma Q_{i+1} (the paper's "
                               "value is not confirmed)")
    k: float = option(0.5, "scale of the absolute value term on the first alpha_steps transitions (alpha_i = k std_i "
                           "in the reconstruction, k in std_free; the paper's value is not confirmed)")
    alpha_steps: int = option(5, "how many transitions from the start carry the absolute term (the paper: the first 5)")
    eps: float = option(1e-4, "added to the per-step group std of the values")
    std_unbiased: bool = option(False, "per-step group std with G - 1 (true) or G (false, as Flow-GRPO's advantages)")
    variant: Literal["reconstruction", "std_free"] = option(
        "reconstruction", "reconstruction = A = omega ((Q - mu) + k std Q) / (std + eps), which is 0 where the "
        "group's values agree; std_free = A = omega ((Q - mu) / (std + eps) + k Q), which keeps the absolute term")
    x0_pass: Literal["rollout", "recompute"] = option(
        "rollout", "rollout = keep x0_hat of every rollout pass (no extra NFE); recompute = evaluate the velocity of "
        "each intermediate state again after the rollout (T - 1 NFEs per sample)")

    def validate(self) -> None:
        finite("gamma", self.gamma, 0.0, high=1.0)
        finite("k", self.k, 0.0)
        at_least("alpha_steps", self.alpha_steps, 0)
        finite("eps", self.eps, 0.0, strict=True)


class CleanEstimateReader(RolloutHook):
    """Keeps ``x0_hat = x - s v`` of every pass of a chain rollout (``[T, B, ...]``, pass ``k`` reads ``x_k``)."""

    name = "x0_hat"

    @contextmanager
    def watch(self, velocity):
        estimates: list[Tensor] = []

        def reading(x: Tensor, sigma: Tensor) -> Tensor:
            v = velocity(x, sigma)
            estimates.append(predict_x0(x, v, sigma).to(x.dtype))
            return v

        reading.evals_per_sample = getattr(velocity, "evals_per_sample", 1)
        yield reading, lambda: torch.stack(estimates)


@register_credit("vgpo", config=VGPOConfig)
class VGPOCredit(StepRewardCredit):
    """VGPO: value-anchored advantages from the rewards of each next state's one-step x0_hat."""

    def __init__(self, config=None):
        super().__init__(config)
        self._iteration: int | None = None
        self._totals: dict[str, float] = {}

    def check(self, config) -> None:
        super().check(config)
        for i, spec in enumerate(config.reward.rewards):
            check(spec.weight >= 0, f"reward.rewards[{i}].weight",
                  f"= {spec.weight:g} is negative: credit.name = 'vgpo' needs rewards >= 0 (omega = Q / mean Q); give "
                  "it a weight >= 0 or use another credit.name")
            negative = negative_scores_reason(spec.name)
            check(negative is None, f"reward.rewards[{i}].name",
                  f"= {spec.name!r} can score below 0 ({negative}): credit.name = 'vgpo' needs "
                  "rewards >= 0 (omega = Q / mean Q); use a reward bounded below by 0 (toy_geneval, geneval, "
                  "pickscore, hps, brightness) or another credit.name")

    def rollout_hooks(self) -> list:
        return [CleanEstimateReader()] if self.config.x0_pass == "rollout" else []

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        rewards, nfe = self.instant_rewards(batch, scores, context)
        config = context.config
        t = batch.rollout.transitions
        groups = batch.sample_ids // config.data.group_size
        trained_steps = torch.zeros(rewards.shape[1], dtype=torch.bool)
        trained_steps[torch.tensor([s for s in context.steps if s < rewards.shape[1]], dtype=torch.long)] = True
        settings = self.config
        options = dict(gamma=settings.gamma, k=settings.k, alpha_steps=settings.alpha_steps, eps=settings.eps,
                       std_unbiased=settings.std_unbiased)
        clip = config.advantage.clip
        advantages = torch.zeros_like(rewards)
        valid_rows = torch.isfinite(rewards).all(dim=1)
        totals = {"groups": 0.0, "converged": 0.0, "degenerate_steps": 0.0, "group_steps": 0.0,
                  "relative_abs": 0.0, "relative_count": 0.0}
        for variant in VARIANTS:
            totals[f"signal/{variant}"] = totals[f"converged_signal/{variant}"] = 0.0
        for group in groups.unique().tolist():
            rows = torch.nonzero((groups == group) & valid_rows).flatten()
            totals["groups"] += 1
            if len(rows) == 0:
                continue
            terminal = rewards[rows, -1]
            converged = len(rows) < 2 or float(terminal.std(unbiased=False)) < ZERO_STD
            totals["converged"] += converged
            for variant in VARIANTS:
                out = value_anchored_advantages(rewards[rows], variant=variant, **options)
                clipped = out["advantages"].clamp(-clip, clip)
                signal = bool((clipped[:, trained_steps] != 0).any())
                totals[f"signal/{variant}"] += signal
                totals[f"converged_signal/{variant}"] += signal and converged
                if variant == settings.variant:
                    advantages[rows] = clipped
                    totals["degenerate_steps"] += float((out["std"][trained_steps] == 0).sum())
                    totals["group_steps"] += float(trained_steps.sum())
                    totals["relative_abs"] += float(out["relative"][:, trained_steps].abs().sum())
                    totals["relative_count"] += float(len(rows) * trained_steps.sum())
        per_transition = advantages.to(t.step.device)[t.sample_id, t.step]  # chain transitions are (step, row) pairs
        weights = (valid_rows.to(t.step.device)[t.sample_id] & trained_mask(t, context.steps)).float()
        extra = len(batch.sample_ids) * (rewards.shape[1] - 1)
        totals["decodes"] = totals["reward_calls"] = float(extra)
        return Credit((per_transition * weights).float(), weights, nfe, self._stats(context.iteration, totals))

    def _stats(self, iteration: int, totals: dict[str, float]) -> dict[str, float]:
        """The iteration's stats so far (the trainer keeps the last chunk's): sums over its chunks, then ratios."""
        if iteration != self._iteration:
            self._iteration, self._totals = iteration, {}
        for key, value in totals.items():
            self._totals[key] = self._totals.get(key, 0.0) + value
        s = self._totals
        ratio = lambda a, b: s[a] / s[b] if s[b] else math.nan  # noqa: E731
        stats = {"vgpo/decodes": s["decodes"], "vgpo/reward_calls": s["reward_calls"],
                 "vgpo/converged_groups": s["converged"],
                 "vgpo/degenerate_step_frac": ratio("degenerate_steps", "group_steps"),
                 "vgpo/relative_abs_mean": ratio("relative_abs", "relative_count")}
        for variant in VARIANTS:
            stats[f"vgpo/signal_frac/{variant}"] = ratio(f"signal/{variant}", "groups")
            stats[f"vgpo/converged_signal_frac/{variant}"] = ratio(f"converged_signal/{variant}", "converged")
        return stats

    @torch.no_grad()
    def instant_rewards(self, batch, scores: BatchScores, context: CreditContext) -> tuple[Tensor, int]:
        """``R [B, T]`` (float64, NaN where invalid): transition ``i``'s reward of ``x0_hat(x_{i+1})``, the last the
        terminal reward; and the NFEs spent (0 when the rollout kept ``x0_hat``)."""
        config, model = context.config, context.model
        num_steps, size = config.sampling.num_steps, len(batch.sample_ids)
        estimates = batch.extras.get(CleanEstimateReader.name)
        if estimates is None:
            full, nfe = intermediate_rewards(batch, set(range(1, num_steps)), scores, context, clean="x0")
            rewards = full[:, 1:]
        else:
            rewards, nfe = torch.full((size, num_steps), math.nan, dtype=torch.float64), 0
            combined = scores.combined.double()
            rewards[:, -1] = torch.where(scores.valid, combined, torch.full_like(combined, math.nan))
            groups = batch.sample_ids // config.data.group_size
            with context.autocast():
                for k in range(1, num_steps):
                    images = model.decode(estimates[k])
                    rewards[:, k - 1] = context.state_reward(images, batch.sample_metadata, groups)
        finite_rewards = rewards[torch.isfinite(rewards)]
        if finite_rewards.numel() and bool((finite_rewards < 0).any()):
            names = ", ".join(spec.name for spec in config.reward.rewards)
            raise ValueError(
                f"credit.name = 'vgpo' needs rewards >= 0 (omega = Q / mean Q), but reward.rewards ({names}) scored "
                f"{float(finite_rewards.min()):g} on an instant x0_hat estimate: use a reward bounded below by 0 or "
                "another credit.name")
        return rewards, nfe
