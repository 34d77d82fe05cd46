"""Reward-guided sampling (RGS): a magnitude-matched reward-gradient correction of each sampler step.

Reference: docs/design/math.md#guided-sampling (latent reward registers and RGS); the gradient-of-a-reward-on-x0_hat
variant is the
"universal guidance" idea of Bansal et al. 2023 applied to flow steps. For a state ``x`` at sigma ``s`` with base
step ``x_base`` (the ODE or SDE step the sampler would take) and reward heads ``r_h`` (differentiable in ``x``):

    g       = sum_h w_h unitRMS(grad_x r_h(x))
    delta   = unitRMS(g) * scale(s) * RMS(x_base - x),   clipped elementwise to +-2 scale(s) RMS(x_base - x)
    x_next  = x_base + delta

``unitRMS(t) = t / RMS(t)`` per sample, so the correction's size is a fixed fraction of the step's own size whatever
the reward's scale, and several heads count by their weights, not their gradient norms. ``scale(s)`` comes from
sigma bands: 0.30 for ``s > 0.8``, 0.05 for ``s > 0.2``, else 0 (no gradient is computed there).

The reward enters through ``guide(x, sigma, rows) -> (v, scores [n, H])``, evaluated with ``x`` requiring grad:

* on register heads, ``v`` and the scores come from one transformer pass (``reward_models.latent_registers``);
* on any differentiable reward of the one-step estimate ``x0_hat = x - s v`` (``x0_guide``), the gradient flows
  back through the velocity.

NFEs: one forward per step (``evals_per_sample`` of the guide: 2 with CFG), plus ``backward_nfe`` per head on guided
steps (a backward pass through the transformer: 1, or 2 through a CFG velocity, whose backward runs through both
halves of its batch; 0 when the gradient skips the transformer). With a budget of ``k`` guided trajectories, ``k``
particles are guided independently and ``final_reward`` picks one.

The image rewards behind ``x0_guide`` are scored through their differentiable entry point
(``flowalign.rewards.differentiable_score``; a reward's plain ``__call__`` may score without gradients).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

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
)
from .rollout import count_nfe
from .sde import predict_x0

__all__ = ["DEFAULT_BANDS", "band_scale", "check_bands", "check_differentiable", "reward_guided_sampling",
           "rgs_correction", "rgs_velocity_target", "unit_rms", "x0_gradient_correction", "x0_guide",
           "x0_hat_gradient"]

# (sigma above which the band starts, scale), highest band first.
DEFAULT_BANDS = ((0.8, 0.30), (0.2, 0.05))

Guide = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def check_bands(bands: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """``bands`` as ``(sigma, scale)`` float pairs; ValueError unless the sigmas lie in [0, 1) and strictly decrease
    (``band_scale`` takes the first band whose sigma is exceeded) and every scale is >= 0."""
    try:
        pairs = [(float(threshold), float(scale)) for threshold, scale in bands]
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or any(b >= a for (a, _), (b, _) in zip(pairs, pairs[1:])) or any(
            not (0 <= t < 1 and scale >= 0) for t, scale in pairs):
        raise ValueError(f"RGS bands must be (sigma, scale) pairs with sigmas in [0, 1) strictly decreasing and "
                         f"scales >= 0, e.g. [(0.8, 0.3), (0.2, 0.05)]; got {bands!r}")
    return pairs


def band_scale(sigma: float, bands: Sequence[tuple[float, float]] = DEFAULT_BANDS) -> float:
    """The RGS scale for ``sigma``: that of the first band with ``sigma > threshold``, else 0."""
    for threshold, scale in bands:
        if float(sigma) > threshold:
            return float(scale)
    return 0.0


def _rms(t: Tensor) -> Tensor:
    return t.float().pow(2).flatten(1).mean(dim=1).sqrt().reshape(-1, *[1] * (t.ndim - 1))


def unit_rms(t: Tensor, eps: float = 1e-12) -> Tensor:
    """``t / RMS(t)`` per sample (a zero row stays zero)."""
    return t.float() / _rms(t).clamp_min(eps)


def rgs_correction(x: Tensor, x_base: Tensor, grads: Sequence[Tensor], weights: Sequence[float], scale: float) -> Tensor:
    """``x_next`` from the base step and the heads' gradients (module docstring)."""
    g = sum(w * unit_rms(grad) for w, grad in zip(weights, grads))
    size = scale * _rms(x_base.float() - x.float())
    delta = unit_rms(g) * size
    delta = torch.maximum(torch.minimum(delta, 2 * size), -2 * size)
    return (x_base.float() + delta).to(x_base.dtype)


