"""Feynman-Kac steering: N interacting particles per prompt, resampled by reward potentials of ``x0_hat``.

Reference: Singhal et al. 2025, "A General Framework for Inference-time Scaling and Steering of Diffusion Models"
(FK steering, arXiv:2501.06848), its code ``zacharyhorvitz/Fk-Diffusion-Steering``
(``text_to_image/fkd_diffusers/fkd_class.py::FKD.resample``), and docs/design/math.md#guided-sampling.

Each prompt runs ``N = budget // T`` SDE particles (``T`` steps) and spends exactly ``N * T`` NFEs: a particle's
clean estimate ``x0_hat = x_t - s_t v(x_t)`` reuses the velocity its step needs, so scoring it costs no NFE. Two
resampling schemes (``flowalign sample --fk-resampling``):

**``fk_steering_reference``: as the reference code** (the default of ``--guidance fk``). At every loop index ``i``
the particles' ``x0_hat`` of the pre-step state ``x_i`` are scored *only if* ``i`` is active
(``fk_schedule``: ``{t_start, t_start + freq, ..., <= t_end} ∪ {T - 1}``), then every particle takes its SDE step,
and then the **post-step** latents ``x_{i+1}`` are resampled (duplicates are exact copies until the next step's noise)
by ``fk_resample_step``: potentials ``max`` / ``add`` / ``diff`` / ``rt`` on a carried ``pop`` (seeded with
``reward_min_value = 0``, which floors ``max`` at 0) and ``log Π``, the last index's ``- log Π`` correction, fixed
resampling at every active index or adaptive (``ESS < N/2``), the last index always by the ESS test
(flowalign.samplers.fk_resampling has the formulas). Log space throughout, where the reference's
``clamp(exp(λ u), 0, 1e10)`` saturates for ``λ u > 23`` (PickScore-scale rewards at ``λ = 10`` all weigh ``1e10``
there and are never resampled adaptively): the one intended difference; given the same ancestors every other number
matches the reference to rounding.

**``fk_steering``: flowalign's earlier variant** (``--fk-resampling flowalign``), kept as a checked copy for one
reason: every FK result of docs/results/guided_sampling.md was measured with it (``bench/guided.py``'s default), and
this keeps them reproducible (tests/test_guided.py and tests/test_fk_reference.py pin it). At a *resampling step*
``t`` (default every step but the last) every particle's ``x0_hat`` is scored and appended to its reward history
``r_0 .. r_t``; the particle's log-potential is ``lambda * phi`` with ``max`` ``phi = max_k r_k`` (no floor), ``add`` ``sum_k r_k``,
``diff`` ``r_t - r_{t-1}`` (``r_{-1} = 0``), ``rt`` ``r_t``; weights ``w_i = softmax_i(lambda phi_i)``, and a
prompt's **pre-step** particles (state, velocity and history) are resampled multinomially exactly when
``ESS = 1 / sum_i w_i^2 < ess_threshold * N`` (always adaptive), then step with fresh noise. No final check and no
``Π`` correction; the potential is applied afresh at each check (no weight carried across checks).

Both return the particle of highest final reward per prompt, or with ``candidates = K > 1`` the ``K`` best final
particles sorted by reward, descending (``final [B, K, ...]``, ``reward [B, K]``; ``samplers.guided.group_topk``); the
reference returns all ``N`` sorted. ``K > N`` is refused.

Guided proposals (optional ``corrector``, e.g. ``samplers.rgs.x0_gradient_correction``): each particle's SDE step is
moved by a reward-gradient correction before the next potential is computed, the "FK steering with gradient guidance
as the proposal" combination of Singhal et al. 2025. The importance weights are *not* corrected for the proposal
(``p(x'|x) / q(x'|x)`` over a whole latent is far larger than the potentials and would leave one particle), so the
particles steer the guided sampler's distribution, not the base model's.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
from torch import Tensor

from flowalign.deprecation import moved_names
from .fk_resampling import (
    POTENTIALS,
    FKDecision,
    FKState,
    check_potential,
    fk_log_weights,
    fk_resample_step,
    fk_schedule,
    multinomial_draw,
)
from .guided import (
    GuidedResult,
    GuidedVelocity,
    LatentReward,
    as_scores,
    check_budget,
    check_candidates,
    check_sampling,
    initial_noise,
    keep_candidates,
    step,
    trajectory_nfe,
)
from .rollout import count_nfe
from .sde import predict_x0

__all__ = ["POTENTIALS", "RESAMPLING", "FKDecision", "FKState", "effective_sample_size", "fk_log_weights",
           "fk_resample_step", "fk_schedule", "fk_steering", "fk_steering_reference", "multinomial_draw", "potential",
           "resample"]

# FK's two resampling schemes (``flowalign sample --fk-resampling``): ``reference``, fk_steering_reference (as the
# reference code resamples); ``flowalign``, fk_steering (the earlier scheme, kept because every FK result in
# docs/results/guided_sampling.md and bench/guided.py's default were measured with it).
RESAMPLING = ("reference", "flowalign")


# SEMANTICS is the old name of RESAMPLING, for one release.
__getattr__ = moved_names(__name__, {"SEMANTICS": f"{__name__}:RESAMPLING"})

logger = logging.getLogger(__name__)


def potential(history: Tensor, kind: str) -> Tensor:
    """``phi [n]`` from reward histories ``[n, k]`` (one column per resampling step so far); see the module docstring."""
    check_potential(kind)
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
    candidates: int = 1,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """FK steering, flowalign's earlier semantics, with ``N = budget // T`` particles per prompt (module docstring).

    ``resample_steps`` (default: every step but the last) are the steps whose ``x0_hat`` is scored; resampling
    happens there when the ESS rule fires. ``noise_level`` must be > 0 (resampled copies of one particle only
    diverge through SDE noise). ``info["events"]`` lists ``(step, prompt, ess, fired)`` for every check.
    ``candidates = K > 1`` returns the ``K`` best final particles per prompt (``final [B, K, ...]``).
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
    check_candidates(candidates, n, "FK steering", f"particles of {per} NFEs", per)

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
    info = {"semantics": "flowalign", "particles": n, "events": events, "resamples": sum(e[3] for e in events),
            "guided_proposals": corrector is not None}
    final, chosen = keep_candidates(x, scores, prompts, n, candidates)
    return GuidedResult(final=final, reward=chosen, nfe=torch.full((prompts,), spent // prompts, dtype=torch.long),
                        info=info)


@torch.no_grad()
def fk_steering_reference(
    velocity: GuidedVelocity,
    reward: LatentReward,
    sigmas: Tensor,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    budget: int,
    *,
    potential_kind: str = "add",
    lam: float = 10.0,
    resample_start: int = 0,
    resample_every: int = 1,
    resample_end: int | None = None,
    adaptive: bool = False,
    ess_threshold: float = 0.5,
    reward_min_value: float = 0.0,
    noise_level: float = 0.7,
    kind: str = "flow_grpo",
    corrector=None,
    candidates: int = 1,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """FK steering as its reference code runs it, with ``N = budget // T`` particles per prompt (module docstring).

    Active indices ``fk_schedule(T, resample_start, resample_every, resample_end)`` (the reference's
    ``resampling_t_start``, ``resample_frequency``, ``resampling_t_end``; the last index always). At an active index
    ``i`` the rewards of ``x0_hat(x_i)`` go through ``fk_resample_step`` (``adaptive``: only when ``ESS <
    ess_threshold * N``; otherwise always but at the last index, which tests the ESS), after the step, on the
    post-step particles ``x_{i+1}``; ancestors are drawn with the prompt's generator. ``pop`` starts at
    ``reward_min_value``. A prompt whose weights are all zero (every reward NaN) keeps its particles (logged, and
    counted in ``info["degenerate"]``). ``info["events"]`` lists ``(index, prompt, ess, resampled, degenerate)`` for
    every active index. Exactly ``N * T`` NFEs per prompt; ``candidates = K > 1`` returns the ``K`` best final
    particles (``final [B, K, ...]``, ``reward [B, K]``, sorted descending).
    """
    sigmas = check_sampling(sigmas, kind, noise_level, generators)
    num_steps = sigmas.numel() - 1
    check_potential(potential_kind)
    if noise_level <= 0:
        raise ValueError("FK steering needs noise_level > 0: with an ODE, resampled copies of a particle never differ")
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"FK lambda must be a finite number >= 0, got {lam!r}")
    if not 0 < ess_threshold <= 1:
        raise ValueError(f"ess_threshold must lie in (0, 1], got {ess_threshold!r}")
    if not math.isfinite(reward_min_value):
        raise ValueError(f"reward_min_value must be a finite number, got {reward_min_value!r}")
    active = set(fk_schedule(num_steps, resample_start, resample_every, resample_end))
    per = trajectory_nfe(velocity, num_steps)
    n = check_budget(budget, per, "FK-steering") // per
    check_candidates(candidates, n, "FK steering", f"particles of {per} NFEs", per)

    prompts = len(generators)
    rows = torch.arange(prompts, device=device).repeat_interleave(n)
    x = initial_noise(shape, generators, rows, device)
    states = [FKState.initial(n, reward_min_value) for _ in range(prompts)]
    events, spent = [], 0
    for i in range(num_steps):
        sigma = sigmas[i]
        v = velocity(x, sigma, rows)
        spent += count_nfe(velocity, x.shape[0])
        scores = as_scores(reward(predict_x0(x, v, sigma).to(x.dtype), rows), x.shape[0]) if i in active else None
        x_next = step(x, v, sigma, sigmas[i + 1], kind=kind, noise_level=noise_level, generators=generators, rows=rows)
        x = x_next if corrector is None else corrector(x, v, sigma, x_next, rows)
        if scores is None:
            continue
        ancestors = torch.arange(prompts * n)
        for g in range(prompts):
            part = slice(g * n, (g + 1) * n)
            drawn, states[g], decision = fk_resample_step(
                scores[part], states[g], potential=potential_kind, lam=lam, last=i == num_steps - 1,
                adaptive=adaptive, ess_threshold=ess_threshold, generator=generators[g])
            ancestors[part] = g * n + drawn
            events.append((i, g, decision.ess, decision.resampled, decision.degenerate))
            if decision.degenerate:
                logger.warning("FK steering: every weight of prompt %d is zero at step %d (NaN rewards): its "
                               "particles are kept", g, i)
        x = x[ancestors.to(x.device)]
    scores = as_scores(reward(x, rows), x.shape[0])
    info = {"semantics": "reference", "particles": n, "schedule": sorted(active), "events": events,
            "resamples": sum(e[3] for e in events), "degenerate": sum(e[4] for e in events),
            "guided_proposals": corrector is not None}
    final, chosen = keep_candidates(x, scores, prompts, n, candidates)
    return GuidedResult(final=final, reward=chosen, nfe=torch.full((prompts,), spent // prompts, dtype=torch.long),
                        info=info)
