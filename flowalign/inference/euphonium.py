"""Euphonium-guided sampling as a guided sampler (``--guidance euphonium``; Zhong et al. 2026): the
process-reward-gradient-guided SDE of ``flowalign.samplers.euphonium``, its gradient built as RGS's
(``gradient_guide``: register heads or a differentiable image reward of x0_hat)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flowalign.settings import check, finite, option

from .base import GradientSource, GuidedProblem, check_process_reward, register_sampler
from .rgs import RewardGradient, gradient_guide

__all__ = ["EuphoniumGuided", "EuphoniumSettings"]


@dataclass
class EuphoniumSettings(GradientSource):
    """Euphonium-guided sampling (``flowalign.samplers.euphonium``): the released script's SDE (``dance``, eta 0.25)
    and step-scaled guidance; the shift normalised per sample (the released raw-gradient scale 0.01 moves a toy
    latent by ~1e-4), on the second half of the steps at scale 30, both chosen on the toy world by a sweep over 66
    held-out samples (``docs/methods/euphonium.md``); the released script guides the last quarter."""

    registers: str | None = option(None, "register checkpoint (`flowalign prep registers`): the process reward from "
                                   "register heads, instead of --rgs-reward")
    scale: float = option(30.0, "Euphonium guidance scale c (a shift of norm c (s - s') per guided step; "
                          "with --euphonium-raw, c (s - s') times the gradient)", flag="euphonium-scale")
    normalize: bool = option(True, "the process-reward gradient divided by its norm per sample (--euphonium-raw: "
                             "the raw gradient, the released default)", flag="euphonium-raw", flag_value=False)
    start: float = option(0.5, "fraction of the steps after which guidance starts (the released script: 0.75, its "
                          "12 of 16 steps)", flag="euphonium-start")
    sde_noise: float = option(0.25, "the dance SDE's eta (the released 0.25)", flag="euphonium-noise")

    def validate(self) -> None:
        GradientSource.validate(self)
        check_process_reward(self, "euphonium")
        finite("scale", self.scale, 0)
        finite("start", self.start, 0.0, high=1.0)
        finite("sde_noise", self.sde_noise, 0.0, strict=True)
        check(self.start < 1.0, "start", f"must be < 1 (guidance on the steps after that fraction), got {self.start}")

    def first_step(self, steps: int) -> int:
        """The first guided step of ``steps``: ``floor(start * steps)``, at most the last step."""
        return min(int(math.floor(self.start * steps)), steps - 1)


@register_sampler("euphonium", config=EuphoniumSettings)
class EuphoniumGuided(RewardGradient):
    """Euphonium's process-reward-gradient-guided SDE (K trajectories per budget, the best kept)."""

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.euphonium import euphonium_sampling

        settings = self.config
        with gradient_guide(problem, settings.gradient, self.name) as (guide, heads, backward_nfe):
            return euphonium_sampling(guide, problem.sigmas, problem.shape, problem.generators, problem.budget,
                                      final_reward=problem.reward, start=settings.first_step(problem.config.steps),
                                      scale=settings.scale, normalize=settings.normalize, scale_by_dt=True,
                                      head_weights=heads, noise_level=settings.sde_noise, kind="dance",
                                      backward_nfe=backward_nfe, candidates=problem.candidates,
                                      device=problem.device)
