"""Diffusion tree search as a guided sampler (``--guidance dts``; Jain et al. 2025, "Diffusion Tree Sampling"): a
tree of SDE states, ``max_children`` per node, values backed up as soft maxima at inverse temperature ``lam``; greedy
(DTS*) or Boltzmann (DTS, ``soft``) selection, over ``flowalign.samplers.dts``."""

from __future__ import annotations

from dataclasses import dataclass

from flowalign.settings import at_least, option

from .base import GuidedProblem, GuidedSampler, SDESettings, register_sampler

__all__ = ["DTSSettings", "DiffusionTreeSearch"]


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
