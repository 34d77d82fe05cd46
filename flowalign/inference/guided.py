"""The built-in guided samplers: ``none`` (one ODE sample), ``bon`` (best-of-N), ``fk`` (Feynman-Kac steering), ``dts``
(DTS*, greedy tree search, or DTS with ``soft``) and ``rgs`` (reward-gradient guidance), each a ``GuidedSampler``
over the numerics of ``flowalign.samplers`` with its settings.

* best-of-N: ``N = budget // T`` ODE trajectories of ``T`` NFEs per prompt, the one of highest reward kept.
* FK steering (Singhal et al. 2025): SDE particles with potentials ``G_t = exp(lam * u_t)`` of the rewards of
  ``x0_hat`` (``potential``: max / add / diff / rt); ``semantics: reference`` (the default) as the paper's code runs it
  (post-step particles resampled on the schedule ``resample_start``, ``resample_every``, ``resample_end`` and at the
  last step, fixed or ``adaptive``, with the final ``Π`` correction), ``semantics: flowalign`` the earlier variant
  (pre-step particles, adaptive, every step from ``resample_start`` but the last); with ``reward`` (a differentiable
  image reward) its proposals are moved by RGS's x0_hat gradient (no extra NFE).
* DTS* / DTS (Jain et al. 2025, "Diffusion Tree Sampling"): a tree of SDE states, ``max_children`` per node, values
  backed up as soft maxima at inverse temperature ``lam``; greedy (DTS*) or Boltzmann (DTS, ``soft``) selection.
* RGS: the ODE with a correction along the reward's gradient, ``scale(sigma)`` by ``bands`` (``SIGMA:SCALE``, highest
  sigma first, none below the last); the gradient from register heads (``registers``) or from a differentiable image
  reward of the decoded x0_hat (``reward``), through the velocity (``gradient: full``, one backward pass per guided
  step) or on x0_hat alone (``x0``, free).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from flowalign.components import ComponentConfig
from flowalign.config import ConfigError
from flowalign.samplers.fk import POTENTIALS, SEMANTICS
from flowalign.samplers.rgs import DEFAULT_BANDS
from flowalign.settings import at_least, check, finite, option, parse_json_object, parse_sigma_band

from . import GuidedProblem, GuidedSampler, register_sampler

__all__ = ["BestOfN", "DiffusionTreeSearch", "EuphoniumGuided", "EuphoniumSettings", "FKSteering", "GradientSettings",
           "GradientSource", "OneSample", "RewardGradient", "SDESettings", "check_process_reward", "gradient_guide"]

_DEFAULT_BANDS = [list(band) for band in DEFAULT_BANDS]
# Where RGS's gradient on a differentiable image reward is taken: through the velocity (one backward NFE per guided
# step, two with CFG) or on x0_hat alone (free); see samplers.rgs.x0_guide.
RGS_GRADIENTS = ("full", "x0")


@dataclass
class SDESettings(ComponentConfig):
    """What the samplers of SDE particles share (FK, DTS)."""

    noise_level: float = option(0.7, "SDE noise level of FK particles and tree search")
    lam: float = option(10.0, "FK / DTS inverse temperature")

    def validate(self) -> None:
        if not self.noise_level > 0:
            raise ConfigError(f"guidance {self.name!r} needs noise_level > 0 (SDE particles), got {self.noise_level}",
                              key="noise_level")
        finite("noise_level", self.noise_level, 0)
        finite("lam", self.lam, 0)


@dataclass
class GradientSource(ComponentConfig):
    """A differentiable image reward of the decoded x0_hat as a gradient source (RGS, FK's proposals, Euphonium)."""

    reward: str | None = option(None, "differentiable image reward for RGS's gradient on the decoded x0_hat "
                                "(toy_geneval_soft, pickscore, hps, clipscore, aesthetic, imagereward)",
                                flag="rgs-reward")
    reward_kwargs: dict[str, Any] = option({}, "--rgs-reward's constructor arguments as a JSON object, e.g. local "
                                           "weights: '{\"model\": \"/w/PickScore_v1\", \"device\": \"cuda\"}'",
                                           flag="rgs-reward-kwargs", parse=parse_json_object, metavar="JSON")
    gradient: Literal[RGS_GRADIENTS] = option("full", "--rgs-reward's gradient: through the velocity (full, one "
                                             "backward NFE per guided step) or on x0_hat alone (x0, no extra NFE)",
                                             flag="rgs-gradient")

    def validate(self) -> None:
        if self.reward_kwargs and self.reward is None:
            raise ConfigError("--rgs-reward-kwargs are the constructor arguments of --rgs-reward: pass --rgs-reward "
                              "NAME too", key="reward_kwargs")

    def differentiable_reward(self) -> tuple[str, dict] | None:
        return None if self.reward is None else (self.reward, dict(self.reward_kwargs))


@dataclass
class GradientSettings(GradientSource):
    """A gradient source applied in sigma bands (RGS, FK's proposals)."""

    bands: list[list[float]] = option(_DEFAULT_BANDS, "RGS correction scale above each sigma, highest first (no "
                                      "gradient below the last)", flag="rgs-bands", parse=parse_sigma_band,
                                      metavar="SIGMA:SCALE")

    def validate(self) -> None:
        from flowalign.samplers.rgs import check_bands

        GradientSource.validate(self)
        try:
            check_bands(self.bands)
        except ValueError as error:
            raise ConfigError(str(error), key="bands") from None

    def band_pairs(self) -> list[tuple[float, float]]:
        return [(float(sigma), float(scale)) for sigma, scale in self.bands]


def check_process_reward(settings, method: str) -> None:
    """ConfigError unless ``settings`` name exactly one gradient source, register heads (``registers``) or a
    differentiable image reward (``reward``), and a ``gradient`` mode that applies to it."""
    if settings.registers is None and settings.reward is None:
        raise ConfigError(
            f"guidance {method!r} needs a differentiable reward, and the image reward that scores samples has no "
            "gradient: pass --registers CKPT (trained with `flowalign registers train`), or --rgs-reward NAME "
            "with a differentiable image reward (toy_geneval_soft, pickscore, hps, clipscore, aesthetic, "
            "imagereward), or use --guidance bon|fk|dts", key="registers")
    if settings.registers is not None and settings.reward is not None:
        raise ConfigError(f"pass either --registers or --rgs-reward as {method}'s gradient source, not both",
                          key="reward")
    check(settings.gradient == "full" or settings.reward is not None, "gradient",
          f"{settings.gradient!r} (--rgs-gradient) applies to --rgs-reward only (register heads read x_t itself, so "
          "their gradient always runs through the transformer)")


@dataclass
class NoSettings(ComponentConfig):
    """A sampler without settings of its own."""


@register_sampler("none", config=NoSettings)
class OneSample(GuidedSampler):
    """One ODE sample per prompt (``K`` with ``--candidates K``): the budget is what it costs."""

    uses_budget = False

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.guided import best_of_n

        k = problem.candidates  # a set of K plain samples: K trajectories, none chosen over another
        budget = k * problem.config.steps * problem.evals_per_sample
        return best_of_n(problem.velocity, problem.reward, problem.sigmas, problem.shape, problem.generators, budget,
                         candidates=k, device=problem.device)


@register_sampler("bon", config=NoSettings)
class BestOfN(GuidedSampler):
    """Best-of-N: N = budget // T ODE samples per prompt, the best by the reward kept."""

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.guided import best_of_n

        return best_of_n(problem.velocity, problem.reward, problem.sigmas, problem.shape, problem.generators,
                         problem.budget, candidates=problem.candidates, device=problem.device)


@dataclass
class FKSettings(SDESettings, GradientSettings):
    potential: Literal[POTENTIALS] = option("add", "FK potential")
    semantics: Literal[SEMANTICS] = option("reference", "FK's resampling: as its reference code (reference: rewards "
                                           "of x0_hat, then the step, then the post-step particles resampled at the "
                                           "scheduled steps and the last one, with the final product-of-potentials "
                                           "correction) or flowalign's earlier variant (flowalign: pre-step "
                                           "particles, adaptive, every step from --fk-resample-start but the last)",
                                           flag="fk-semantics")
    adaptive: bool = option(False, "FK (reference semantics) resamples only when ESS < N/2 (default: at every "
                            "scheduled step; the last step always tests the ESS)", flag="fk-adaptive")
    resample_start: int = option(0, "first step at which FK scores x0_hat and may resample (the reference's "
                                 "resampling_t_start; with --fk-semantics flowalign, then every step but the last)",
                                 flag="fk-resample-start")
    resample_every: int = option(1, "FK (reference semantics): steps between scheduled resampling steps (the "
                                 "reference's resample_frequency)", flag="fk-resample-every")
    resample_end: int | None = option(None, "FK (reference semantics): the last scheduled resampling step before the "
                                      "final one, which always is (the reference's resampling_t_end; default: every "
                                      "step to the end)", flag="fk-resample-end")
    reward_min_value: float = option(0.0, "FK (reference semantics): the used reward a particle starts with (floors "
                                     "the max potential; the reference's reward_min_value)",
                                     flag="fk-reward-min-value")

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
        if self.semantics == "flowalign":
            for key, flag, default in (("resample_every", "--fk-resample-every", 1),
                                       ("resample_end", "--fk-resample-end", None),
                                       ("reward_min_value", "--fk-reward-min-value", 0.0)):
                check(getattr(self, key) == default, key,
                      f"({flag}) applies to --fk-semantics reference only, got {getattr(self, key)!r} with "
                      "--fk-semantics flowalign (which checks every step from --fk-resample-start but the last)")
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
                              f"scores x0_hat from that step on; the last step is always checked with --fk-semantics "
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
        if settings.semantics == "flowalign":
            return fk_steering(problem.velocity, problem.reward, problem.sigmas, problem.shape, problem.generators,
                               problem.budget, resample_steps=range(settings.resample_start, problem.config.steps - 1),
                               **common)
        return fk_steering_reference(problem.velocity, problem.reward, problem.sigmas, problem.shape,
                                     problem.generators, problem.budget, resample_start=settings.resample_start,
                                     resample_every=settings.resample_every, resample_end=settings.resample_end,
                                     adaptive=settings.adaptive, reward_min_value=settings.reward_min_value, **common)


@dataclass
class DTSSettings(SDESettings):
    max_children: int = option(3, "DTS children per node")
    soft: bool = option(False, "DTS (Boltzmann selection) instead of DTS* (greedy)", flag="dts-soft")

    def validate(self) -> None:
        super().validate()
        at_least("max_children", self.max_children, 2)


@register_sampler("dts", config=DTSSettings)
class DiffusionTreeSearch(GuidedSampler):
    """Diffusion tree search: DTS* (greedy) or DTS (soft, Boltzmann selection)."""

    trajectories_per_candidate = None  # leaves share their prefixes: K leaves can cost less than K trajectories

    def sample(self, problem: GuidedProblem):
        from flowalign.samplers.dts import diffusion_tree_search

        settings = self.config
        return diffusion_tree_search(problem.velocity, problem.reward, problem.sigmas, problem.shape,
                                     problem.generators, problem.budget, greedy=not settings.soft, lam=settings.lam,
                                     max_children=settings.max_children, noise_level=settings.noise_level,
                                     candidates=problem.candidates, device=problem.device)


@dataclass
class RGSSettings(GradientSettings):
    registers: str | None = option(None, "register checkpoint (`flowalign registers train`): RGS's gradient from "
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


@dataclass
class EuphoniumSettings(GradientSource):
    """Euphonium-guided sampling (``flowalign.samplers.euphonium``): the released script's SDE (``dance``, eta 0.25)
    and step-scaled guidance; the shift normalised per sample (the released raw-gradient scale 0.01 moves a toy
    latent by ~1e-4), on the second half of the steps at scale 30, both chosen on the toy world by a sweep over 66
    held-out samples (``docs/methods/euphonium.md``); the released script guides the last quarter."""

    registers: str | None = option(None, "register checkpoint (`flowalign registers train`): the process reward from "
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


# SatisDive lives in its own module (its settings extend GradientSource); importing it registers it.
from flowalign.inference import satisdive as _satisdive  # noqa: E402,F401
