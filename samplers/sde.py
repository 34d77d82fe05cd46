"""One step of the flow ODE, or of an SDE that shares its marginals, with the exact transition log-prob.

Notation (docs/design/math.md#notation): sigma ``s`` falls from 1 (noise) to 0 (data), ``s'`` is the next sigma,
``dt = s' - s < 0``, ``v`` is the predicted velocity and the forward process is ``x_s = (1 - s) x0 + s eps``.
From ``v`` follow the two endpoint predictions ``x0_hat = x - s v`` and ``x1_hat = x + (1 - s) v``.

Every SDE step is Gaussian, ``x' = mu + std * eps``, so its log-density is exact:
``log N(x'; mu, std^2) = -(x' - mu)^2 / (2 std^2) - log std - log sqrt(2 pi)``, reduced over all non-batch
dimensions by ``mean`` (the Flow-GRPO convention, which its 1e-4 clip ranges assume) or ``sum`` (the true joint
log-density). All arithmetic runs in fp32 whatever the dtype of ``x`` and ``v``; see ``sde_step`` for how the
returned sample is kept consistent with its log-prob.

Kinds:

* ``flow_grpo`` (Liu et al. 2025, "Flow-GRPO", eq. 9): ``std_t = a sqrt(s / (1 - s))`` with the denominator
  ``1 - s'`` at ``s = 1``;  ``mu = x (1 + std_t^2 dt / (2 s)) + v (1 + std_t^2 (1 - s) / (2 s)) dt`` and
  ``std = std_t sqrt(-dt)``. This is the reverse-time SDE ``dx = [v - std_t^2/2 * score] dt + std_t dw`` with the
  score of the Gaussian path, ``score = -(x + (1 - s) v) / s``.
* ``dance`` (Xue et al. 2025, "DanceGRPO"): ``std = eta sqrt(-dt)`` and ``mu = x + dt v - eta^2/2 * score * dt``
  with ``score = -(x - (1 - s) x0_hat) / s^2``. The same SDE family with a constant diffusion coefficient.
* ``cps`` (coefficient-preserving sampling, Wang & Yu 2025): ``std = s' sin(a pi / 2)`` and
  ``mu = (1 - s') x0_hat + sqrt(s'^2 - std^2) x1_hat``: the next state is re-noised so that the noise
  coefficient is exactly ``s'``. Needs ``0 <= a <= 1``.

Guided steps (Euphonium, Zhong et al. 2026, arXiv 2602.04928): ``sde_step(..., mean_shift=c G)`` draws
``x' = mu + c G + std eps`` around a shifted mean (``flowalign.samplers.euphonium.euphonium_guidance`` computes ``c G``
from a process reward's gradient ``G``) and takes the log-prob under the unguided mean ``mu`` (the released code's default, which makes the
policy gradient pull the unguided policy toward the guided samples) or under the guided one ``mu + c G``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowalign.deprecation import moved_names
from ..kernels import sde_transition
from ..kernels.sde_reference import (  # the step math is pure tensor math: it lives one layer down
    REDUCTIONS,
    SDE_KINDS,
    StepOutput,
    check_kind,
    check_noise_level,
    check_reduce,
    check_step_values,
    gaussian_log_prob,
    sde_mean_std,
)
from ..kernels.sde_reference import per_sample as _per_sample
from ..kernels.sde_reference import show_values as _show


def check_sigmas(sigmas: Tensor | list[float]) -> Tensor:
    """A sigma schedule must lie in [0, 1] and strictly decrease (from noise to data)."""
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be a 1-D schedule with at least 2 entries, got shape {tuple(sigmas.shape)}")
    if (sigmas < 0).any() or (sigmas > 1).any():
        raise ValueError(f"sigmas must lie in [0, 1], got {_show(sigmas)}")
    steps = sigmas[1:] - sigmas[:-1]
    if (steps >= 0).any():
        i = int(torch.nonzero(steps >= 0)[0])
        raise ValueError(
            f"sigmas must strictly decrease from noise to data, but sigmas[{i}]={sigmas[i].item():.6g} is followed by "
            f"sigmas[{i + 1}]={sigmas[i + 1].item():.6g}"
        )
    return sigmas


def predict_x0(x: Tensor, v: Tensor, sigma: float | Tensor) -> Tensor:
    """``x0_hat = x - s v`` in fp32."""
    s = _per_sample(sigma, x)
    return x.float() - s * v.float()


def ode_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """Euler step of the flow ODE, ``x' = x + (s' - s) v``, computed in fp32 and returned in ``x.dtype``.

    This is exactly what diffusers' ``FlowMatchEulerDiscreteScheduler.step`` does, so an ODE rollout reproduces the
    pipelines bit for bit.
    """
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    return (x.float() + (s_next - s) * v.float()).to(x.dtype)


def sde_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    kind: str,
    noise_level: float | Tensor,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    reduce: str = "mean",
    generator: torch.Generator | list[torch.Generator] | None = None,
    noise_scale: float | Tensor = 1.0,
    mean_shift: Tensor | None = None,
    log_prob_under: str = "unguided",
) -> StepOutput:
    """One stochastic step ``x -> x'`` and its exact log-prob (formulas in the module docstring).

    ``sigma``, ``sigma_next`` and ``noise_level`` are scalars or per-sample ``[batch]`` tensors, so a minibatch may mix
    transitions from different steps. Pass ``prev_sample`` to score a given ``x'`` (the training-time recomputation)
    instead of drawing one; otherwise ``noise`` (standard normal, shape of ``x``) or fresh noise from ``generator``
    is used (a list of generators draws row ``i`` from ``generator[i]``, so a sample's noise does not depend on
    which batch or process it is in).

    The sample is returned in ``x.dtype`` and its log-prob is evaluated on that returned (possibly rounded) sample,
    so recomputing the log-prob of the stored ``x'`` later gives a ratio of exactly 1.

    ``noise_scale`` (scalar or ``[batch]``, > 0) widens the draw around the same mean: ``x' = mu + c std eps``, as
    BranchGRPO's split steps do. The returned ``std`` and the log-prob use ``c std``, the std that actually produced
    the sample (BranchGRPO's public code scores scaled noise with the unscaled std, which is not the density of
    what it sampled).

    ``mean_shift`` (fp32 or ``x``'s dtype, shape of ``x``; e.g. ``euphonium_guidance``) moves the mean the sample is
    drawn around: ``x' = (mu + mean_shift) + c std eps``, and with ``prev_sample`` it is the shift the given ``x'`` was
    drawn with. ``log_prob_under`` picks the density the log-prob is taken under: ``"unguided"`` ``N(x'; mu, std^2)``
    (Euphonium's released behaviour) or ``"guided"`` ``N(x'; mu + mean_shift, std^2)``, evaluated as
    ``N(x' - mean_shift; mu, std^2)`` on ``x'.float() - mean_shift`` (what ``flowalign.losses.grpo`` recomputes, so
    the first ratio stays exactly 1). The returned ``mean`` is the guided one. Without ``mean_shift`` the step is
    bitwise the plain one (the fused kernel on CUDA); with it, the sample is drawn from the step's mean and std and
    scored by the same kernel with ``prev_sample``.
    """
    check_log_prob_under(log_prob_under)
    check_kind(kind)
    check_reduce(reduce)
    check_step_values(sigma, sigma_next, noise_level, noise_scale, kind)
    if prev_sample is None:
        if noise is None:
            noise = standard_normal(x.shape, generator, x.device)
        elif noise.shape != x.shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)} but x has shape {tuple(x.shape)}")
    elif prev_sample.shape != x.shape:
        raise ValueError(f"prev_sample has shape {tuple(prev_sample.shape)} but x has shape {tuple(x.shape)}")
    else:
        noise = None
    if mean_shift is None:
        # The fused Triton step on CUDA, the torch reference elsewhere (flowalign.kernels: FLOWALIGN_KERNELS switch).
        return sde_transition(x, v, sigma, sigma_next, kind=kind, noise_level=noise_level, noise_scale=noise_scale,
                              noise=noise, prev_sample=prev_sample, reduce=reduce)
    if mean_shift.shape != x.shape:
        raise ValueError(f"mean_shift has shape {tuple(mean_shift.shape)} but x has shape {tuple(x.shape)}")
    shift = mean_shift.float()
    if prev_sample is None:
        # The step's own mean and std (one pass of the same op), then the draw around the shifted mean.
        plain = sde_transition(x, v, sigma, sigma_next, kind=kind, noise_level=noise_level, noise_scale=noise_scale,
                               noise=noise, reduce=reduce)
        std = plain.std.reshape(-1, *([1] * (x.ndim - 1)))
        prev_sample = ((plain.mean + shift) + std * noise.float()).to(x.dtype)
    scored = guided_log_prob_sample(prev_sample, shift) if log_prob_under == "guided" else prev_sample
    out = sde_transition(x.float() if log_prob_under == "guided" else x, v, sigma, sigma_next, kind=kind,
                         noise_level=noise_level, noise_scale=noise_scale, prev_sample=scored, reduce=reduce)
    return StepOutput(prev_sample, out.mean + shift, out.std, out.log_prob)


LOG_PROB_MEANS = ("unguided", "guided")


def check_log_prob_under(value: str) -> str:
    if value not in LOG_PROB_MEANS:
        raise ValueError(f"unknown log_prob_under {value!r}: expected one of {', '.join(LOG_PROB_MEANS)} (the mean "
                         "without or with the guidance shift)")
    return value


def guided_log_prob_sample(prev_sample: Tensor, mean_shift: Tensor) -> Tensor:
    """``x'.float() - mean_shift``: scored under the unguided mean it gives the density under the guided one. The
    rollout and the training loss both score this tensor, so their log-probs agree bitwise."""
    return prev_sample.float() - mean_shift.float()


def standard_normal(
    shape: tuple[int, ...],
    generator: torch.Generator | list[torch.Generator] | None,
    device: torch.device,
    owner: Tensor | None = None,
) -> Tensor:
    """fp32 N(0, 1) noise of ``shape``. With a list of generators, row ``i`` comes from ``generator[i]``, or from
    ``generator[owner[i]]`` when ``owner`` is given (rows sharing an owner draw from it in row order: a tree's nodes
    from their tree's generator)."""
    if isinstance(generator, (list, tuple)):
        if owner is not None:
            generator = [generator[int(k)] for k in owner]
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}: give one per row")
        rows = [torch.randn(shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generator]
        return torch.stack(rows).to(device)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)


# euphonium_guidance and GUIDANCE_NORMS moved to flowalign.samplers.euphonium (Euphonium's sampler module), which
# imports this one: the new home is imported when an old name is read, for one release, with a warning.
__getattr__ = moved_names(__name__, {name: f"{__package__}.euphonium:{name}"
                                     for name in ("euphonium_guidance", "GUIDANCE_NORMS")})
