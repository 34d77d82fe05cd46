"""Best-of-N as a guided sampler (``--guidance bon``), and ``none``, one plain ODE sample per prompt: both over
``flowalign.samplers.guided.best_of_n`` (``N = budget // T`` ODE trajectories of ``T`` NFEs per prompt, the one of
highest reward kept, or the ``K`` best with ``--candidates K``)."""

from __future__ import annotations

from .base import GuidedProblem, GuidedSampler, NoSettings, register_sampler

__all__ = ["BestOfN", "OneSample"]


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