def rgs_velocity_target(x: Tensor, v: Tensor, grads: Sequence[Tensor], weights: Sequence[float],
                        sigma: float | Tensor, sigma_next: float | Tensor,
                        bands: Sequence[tuple[float, float]] = DEFAULT_BANDS) -> Tensor:
    """RG-OPD's regression target: the velocity whose Euler step lands on the RGS-corrected ODE step,
    ``v* = v + delta / dt`` with ``delta`` from ``rgs_correction`` at ``x_base = x + dt v`` (``v`` itself where the
    band scale is 0). fp32."""
    scale = band_scale(float(sigma), bands)
    if scale == 0:
        return v.float()
    dt = float(sigma_next) - float(sigma)
    x_base = x.float() + dt * v.float()
    return v.float() + (rgs_correction(x.float(), x_base, grads, weights, scale) - x_base) / dt


def x0_guide(velocity: GuidedVelocity, reward: LatentReward, *, through_velocity: bool = True) -> Guide:
    """A guide from a velocity and a reward differentiable in the clean estimate ``x0_hat = x - s v``.

    ``through_velocity``: the gradient ``d r / d x`` includes the velocity's Jacobian, ``(I - s dv/dx)^T grad r``
    (one backward pass through the transformer: run RGS with ``backward_nfe=1``), or treats ``v`` as a constant, so
    ``d r / d x = grad r(x0_hat)`` and the gradient costs no transformer pass (``backward_nfe=0``; the gradient taken
    on the clean estimate without the denoiser's Jacobian, as in manifold-preserving guidance, He et al. 2024).

    A reward that declares ``differentiable = False`` is refused here, before any sampling; ``check_differentiable``
    probes one that declares nothing."""
    if getattr(reward, "differentiable", True) is False:
        check_differentiable(reward, ())

    def guide(x: Tensor, sigma: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        if through_velocity:
            v = velocity(x, sigma, rows)
        else:
            with torch.no_grad():
                v = velocity(x, sigma, rows)
        scores = reward(predict_x0(x, v, sigma), rows)
        return v, scores.reshape(x.shape[0], -1)

    guide.evals_per_sample = getattr(velocity, "evals_per_sample", 1)
    return guide


def x0_hat_gradient(reward: LatentReward, x: Tensor, v: Tensor, sigma: Tensor | float, rows: Tensor) -> Tensor:
    """``grad r(x0_hat)`` with respect to ``x0_hat = x - s v``, ``v`` held fixed: ``d r / d x`` without the velocity's
    Jacobian (``x0_guide(..., through_velocity=False)``). No transformer pass."""
    with torch.enable_grad():
        x0 = predict_x0(x, v, sigma).detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(reward(x0, rows).sum(), x0)
    return grad


def x0_gradient_correction(reward: LatentReward, bands: Sequence[tuple[float, float]] = DEFAULT_BANDS):
    """RGS as a correction of another sampler's steps: ``correct(x, v, sigma, x_base, rows) -> x_next``.

    The gradient of ``reward`` is taken on ``x0_hat = x - s v`` with ``v`` held fixed (no transformer pass, no NFE;
    see ``x0_guide``), and ``x_base`` (the sampler's own ODE or SDE step from ``x``) is moved by ``rgs_correction`` at
    ``band_scale(sigma)``; steps outside the bands are returned unchanged. FK steering uses it to propose its
    particles' moves (``fk_steering(..., corrector=...)``)."""
    bands = check_bands(bands)

    def correct(x: Tensor, v: Tensor, sigma: Tensor, x_base: Tensor, rows: Tensor) -> Tensor:
        scale = band_scale(float(sigma), bands)
        if scale == 0:
            return x_base
        return rgs_correction(x, x_base, [x0_hat_gradient(reward, x, v, sigma, rows)], [1.0], scale)

    return correct


def check_differentiable(reward: LatentReward, shape: Sequence[int], device="cpu") -> None:
    """Raise ValueError unless ``reward`` returns scores that carry a gradient to its input (probed on one zero latent).

    A reward may declare ``differentiable = False`` to fail without the probe."""
    name = getattr(reward, "name", type(reward).__name__)
    fix = ("RGS needs a reward differentiable in the latents: use register heads (--registers CKPT) or a "
           "differentiable reward of x0_hat, or pick guidance bon, fk or dts, which only need reward values")
    if getattr(reward, "differentiable", True) is False:
        raise ValueError(f"reward {name!r} is not differentiable: {fix}")
    probe = torch.zeros(1, *shape, device=device, requires_grad=True)
    with torch.enable_grad():
        out = reward(probe, torch.zeros(1, dtype=torch.long, device=device))
    if not isinstance(out, Tensor) or not out.requires_grad:
        raise ValueError(f"reward {name!r} returned scores without a gradient to its input: {fix}")


def reward_guided_sampling(
    guide: Guide,
    sigmas: Tensor,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    budget: int,
    *,
    head_weights: Sequence[float] = (1.0,),
    bands: Sequence[tuple[float, float]] = DEFAULT_BANDS,
    final_reward: LatentReward | None = None,
    noise_level: float = 0.0,
    kind: str = "flow_grpo",
    backward_nfe: int = 1,
    candidates: int = 1,
    device: str | torch.device = "cpu",
) -> GuidedResult:
    """RGS with ``k = budget // cost`` guided particles per prompt (``cost`` = one guided trajectory's NFEs).

    ``final_reward`` (needed when ``k > 1``) scores the final latents and picks each prompt's particle, or its
    ``candidates`` best (a set, best first; ``k >= candidates`` is required). Returns the chosen latents, their
    ``final_reward`` (NaN without one) and the NFEs spent.
    """
    sigmas = check_sampling(sigmas, kind, noise_level, generators)
    bands = check_bands(bands)
    num_steps = sigmas.numel() - 1
    heads = len(head_weights)
    if heads < 1:
        raise ValueError("head_weights must name at least one head weight")
    evals = count_nfe(guide, 1)
    scales = [band_scale(s, bands) for s in sigmas[:-1].tolist()]
    cost = num_steps * evals + sum(scale > 0 for scale in scales) * heads * backward_nfe
    k = check_budget(budget, cost, "RGS") // cost
    check_candidates(candidates, k, "RGS", f"guided trajectories of {cost} NFEs", cost)
    if candidates > 1 and final_reward is None:
        raise ValueError("a set of candidates is ranked by final_reward: give one")
    if k > 1 and final_reward is None:
        k = 1  # nothing to choose with: spend one trajectory's worth
    prompts = len(generators)
    rows = torch.arange(prompts, device=device).repeat_interleave(k)
    x = initial_noise(shape, generators, rows, device)
    spent = 0
    for i in range(num_steps):
        sigma, scale = sigmas[i], scales[i]
        if scale > 0:
            with torch.enable_grad():
                x_in = x.detach().requires_grad_(True)
                v, scores = guide(x_in, sigma, rows)
                if scores.shape != (x.shape[0], heads):
                    raise ValueError(f"guide returned scores of shape {tuple(scores.shape)}; expected "
                                     f"({x.shape[0]}, {heads}) for {heads} head weights")
                grads = [torch.autograd.grad(scores[:, h].sum(), x_in, retain_graph=h < heads - 1)[0]
                         for h in range(heads)]
            spent += x.shape[0] * (evals + heads * backward_nfe)
            v = v.detach()
        else:
            with torch.no_grad():
                v, _ = guide(x, sigma, rows)
            spent += x.shape[0] * evals
        with torch.no_grad():
            x_base = step(x, v, sigma, sigmas[i + 1], kind=kind, noise_level=noise_level, generators=generators,
                          rows=rows)
            x = rgs_correction(x, x_base, grads, head_weights, scale) if scale > 0 else x_base
    x = x.detach()
    if final_reward is None:
        pick, chosen = torch.arange(prompts), torch.full((prompts,), float("nan"), dtype=torch.float64)
        all_scores = None
    else:
        with torch.no_grad():
            all_scores = as_scores(final_reward(x, rows), x.shape[0])
        final, chosen = keep_candidates(x, all_scores, prompts, k, candidates)
    return GuidedResult(
        final=x[pick] if final_reward is None else final,
        reward=chosen,
        nfe=torch.full((prompts,), spent // prompts, dtype=torch.long),
        info={"particles": k, "trajectory_nfe": cost, "guided_steps": sum(s > 0 for s in scales)},
    )
