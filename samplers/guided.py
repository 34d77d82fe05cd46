"""Inference-time reward-guided sampling: the shared contract, NFE budgets, and best-of-N (the baseline).

Every guided sampler here draws samples for ``B`` prompts at once and spends at most ``budget`` NFEs *per prompt*.
One NFE is one transformer pass over one sample (``evals_per_sample`` of them with CFG, as in
``samplers.rollout.count_nfe``); RGS also counts each backward pass through the transformer as ``backward_nfe``
NFEs. The NFEs a sampler reports are the ones it spent, counted call by call, never a formula.

Callables (samplers never import models or reward models, docs/contributing/architecture.md#layers):

* ``velocity(x, sigma, rows) -> v``: ``rows[i]`` is the prompt (``0..B-1``) of row ``i`` of ``x``;
* ``reward(x0, rows) -> [n]``: a score of clean latents ``x0`` (a final sample or a one-step estimate
  ``x0_hat = x - s v``) for prompts ``rows``. Higher is better.

Noise. ``generators`` holds one ``torch.Generator`` per prompt; every draw for prompt ``b`` (its particles' initial
noise, SDE noise, resampling, tree selection) comes from ``generators[b]``, so a prompt's result does not depend on
which other prompts share its batch.

Methods, each in its own module: ``best_of_n`` (here), ``fk_steering`` (fk.py), ``diffusion_tree_search``
(dts.py), ``reward_guided_sampling`` (rgs.py). ``flowalign.inference`` registers them as guided samplers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from .rollout import count_nfe
from .sde import check_kind, check_noise_level, check_sigmas, ode_step, sde_step, standard_normal

__all__ = [
    "BudgetTooSmall",
    "GuidedResult",
    "best_of_n",
    "check_budget",
    "check_candidates",
    "group_argmax",
    "group_topk",
    "keep_candidates",
    "trajectory_nfe",
]

GuidedVelocity = Callable[[Tensor, Tensor, Tensor], Tensor]
LatentReward = Callable[[Tensor, Tensor], Tensor]


@dataclass
class GuidedResult:
    """The chosen sample per prompt: ``final [B, ...]`` latents, ``reward [B]`` (float64; the reward that chose it,
    NaN when none was given), ``nfe [B]`` NFEs spent per prompt, and method details in ``info``. A sampler that
    returns a set of ``k`` samples per prompt gives ``final [B, k, ...]`` and ``reward [B, k]``."""

    final: Tensor
    reward: Tensor
    nfe: Tensor
    info: dict = field(default_factory=dict)

    @property
    def images_per_prompt(self) -> int:
        """1, or ``k`` for a set per prompt."""
        return 1 if self.reward.dim() == 1 else int(self.reward.shape[1])


def trajectory_nfe(velocity: GuidedVelocity, num_steps: int) -> int:
    """NFEs of one plain trajectory: one call per step, ``evals_per_sample`` each."""
    return num_steps * count_nfe(velocity, 1)


class BudgetTooSmall(ValueError):
    """The NFE budget cannot pay for one trajectory of the method."""


def check_budget(budget: int, per_trajectory: int, method: str) -> int:
    """``budget`` as an int, or a ``BudgetTooSmall`` (a ValueError) when it cannot pay for one trajectory of
    ``method``."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(f"budget must be an integer number of NFEs per prompt, got {budget!r}")
    if budget < per_trajectory:
        raise BudgetTooSmall(
            f"budget={budget} NFEs per prompt is smaller than one {method} trajectory ({per_trajectory} NFEs): "
            f"raise the budget to at least {per_trajectory} or sample with fewer steps"
        )
    return budget


def check_sampling(sigmas: Tensor, kind: str, noise_level: float, generators: Sequence) -> Tensor:
    sigmas = check_sigmas(sigmas)
    check_kind(kind)
    check_noise_level(noise_level, kind)
    if not isinstance(generators, (list, tuple)) or not generators:
        raise ValueError("generators must be a non-empty list with one torch.Generator per prompt")
    return sigmas


def step(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, *, kind: str, noise_level: float,
         generators: Sequence[torch.Generator], rows: Tensor) -> Tensor:
    """One sampler step: SDE of ``kind`` when ``noise_level > 0`` (noise of row ``i`` from ``generators[rows[i]]``),
    else the Euler ODE step."""
    if noise_level > 0:
        noise = standard_normal(x.shape, generators, x.device, owner=rows)
        return sde_step(x, v, sigma, sigma_next, kind=kind, noise_level=noise_level, noise=noise).prev_sample
    return ode_step(x, v, sigma, sigma_next)


