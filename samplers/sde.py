"""One step of the flow ODE, or of an SDE that shares its marginals, with the exact transition log-prob.

Notation (DESIGN.md §4): sigma ``s`` falls from 1 (noise) to 0 (data), ``s'`` is the next sigma,
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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

SDE_KINDS = ("flow_grpo", "dance", "cps")
REDUCTIONS = ("mean", "sum")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class StepOutput(NamedTuple):
    """The result of one stochastic step. ``std`` and ``log_prob`` have shape ``[batch]``."""

    prev_sample: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor


def check_kind(kind: str) -> str:
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown SDE kind {kind!r}: expected one of {', '.join(SDE_KINDS)}")
    return kind


def check_reduce(reduce: str) -> str:
    if reduce not in REDUCTIONS:
        raise ValueError(f"unknown log-prob reduction {reduce!r}: expected one of {', '.join(REDUCTIONS)}")
    return reduce


def check_noise_level(noise_level: float | Tensor, kind: str | None = None) -> None:
    """Noise levels are >= 0 for every kind, and at most 1 for ``cps`` (``sin(a pi / 2)`` must not exceed 1)."""
    level = torch.as_tensor(noise_level, dtype=torch.float32)
    if torch.isnan(level).any() or (level < 0).any():
        raise ValueError(f"noise_level must be >= 0 (0 means a deterministic ODE step), got {_show(noise_level)}")
    if kind == "cps" and (level > 1).any():
        raise ValueError(f"noise_level for kind 'cps' must lie in [0, 1], got {_show(noise_level)}")


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


def sde_mean_std(
    x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, *, kind: str, noise_level: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Mean ``mu`` (fp32, shape of ``x``) and transition std (fp32, broadcastable ``[batch, 1, ...]``)."""
    x, v = x.float(), v.float()
    s, s_next, a = _per_sample(sigma, x), _per_sample(sigma_next, x), _per_sample(noise_level, x)
    dt = s_next - s
    if kind == "flow_grpo":
        # At s = 1 the ratio s / (1 - s) is infinite; Flow-GRPO uses the next sigma in the denominator there.
        denominator = torch.where(s >= 1, 1 - s_next, 1 - s)
        std_t = a * torch.sqrt(s / denominator)
        mean = x * (1 + std_t**2 * dt / (2 * s)) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        std = std_t * torch.sqrt(-dt)
    elif kind == "dance":
        x0_hat = x - s * v
        score = -(x - x0_hat * (1 - s)) / s**2
        mean = x + dt * v - 0.5 * a**2 * score * dt
        std = a * torch.sqrt(-dt)
    elif kind == "cps":
        x0_hat = x - s * v
        x1_hat = x + (1 - s) * v
        std = s_next * torch.sin(a * math.pi / 2)
        mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt((s_next**2 - std**2).clamp_min(0))
    else:
        check_kind(kind)
    return mean, std.expand(x.shape[0], *([1] * (x.ndim - 1)))


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor, reduce: str = "mean") -> Tensor:
    """``log N(sample; mean, std^2)`` in fp32, reduced over all non-batch dims. Rows with ``std == 0`` get 0.

    A zero std is a deterministic (ODE) transition: it carries no density and no policy gradient.
    """
    check_reduce(reduce)
    sample, mean, std = sample.float(), mean.float(), std.float()
    stochastic = std > 0
    safe_std = torch.where(stochastic, std, torch.ones_like(std))
    log_prob = -((sample - mean) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    log_prob = torch.where(stochastic, log_prob, torch.zeros_like(log_prob))
    dims = tuple(range(1, sample.ndim))
    return log_prob.mean(dim=dims) if reduce == "mean" else log_prob.sum(dim=dims)


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
    """
    check_kind(kind)
    check_reduce(reduce)
    check_noise_level(noise_level, kind)
    _check_decreasing(sigma, sigma_next)
    mean, std = sde_mean_std(x, v, sigma, sigma_next, kind=kind, noise_level=noise_level)
    scale = _per_sample(noise_scale, x)
    if not (scale > 0).all():
        raise ValueError(f"noise_scale must be > 0, got {_show(noise_scale)}")
    std = std * scale
    if prev_sample is None:
        if noise is None:
            noise = standard_normal(x.shape, generator, x.device)
        elif noise.shape != x.shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)} but x has shape {tuple(x.shape)}")
        prev_sample = (mean + std * noise.float()).to(x.dtype)
    elif prev_sample.shape != x.shape:
        raise ValueError(f"prev_sample has shape {tuple(prev_sample.shape)} but x has shape {tuple(x.shape)}")
    log_prob = gaussian_log_prob(prev_sample, mean, std, reduce)
    return StepOutput(prev_sample, mean, std.reshape(std.shape[0]), log_prob)


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


def _per_sample(value: float | Tensor, like: Tensor) -> Tensor:
    """A scalar or ``[batch]`` value as an fp32 tensor of shape ``[batch or 1, 1, ..., 1]`` on ``like``'s device."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.reshape(1)
    if value.ndim != 1 or value.shape[0] not in (1, like.shape[0]):
        raise ValueError(f"expected a scalar or a [batch={like.shape[0]}] tensor, got shape {tuple(value.shape)}")
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def _check_decreasing(sigma: float | Tensor, sigma_next: float | Tensor) -> None:
    s = torch.as_tensor(sigma, dtype=torch.float32)
    s_next = torch.as_tensor(sigma_next, dtype=torch.float32)
    if (s_next >= s).any() or (s > 1).any() or (s_next < 0).any():
        raise ValueError(
            f"a step needs 1 >= sigma > sigma_next >= 0 (sigmas decrease from noise to data), got sigma={_show(sigma)} "
            f"and sigma_next={_show(sigma_next)}"
        )


def _show(value: float | Tensor) -> str:
    if isinstance(value, Tensor):
        return str([round(x, 6) for x in value.detach().float().flatten()[:8].tolist()]) if value.ndim else f"{value.item():.6g}"
    return repr(value)
