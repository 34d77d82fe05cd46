"""Reward-gradient guidance as a guided sampler (``--guidance rgs``): the ODE with a correction along the reward's
gradient, ``scale(sigma)`` by ``bands`` (``SIGMA:SCALE``, highest sigma first, none below the last), over
``flowalign.samplers.rgs``. The gradient comes from register heads (``registers``) or from a differentiable image
reward of the decoded x0_hat (``reward``), through the velocity (``gradient: full``, one backward pass per guided
step) or on x0_hat alone (``x0``, free); ``gradient_guide`` builds it (Euphonium's sampler shares it)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from flowalign.settings import option

from .base import GradientSettings, GuidedProblem, GuidedSampler, check_process_reward, register_sampler

__all__ = ["RGSSettings", "RewardGradient", "gradient_guide"]


@dataclass
class RGSSettings(GradientSettings):
    registers: str | None = option(None, "register checkpoint (`flowalign prep registers`): RGS's gradient from "
                                   "register heads, instead of --rgs-reward")

    def validate(self) -> None:
        GradientSettings.validate(self)
        check_process_reward(self, "rgs")


@register_sampler("rgs", config=RGSSettings)
class RewardGradient(GuidedSampler):
    """Reward-gradient guidance on register heads or a differentiable image reward of x0_hat."""

    def requirements(self) -> frozenset[str]:
        return frozenset({"reward", "registers" if self.config.registers else "differentiable_reward"})

    def differentiable_reward(self):
        return self.config.differentiable_reward()

    def registers_checkpoint(self) -> str | None:
        return self.config.registers

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.rgs import reward_guided_sampling

        common = dict(final_reward=problem.reward, bands=self.config.band_pairs(), candidates=problem.candidates,
                      device=problem.device)
        with gradient_guide(problem, self.config.gradient, self.name) as (guide, heads, backward_nfe):
            return reward_guided_sampling(guide, problem.sigmas, problem.shape, problem.generators, problem.budget,
                                          head_weights=heads, backward_nfe=backward_nfe, **common)


@contextmanager
def gradient_guide(problem: GuidedProblem, gradient: str, method: str):
    """``(guide, head_weights, backward_nfe)`` for a sampler that follows a reward's gradient (RGS, Euphonium):
    ``guide(x, sigma, rows) -> (v, scores [n, H])`` on the differentiable image reward of x0_hat
    (``problem.guide_reward``; through the velocity with ``gradient = "full"``, one backward NFE per sample, two with
    CFG, or on x0_hat alone, none) or on register heads (``problem.registers``, attached to the transformer while
    the context is open; one backward NFE per head)."""
    from flowalign.samplers.rgs import x0_guide

    evals = problem.evals_per_sample
    if problem.guide_reward is not None:
        through = gradient == "full"
        guide = x0_guide(problem.velocity, problem.latent_reward(problem.guide_reward, differentiable=True),
                         through_velocity=through)
        # a backward pass through the velocity costs what its forward did: 2 NFEs per sample with CFG
        yield guide, [1.0], evals if through else 0
        return
    registers = problem.registers
    if registers is None:
        raise ValueError(f"guidance {method!r} needs a differentiable reward: pass registers= or guide_reward=")
    registers.attach(problem.model.transformer)
    try:
        yield registers.guide(problem.velocity), [1.0] * len(registers.head_names), evals
    finally:
        registers.detach()
