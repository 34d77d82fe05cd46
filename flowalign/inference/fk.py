"""Feynman-Kac steering as a guided sampler (``--guidance fk``; Singhal et al. 2025): SDE particles with potentials
``G_t = exp(lam * u_t)`` of the rewards of ``x0_hat`` (``potential``: max / add / diff / rt), over
``flowalign.samplers.fk``.

``resampling`` (``--fk-resampling``) picks which of the two FK resampling schemes runs: ``reference`` (the default) as
the paper's code runs it (post-step particles resampled on the schedule ``resample_start``, ``resample_every``,
``resample_end`` and at the last step, fixed or ``adaptive``, with the final ``Π`` correction), ``flowalign`` the
earlier variant (pre-step particles, adaptive, every step from ``resample_start`` but the last; kept because every FK
result in docs/results/guided_sampling.md was measured with it). Its old name ``semantics`` (``--fk-semantics``)
still works for one release with a ``DeprecationWarning``. With ``reward`` (a differentiable image reward) its
proposals are moved by RGS's x0_hat gradient (no extra NFE).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Literal

from flowalign.config import ConfigError
from flowalign.samplers.fk import POTENTIALS, RESAMPLING
from flowalign.settings import at_least, check, finite, option

from .base import GradientSettings, GuidedProblem, GuidedSampler, SDESettings, register_sampler

__all__ = ["FKSettings", "FKSteering"]


@dataclass
class FKSettings(SDESettings, GradientSettings):
    """FK steering's settings (module docstring)."""

    potential: Literal[POTENTIALS] = option("add", "FK potential")
    resampling: Literal[RESAMPLING] = option("reference", "FK's resampling scheme: as its reference code (reference: "
                                             "rewards of x0_hat, then the step, then the post-step particles "
                                             "resampled at the scheduled steps and the last one, with the final "
                                             "product-of-potentials correction) or flowalign's earlier variant "
                                             "(flowalign: pre-step particles, adaptive, every step from "
                                             "--fk-resample-start but the last)", flag="fk-resampling")
    semantics: Literal[RESAMPLING] | None = option(None, "deprecated: the old name of resampling (--fk-resampling); "
                                                   "it goes in the next release", flag="fk-semantics")
    adaptive: bool = option(False, "FK (reference resampling) resamples only when ESS < N/2 (default: at every "
                            "scheduled step; the last step always tests the ESS)", flag="fk-adaptive")
    resample_start: int = option(0, "first step at which FK scores x0_hat and may resample (the reference's "
                                 "resampling_t_start; with --fk-resampling flowalign, then every step but the last)",
                                 flag="fk-resample-start")
    resample_every: int = option(1, "FK (reference resampling): steps between scheduled resampling steps (the "
                                 "reference's resample_frequency)", flag="fk-resample-every")
    resample_end: int | None = option(None, "FK (reference resampling): the last scheduled resampling step before the "
                                      "final one, which always is (the reference's resampling_t_end; default: every "
                                      "step to the end)", flag="fk-resample-end")
    reward_min_value: float = option(0.0, "FK (reference resampling): the used reward a particle starts with (floors "
                                     "the max potential; the reference's reward_min_value)",
                                     flag="fk-reward-min-value")

    def __post_init__(self) -> None:
        """The deprecated ``semantics`` (``--fk-semantics``) sets ``resampling``, with a ``DeprecationWarning``."""
        if self.semantics is None:
            return
        if self.resampling not in (self.semantics, "reference"):
            raise ConfigError(f"semantics={self.semantics!r} is the old name of resampling, which says "
                              f"{self.resampling!r}: give only resampling (--fk-resampling)", key="semantics")
        warnings.warn("the FK setting semantics (--fk-semantics) is renamed resampling (--fk-resampling); the old name "
                      "goes in the next release", DeprecationWarning, stacklevel=3)
        self.resampling, self.semantics = self.semantics, None

    def validate(self) -> None:
        SDESettings.validate(self)
        GradientSettings.validate(self)
        at_least("resample_start", self.resample_start, 0)
        at_least("resample_every", self.resample_every, 1)
        at_least("resample_end", self.resample_end, 0)
        finite("reward_min_value", self.reward_min_value, -math.inf)
        if self.reward is not None and self.gradient != "x0":
            raise ConfigError("FK's RGS-guided proposals take the gradient on x0_hat only (no extra NFE): pass "
                              "--rgs-gradient x0 with --guidance fk --rgs-reward", key="gradient")
        if self.resampling == "flowalign":
            for key, flag, default in (("resample_every", "--fk-resample-every", 1),
                                       ("resample_end", "--fk-resample-end", None),
                                       ("reward_min_value", "--fk-reward-min-value", 0.0)):
                check(getattr(self, key) == default, key,
                      f"({flag}) applies to --fk-resampling reference only, got {getattr(self, key)!r} "
                      "with --fk-resampling flowalign (which checks every step from --fk-resample-start but the last)")
        if self.resample_end is not None:
            check(self.resample_end >= self.resample_start, "resample_end",
                  f"(--fk-resample-end) must be >= resample_start ({self.resample_start}), got {self.resample_end}")


@register_sampler("fk", config=FKSettings)
class FKSteering(GuidedSampler):
    """Feynman-Kac steering: SDE particles resampled by reward potentials (RGS-guided proposals with --rgs-reward)."""

    def requirements(self) -> frozenset[str]:
        return frozenset({"reward", "differentiable_reward"} if self.config.reward else {"reward"})

    def differentiable_reward(self):
        return self.config.differentiable_reward()

    def check(self, config) -> None:
        start, steps = self.config.resample_start, config.steps
        if not (isinstance(start, int) and 0 <= start < steps - 1):
            raise ConfigError(f"fk_resample_start must be a step in 0..{steps - 2} (sampler.resample_start: FK "
                              f"scores x0_hat from that step on; the last step is always checked with --fk-resampling "
                              f"reference, never with flowalign), got {start!r}", key="sampler.resample_start")
        end = self.config.resample_end
        if end is not None and end > steps - 1:
            raise ConfigError(f"fk_resample_end must be a step in {start}..{steps - 1} (sampler.resample_end), got "
                              f"{end!r}", key="sampler.resample_end")

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.fk import fk_steering, fk_steering_reference
        from flowalign.samplers.rgs import x0_gradient_correction

        settings = self.config
        corrector = None
        if problem.guide_reward is not None:  # RGS-guided proposals
            guide = problem.latent_reward(problem.guide_reward, differentiable=True)
            corrector = x0_gradient_correction(guide, settings.band_pairs())
        common = dict(potential_kind=settings.potential, lam=settings.lam, noise_level=settings.noise_level,
                      corrector=corrector, candidates=problem.candidates, device=problem.device)
        if settings.resampling == "flowalign":
            return fk_steering(problem.velocity, problem.reward, problem.sigmas, problem.shape, problem.generators,
                               problem.budget, resample_steps=range(settings.resample_start, problem.config.steps - 1),
                               **common)
        return fk_steering_reference(problem.velocity, problem.reward, problem.sigmas, problem.shape,
                                     problem.generators, problem.budget, resample_start=settings.resample_start,
                                     resample_every=settings.resample_every, resample_end=settings.resample_end,
                                     adaptive=settings.adaptive, reward_min_value=settings.reward_min_value, **common)