def initial_noise(shape: Sequence[int], generators: Sequence[torch.Generator], rows: Tensor, device) -> Tensor:
    """N(0, 1) latents ``[len(rows), *shape]``, row ``i`` drawn from ``generators[rows[i]]``."""
    return standard_normal((rows.numel(), *shape), generators, torch.device(device), owner=rows)


def group_argmax(values: Tensor, groups: int, size: int) -> Tensor:
    """Row index of the largest value in each of ``groups`` consecutive groups of ``size`` rows (first on ties;
    NaN never wins)."""
    values = torch.nan_to_num(values.double().reshape(groups, size), nan=-torch.inf)
    return torch.arange(groups, device=values.device) * size + values.argmax(dim=1)


def group_topk(values: Tensor, groups: int, size: int, k: int) -> Tensor:
    """Row indices ``[groups, k]`` of the ``k`` largest values in each of ``groups`` consecutive groups of ``size``
    rows, best first (first index on ties; NaN never wins over a number). ``k = 1`` gives ``group_argmax`` as a
    column."""
    if not 1 <= k <= size:
        raise ValueError(f"cannot keep {k} of {size} rows per group")
    values = torch.nan_to_num(values.double().reshape(groups, size), nan=-torch.inf)
    # a stable descending sort keeps the first of tied rows first, as argmax does
    order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.arange(groups, device=values.device)[:, None] * size + order


def check_candidates(candidates: int, available: int, method: str, unit: str, cost: int | None = None) -> int:
    """``candidates`` as an int, or a ValueError naming ``--candidates`` when ``method`` has fewer than that many
    ``unit`` per prompt within its budget (``available``); ``cost``, the NFEs of one unit when each candidate needs
    its own, names the budget that would do."""
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ValueError(f"--candidates must be an integer >= 1, got {candidates!r}")
    if candidates > available:
        need = "raise --budget" if cost is None else f"raise --budget to at least {candidates * cost}"
        raise ValueError(f"--candidates {candidates}: {method} has {available} {unit} per prompt within its budget; "
                         f"{need} or lower --candidates")
    return candidates


def keep_candidates(x: Tensor, scores: Tensor, prompts: int, size: int, candidates: int) -> tuple[Tensor, Tensor]:
    """Each prompt's best row (``final [B, ...]``, ``reward [B]``) when ``candidates`` is 1, else its ``candidates``
    best rows, best first (``final [B, K, ...]``, ``reward [B, K]``), of ``size`` rows per prompt."""
    if candidates == 1:
        pick = group_argmax(scores, prompts, size)
        return x[pick], scores[pick]
    pick = group_topk(scores, prompts, size, candidates)
    return x[pick.to(x.device)], scores[pick]


def as_scores(values, rows: int) -> Tensor:
    scores = torch.as_tensor(values).detach().double().flatten().cpu()
    if scores.numel() != rows:
        raise ValueError(f"reward returned {scores.numel()} scores for {rows} latents")
    return scores


@torch.no_grad()
def best_of_n(
    velocity: GuidedVelocity,
    reward: LatentReward,
    sigmas: Tensor,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    budget: int,
    *,
    noise_level: float = 0.0,
    kind: str = "flow_grpo",
    candidates: int = 1,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """Best-of-N: ``N = budget // T`` independent trajectories per prompt; keep the one with the highest reward, or
    the ``candidates`` best (a set, best first; ``N >= candidates`` is required).

    With ``noise_level = 0`` the trajectories are ODE samples from different initial noise. Spends exactly
    ``N * T`` NFEs per prompt (``T`` = steps, times ``evals_per_sample``); the reward is called once, on the
    ``B * N`` final latents.
    """
    sigmas = check_sampling(sigmas, kind, noise_level, generators)
    num_steps = sigmas.numel() - 1
    per = trajectory_nfe(velocity, num_steps)
    n = check_budget(budget, per, "best-of-N") // per
    check_candidates(candidates, n, "best-of-N", f"trajectories of {per} NFEs", per)
    prompts = len(generators)
    rows = torch.arange(prompts, device=device).repeat_interleave(n)
    x = initial_noise(shape, generators, rows, device)
    spent = 0
    for i in range(num_steps):
        v = velocity(x, sigmas[i], rows)
        spent += count_nfe(velocity, x.shape[0])
        x = step(x, v, sigmas[i], sigmas[i + 1], kind=kind, noise_level=noise_level, generators=generators, rows=rows)
    scores = as_scores(reward(x, rows), x.shape[0])
    final, chosen = keep_candidates(x, scores, prompts, n, candidates)
    return GuidedResult(
        final=final,
        reward=chosen,
        nfe=torch.full((prompts,), spent // prompts, dtype=torch.long),
        info={"particles": n, "all_rewards": scores.reshape(prompts, n)},
    )

