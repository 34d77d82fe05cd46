"""Plain torch reference of one SDE transition: its mean, std, sample and exact Gaussian log-prob.

This is the math every sampler uses on CPU and the reference the Triton kernel (``sde_triton``) is tested against.
The formulas of the three kinds are in ``flowalign.samplers.sde`` (docs/design/math.md#sde-steps): ``flow_grpo`` (Liu et
al. 2025,
"Flow-GRPO", eq. 9), ``dance`` (Xue et al. 2025, "DanceGRPO") and ``cps`` (Wang & Yu 2025, coefficient-preserving
sampling). All arithmetic is fp32 whatever the input dtype.
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


def max_noise_level(kind: str) -> float | None:
    """The largest noise level ``kind`` takes (None: no bound): 1 for ``cps``, whose ``sin(a pi / 2)`` must not
    exceed 1."""
    return 1.0 if kind == "cps" else None


def check_noise_level(noise_level: float | Tensor, kind: str | None = None) -> None:
    """Noise levels are >= 0 for every kind, and at most ``max_noise_level(kind)``."""
    level = torch.as_tensor(noise_level, dtype=torch.float32)
    if torch.isnan(level).any() or (level < 0).any():
        raise ValueError(f"noise_level must be >= 0 (0 means a deterministic ODE step), got {show_values(noise_level)}")
    high = None if kind is None else max_noise_level(kind)
    if high is not None and (level > high).any():
        raise ValueError(f"noise_level for kind {kind!r} must lie in [0, {high:g}], got {show_values(noise_level)}")


def sde_mean_std(
    x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, *, kind: str, noise_level: float | Tensor
) -> tuple[Tensor, Tensor]:
    """Mean ``mu`` (fp32, shape of ``x``) and transition std (fp32, broadcastable ``[batch, 1, ...]``)."""
    x, v = x.float(), v.float()
    s, s_next, a = per_sample(sigma, x), per_sample(sigma_next, x), per_sample(noise_level, x)
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


def per_sample(value: float | Tensor, like: Tensor) -> Tensor:
    """A scalar or ``[batch]`` value as an fp32 tensor of shape ``[batch or 1, 1, ..., 1]`` on ``like``'s device."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.reshape(1)
    if value.ndim != 1 or value.shape[0] not in (1, like.shape[0]):
        raise ValueError(f"expected a scalar or a [batch={like.shape[0]}] tensor, got shape {tuple(value.shape)}")
    return value.reshape(-1, *([1] * (like.ndim - 1)))


def check_step(sigma: float | Tensor, sigma_next: float | Tensor) -> None:
    s = torch.as_tensor(sigma, dtype=torch.float32)
    s_next = torch.as_tensor(sigma_next, dtype=torch.float32)
    if (s_next >= s).any() or (s > 1).any() or (s_next < 0).any():
        raise ValueError(
            f"a step needs 1 >= sigma > sigma_next >= 0 (sigmas decrease from noise to data), got sigma={show_values(sigma)} "
            f"and sigma_next={show_values(sigma_next)}"
        )


def check_step_values(
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    noise_level: float | Tensor,
    noise_scale: float | Tensor = 1.0,
    kind: str | None = None,
) -> None:
    """``check_step`` and ``check_noise_level``, and noise scales > 0, for scalars or ``[batch]`` tensors, at the cost
    of at most one device sync: the conditions are reduced where the values live, those on an accelerator are combined
    and read once, and the messages are built only when one fails (a loss or step called every iteration on CUDA
    would otherwise wait for the device once per condition)."""
    s, s_next, level, scale = (torch.as_tensor(v) for v in (sigma, sigma_next, noise_level, noise_scale))
    failed = [(s_next >= s).any(), (s > 1).any(), (s_next < 0).any(), (~(level >= 0)).any(), (~(scale > 0)).any()]
    if kind == "cps":
        failed.append((level > 1).any())
    by_device: dict[torch.device, list[Tensor]] = {}
    for flag in failed:
        by_device.setdefault(flag.device, []).append(flag)
    if any(bool(torch.stack(flags).any()) for flags in by_device.values()):
        check_noise_level(noise_level, kind)
        check_step(sigma, sigma_next)
        raise ValueError(f"noise_scale must be > 0, got {show_values(noise_scale)}")


def show_values(value: float | Tensor) -> str:
    if isinstance(value, Tensor):
        return str([round(x, 6) for x in value.detach().float().flatten()[:8].tolist()]) if value.ndim else f"{value.item():.6g}"
    return repr(value)


def sde_step_reference(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    kind: str,
    noise_level: float | Tensor,
    noise_scale: float | Tensor = 1.0,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    reduce: str = "mean",
) -> StepOutput:
    """One SDE transition in plain torch: ``x' = mu + c std noise`` (or the given ``prev_sample``) and its log-prob.

    Exactly one of ``noise`` (standard normal, shape of ``x``) and ``prev_sample`` is given. ``noise_scale`` ``c``
    widens the draw, and the log-prob uses ``c std``, the std that produced the sample. The sample is rounded to
    ``x.dtype`` before it is scored, so re-scoring the stored sample later gives the same log-prob.
    """
    mean, std = sde_mean_std(x, v, sigma, sigma_next, kind=kind, noise_level=noise_level)
    std = std * per_sample(noise_scale, x)
    if prev_sample is None:
        prev_sample = (mean + std * noise.float()).to(x.dtype)
    log_prob = gaussian_log_prob(prev_sample, mean, std, reduce)
    return StepOutput(prev_sample, mean, std.reshape(std.shape[0]), log_prob)
