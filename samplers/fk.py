"""Feynman-Kac steering: N interacting particles per prompt, resampled by reward potentials of ``x0_hat``.

Reference: Singhal et al. 2025, "A General Framework for Inference-time Scaling and Steering of Diffusion Models"
(FK steering, arXiv:2501.06848), and docs/design/math.md#guided-sampling.

Each prompt runs ``N`` SDE particles. At a *resampling step* ``t`` every particle's clean estimate
``x0_hat = x_t - s_t v(x_t)`` is scored (the velocity is the one the step needs anyway, so the potentials cost no
NFEs) and appended to its reward history ``r_0 .. r_t`` (the rewards at the resampling steps it has passed). The
particle's log-potential is ``lambda * phi`` with

* ``max``:  ``phi = max_k r_k`` (the best the lineage has looked so far),
* ``add``:  ``phi = sum_k r_k``,
* ``diff``: ``phi = r_t - r_{t-1}`` (the gain since the previous resampling step; ``r_{-1} = 0``),
* ``rt``:   ``phi = r_t`` (the current reward only).

Weights are ``w_i = softmax_i(lambda phi_i)`` within a prompt's particles, and the effective sample size is
``ESS = 1 / sum_i w_i^2``. A prompt's particles are resampled multinomially (with its own generator) exactly when
``ESS < ess_threshold * N`` (``ess_threshold = 0.5``: ESS < N/2); a resampled particle takes over its ancestor's
state, velocity and reward history. As in the paper's implementation, the potential is applied afresh at each
resampling step (not as a ratio to the previous one). At the end the particle with the highest final reward is
returned. NFEs: exactly ``N * T`` per prompt with ``N = budget // T``.

Guided proposals (optional ``corrector``, e.g. ``samplers.rgs.x0_gradient_correction``): each particle's SDE step is
moved by a reward-gradient correction before the next potential is computed, the "FK steering with gradient guidance
as the proposal" combination of Singhal et al. 2025. The importance weights are *not* corrected for the proposal
(``p(x'|x) / q(x'|x)`` over a whole latent is far larger than the potentials and would leave one particle), so the
particles steer the guided sampler's distribution, not the base model's.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from .guided import (
    GuidedResult,
    GuidedVelocity,
    LatentReward,
    as_scores,
    check_budget,
    check_sampling,
    group_argmax,
    initial_noise,
    step,
    trajectory_nfe,
)
from .rollout import count_nfe
from .sde import predict_x0

__all__ = ["POTENTIALS", "effective_sample_size", "fk_steering", "potential", "resample"]

POTENTIALS = ("max", "add", "diff", "rt")


def potential(history: Tensor, kind: str) -> Tensor:
    """``phi [n]`` from reward histories ``[n, k]`` (one column per resampling step so far); see the module docstring."""
    if kind not in POTENTIALS:
        raise ValueError(f"unknown FK potential {kind!r}: expected one of {', '.join(POTENTIALS)}")
    if history.ndim != 2 or history.shape[1] < 1:
        raise ValueError(f"reward history must be [particles, steps >= 1], got shape {tuple(history.shape)}")
    if kind == "max":
        return history.max(dim=1).values
    if kind == "add":
        return history.sum(dim=1)
    if kind == "diff":
        previous = history[:, -2] if history.shape[1] > 1 else torch.zeros_like(history[:, -1])
        return history[:, -1] - previous
    return history[:, -1]


def effective_sample_size(log_weights: Tensor) -> Tensor:
    """``1 / sum_i w_i^2`` per row of unnormalised log-weights ``[groups, N]``, with ``w = softmax(log_weights)``."""
    weights = torch.softmax(log_weights.double(), dim=-1)
    return 1.0 / (weights**2).sum(dim=-1)


def resample(
    log_weights: Tensor, generators: Sequence[torch.Generator], *, ess_threshold: float = 0.5
) -> tuple[Tensor, Tensor, Tensor]:
    """``(ancestors [G * N], fired [G], ess [G])`` for log-weights ``[G, N]`` (group ``g`` draws from
    ``generators[g]``). Groups with ``ESS >= ess_threshold * N`` keep their particles (ancestor = itself)."""
    groups, n = log_weights.shape
    ess = effective_sample_size(log_weights)
    fired = ess < ess_threshold * n
    ancestors = torch.arange(groups * n).reshape(groups, n)
    weights = torch.softmax(log_weights.double(), dim=-1)
    for g in torch.nonzero(fired).flatten().tolist():
        drawn = torch.multinomial(weights[g].cpu(), n, replacement=True, generator=generators[g])
        ancestors[g] = g * n + drawn
    return ancestors.flatten(), fired, ess


@torch.no_grad()
def fk_steering(
    velocity: GuidedVelocity,
    reward: LatentReward,
    sigmas: Tensor,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    budget: int,
    *,
    potential_kind: str = "add",
    lam: float = 10.0,
    resample_steps: Sequence[int] | None = None,
    ess_threshold: float = 0.5,
    noise_level: float = 0.7,
    kind: str = "flow_grpo",
    corrector=None,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """FK steering with ``N = budget // T`` particles per prompt (module docstring).

    ``resample_steps`` (default: every step but the last) are the steps whose ``x0_hat`` is scored; resampling
    happens there when the ESS rule fires. ``noise_level`` must be > 0 (resampled copies of one particle only
    diverge through SDE noise). ``info["events"]`` lists ``(step, prompt, ess, fired)`` for every check.
    """
    sigmas = check_sampling(sigmas, kind, noise_level, generators)
    num_steps = sigmas.numel() - 1
    potential(torch.zeros(1, 1), potential_kind)  # validates the name before any work
    if noise_level <= 0:
        raise ValueError("FK steering needs noise_level > 0: with an ODE, resampled copies of a particle never differ")
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"FK lambda must be a finite number >= 0, got {lam!r}")
    if not 0 < ess_threshold <= 1:
        raise ValueError(f"ess_threshold must lie in (0, 1], got {ess_threshold!r}")
    checks = set(range(num_steps - 1)) if resample_steps is None else {int(s) for s in resample_steps}
    if any(s < 0 or s >= num_steps for s in checks):
        raise ValueError(f"resample_steps {sorted(checks)} must lie in 0..{num_steps - 1}")
    per = trajectory_nfe(velocity, num_steps)
    n = check_budget(budget, per, "FK-steering") // per

    prompts = len(generators)
    rows = torch.arange(prompts, device=device).repeat_interleave(n)
    x = initial_noise(shape, generators, rows, device)
    history = torch.zeros(prompts * n, 0, dtype=torch.float64)
    events, spent = [], 0
    for i in range(num_steps):
        sigma = sigmas[i]
        v = velocity(x, sigma, rows)
        spent += count_nfe(velocity, x.shape[0])
        if i in checks:
            scores = as_scores(reward(predict_x0(x, v, sigma).to(x.dtype), rows), x.shape[0])
            history = torch.cat([history, scores[:, None]], dim=1)
            log_weights = lam * potential(history, potential_kind).reshape(prompts, n)
            ancestors, fired, ess = resample(log_weights, generators, ess_threshold=ess_threshold)
            events += [(i, g, float(ess[g]), bool(fired[g])) for g in range(prompts)]
            x, v, history = x[ancestors.to(x.device)], v[ancestors.to(v.device)], history[ancestors]
        x_next = step(x, v, sigma, sigmas[i + 1], kind=kind, noise_level=noise_level, generators=generators, rows=rows)
        x = x_next if corrector is None else corrector(x, v, sigma, x_next, rows)
    scores = as_scores(reward(x, rows), x.shape[0])
    pick = group_argmax(scores, prompts, n)
    return GuidedResult(
        final=x[pick],
        reward=scores[pick],
        nfe=torch.full((prompts,), spent // prompts, dtype=torch.long),
        info={"particles": n, "events": events, "resamples": sum(e[3] for e in events),
              "guided_proposals": corrector is not None},
    )
