"""Euphonium-guided sampling: the process-reward-gradient-guided SDE as an inference-time sampler.

Reference: Zhong et al. 2026, "Euphonium" (arXiv 2602.04928), ``grpo_sampling/flux_step.py::flux_step`` of its public
code, where the same SDE generates GRPO's rollouts (``flowalign.credit.euphonium`` trains with it). Here it samples
without training: each of the guided steps shifts the SDE mean along the gradient ``G = grad_x PRM(x_i)`` of a process
reward at the step's state,

    x_{i+1} = mu(x_i, v_i) + c G + std eps,       c = scale (* (s_i - s_{i+1}) with scale_by_dt)

(``euphonium_guidance``, here; with ``normalize`` ``G`` is a unit vector per sample), ``mu`` and ``std``
the ``kind`` SDE's (``dance`` at ``noise_level = 0.25`` in the released script). The steps from ``start`` on are guided
(the released script: 12 of 16, the last quarter). The process reward comes from ``guide(x, sigma, rows) -> (v,
scores [n, H])`` as RGS takes it (``samplers.rgs``): register heads, or a differentiable reward of ``x0_hat``, with
the gradient through the velocity or on ``x0_hat`` alone; the heads' gradients are summed with ``head_weights``.

Where it differs from RGS: RGS moves an ODE (or SDE) step by a correction scaled to the step's own size in sigma
bands; Euphonium adds ``c G`` to an SDE mean, so the guidance competes with the SDE's noise.

NFEs: ``T`` forwards per trajectory (``evals_per_sample`` each) plus ``backward_nfe`` per head and guided step.
``k = budget // cost`` trajectories run per prompt and ``final_reward`` keeps the best (or the ``candidates`` best).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .guided import (
    GuidedResult,
    LatentReward,
    as_scores,
    check_budget,
    check_candidates,
    check_sampling,
    initial_noise,
    keep_candidates,
)
from .rollout import count_nfe
from .sde import sde_step, standard_normal

__all__ = ["GUIDANCE_NORMS", "euphonium_guidance", "euphonium_sampling", "guided_step_count"]

# How ``euphonium_guidance`` takes the norm of ``G``: per sample, or over the whole tensor (the public code's).
GUIDANCE_NORMS = ("sample", "batch")


def guided_step_count(num_steps: int, start: int) -> int:
    """How many of ``num_steps`` steps are guided when guidance starts at step ``start``."""
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < num_steps:
        raise ValueError(f"guidance start must be a step in 0..{num_steps - 1}, got {start!r}")
    return num_steps - start


def euphonium_guidance(
    reward_gradient: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float | Tensor,
    scale: float,
    normalize: bool,
    scale_by_dt: bool,
    kl_beta: float | None = None,
    norm: str = "sample",
    eps: float = 1e-8,
) -> Tensor:
    """Euphonium's mean shift ``c G`` (Zhong et al. 2026, arXiv 2602.04928; ``flux_step`` of its public code), fp32.

    ``G`` is ``reward_gradient`` (``[batch, ...]``, the gradient of a process reward at the step's state) and

        c = scale                              if scale >= 0
        c = noise_level^2 / (2 kl_beta)        if scale < 0 (the KL-regularised optimum's step, needs kl_beta > 0)
        c = c * (sigma - sigma_next)           if scale_by_dt (released script default: on)

    With ``normalize`` ``G`` is divided by ``||G|| + eps``: per sample (``norm="sample"``, the default) or over the
    whole tensor, batch included (``norm="batch"``, the public code's norm, which it only ever calls with one sample).
    A zero gradient (a row with ``||G|| = 0``, or the whole tensor with ``norm="batch"``) gives a zero shift, as the
    public code skips the guidance when ``||G|| = 0``. ``sigma``, ``sigma_next`` and ``noise_level`` are scalars or
    ``[batch]``.
    """
    if norm not in GUIDANCE_NORMS:
        raise ValueError(f"unknown guidance norm {norm!r}: expected one of {', '.join(GUIDANCE_NORMS)}")
    if not math.isfinite(scale):
        raise ValueError(f"guidance scale must be finite, got {scale!r}")
    if scale < 0 and (kl_beta is None or not kl_beta > 0):
        raise ValueError(f"a negative guidance scale means c = noise_level^2 / (2 kl_beta): give kl_beta > 0, got "
                         f"{kl_beta!r}")
    if reward_gradient.ndim < 1 or reward_gradient.shape[0] == 0:
        raise ValueError(f"reward_gradient must be a [batch, ...] tensor, got shape {tuple(reward_gradient.shape)}")
    g = reward_gradient.float()
    if scale >= 0:
        c = torch.full((g.shape[0],), float(scale), dtype=torch.float32, device=g.device)
    else:
        level = torch.as_tensor(noise_level, dtype=torch.float32, device=g.device).reshape(-1)
        c = (level**2 / (2 * kl_beta)).expand(g.shape[0])
    if scale_by_dt:
        s = torch.as_tensor(sigma, dtype=torch.float32, device=g.device).reshape(-1)
        s_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=g.device).reshape(-1)
        c = c * (s - s_next)
    c = c.reshape(-1, *([1] * (g.ndim - 1)))
    dims = tuple(range(1, g.ndim))
    if norm == "sample":
        size = g.pow(2).sum(dim=dims, keepdim=True).sqrt() if dims else g.abs()
    else:
        size = g.norm().reshape([1] * g.ndim)
    if normalize:
        g = g / (size + eps)
    return torch.where(size > 0, c * g, torch.zeros_like(g))


def euphonium_sampling(
    guide,
    sigmas: Tensor,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    budget: int,
    *,
    final_reward: LatentReward,
    start: int,
    scale: float,
    normalize: bool = True,
    scale_by_dt: bool = True,
    head_weights: Sequence[float] = (1.0,),
    noise_level: float = 0.25,
    kind: str = "dance",
    backward_nfe: int = 1,
    candidates: int = 1,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """Euphonium's guided SDE with ``k = budget // cost`` trajectories per prompt (module docstring); the best by
    ``final_reward`` is kept, or the ``candidates`` best (a set, best first). ``info`` has the trajectories, the
    cost of one and the mean norm of the applied shift per guided step."""
    sigmas = check_sampling(sigmas, kind, noise_level, generators)
    if not noise_level > 0:
        raise ValueError("Euphonium guidance shifts an SDE mean: noise_level must be > 0")
    num_steps = sigmas.numel() - 1
    guided = guided_step_count(num_steps, start)
    heads = len(head_weights)
    evals = count_nfe(guide, 1)
    cost = num_steps * evals + guided * heads * backward_nfe
    k = check_budget(budget, cost, "Euphonium-guided") // cost
    check_candidates(candidates, k, "Euphonium-guided sampling", f"trajectories of {cost} NFEs", cost)
    prompts = len(generators)
    rows = torch.arange(prompts, device=device).repeat_interleave(k)
    x = initial_noise(shape, generators, rows, device)
    spent, shift_norms = 0, []
    for i in range(num_steps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        shift = None
        if i >= start:
            with torch.enable_grad():
                x_in = x.detach().requires_grad_(True)
                v, scores = guide(x_in, sigma, rows)
                if scores.shape != (x.shape[0], heads):
                    raise ValueError(f"guide returned scores of shape {tuple(scores.shape)}; expected "
                                     f"({x.shape[0]}, {heads}) for {heads} head weights")
                weighted = (scores * torch.as_tensor(head_weights, dtype=scores.dtype, device=scores.device)).sum()
                (gradient,) = torch.autograd.grad(weighted, x_in)
            spent += x.shape[0] * (evals + heads * backward_nfe)
            v = v.detach()
            shift = euphonium_guidance(gradient, sigma, sigma_next, noise_level=noise_level, scale=scale,
                                       normalize=normalize, scale_by_dt=scale_by_dt).to(x.dtype)
            shift_norms.append(float(shift.flatten(1).norm(dim=1).mean()))
        else:
            with torch.no_grad():
                v, _ = guide(x, sigma, rows)
            spent += x.shape[0] * evals
        with torch.no_grad():
            noise = standard_normal(x.shape, generators, x.device, owner=rows)
            x = sde_step(x, v, sigma, sigma_next, kind=kind, noise_level=noise_level, noise=noise,
                         mean_shift=shift).prev_sample
    x = x.detach()
    with torch.no_grad():
        scores = as_scores(final_reward(x, rows), x.shape[0])
    final, chosen = keep_candidates(x, scores, prompts, k, candidates)
    return GuidedResult(
        final=final,
        reward=chosen,
        nfe=torch.full((prompts,), spent // prompts, dtype=torch.long),
        info={"particles": k, "trajectory_nfe": cost, "guided_steps": guided, "shift_norms": shift_norms},
    )
