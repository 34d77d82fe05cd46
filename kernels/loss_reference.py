"""Plain torch reference of the GRPO loss of a batch of transitions, per transition.

For transition ``n`` with policy velocity ``v`` (Flow-GRPO, Liu et al. 2025, eq. 6; PPO, Schulman et al. 2017):

    mu, std    = the SDE step's mean and std at (x_t, v)              (sde_reference.sde_mean_std, times noise scale)
    log_prob   = log N(x_next; mu, std^2), reduced by mean or sum     (sde_reference.gaussian_log_prob)
    ratio      = exp(log_prob - old_log_prob)
    policy     = -w * min(A ratio, A clip(ratio, 1 - eps, 1 + eps))
    loss       = policy + beta * KL

with the KL either Flow-GRPO's latent-mean KL ``mean_dims (mu - mu_ref)^2 / (2 s^2)`` (``mu_ref`` from the reference
velocity ``v_ref``) or UniGRPO's velocity MSE ``mean_dims (v - v_ref)^2``. The trainer's loss is the mean over
transitions. This is the CPU implementation and the reference of the fused Triton loss (``loss_triton``).

The latent-mean KL's ``s`` (``kl_std``, ``kl_std_scale``):

* ``std_t`` (flow_grpo's released ``train_sd3.py``, which divides by ``2 std_dev_t^2``): the SDE's diffusion
  coefficient, the transition std without the step's ``sqrt(-dt)``, ``s = std / sqrt(sigma - sigma_next)``. The KL is
  then the exact KL of the two Gaussian transitions times ``|dt|``. ``cps`` steps have no ``sqrt(-dt)`` in their std
  (the released code's ``std_dev_t`` is the transition std there), so for them ``s = std`` in both readings.
* ``transition``: the transition std itself, ``s = std``: the exact KL between the policy's and the reference's
  Gaussian transitions, ``1/|dt|`` times the ``std_t`` reading (about 9x on a 10-step schedule).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .sde_kinds import sde_kind
from .sde_reference import gaussian_log_prob, per_sample, sde_mean_std

KL_FORMS = ("latent_mean", "velocity_mse")
KL_STDS = ("std_t", "transition")


class TransitionLoss(NamedTuple):
    """Per-transition ``[N]`` fp32 results. ``loss = policy + beta * kl``; ``kl`` is 0 without a reference velocity."""

    loss: Tensor
    policy: Tensor
    log_prob: Tensor
    kl: Tensor


def check_loss_settings(clip_range: float, beta: float, *, kl_given: bool, kl_source: str) -> None:
    """The PPO clip range must be > 0 and the KL coefficient >= 0; ``beta > 0`` needs the KL's input
    (``kl_source`` names it in the message)."""
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0, got {clip_range!r}")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if beta > 0 and not kl_given:
        raise ValueError(f"beta={beta} needs {kl_source}")


def clipped_policy_loss(log_ratio: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """PPO's clipped surrogate per transition, ``-min(A ratio, A clip(ratio, 1 - eps, 1 + eps))``, unweighted."""
    ratio = torch.exp(log_ratio)
    unclipped = advantages * ratio
    clipped = advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return -torch.minimum(unclipped, clipped)


def grpo_transition_loss_reference(
    v: Tensor,
    x_t: Tensor,
    x_next: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    kind: str,
    noise_level: Tensor,
    noise_scale: float | Tensor = 1.0,
    reduce: str = "mean",
    clip_range: float,
    weights: Tensor | None = None,
    v_ref: Tensor | None = None,
    beta: float = 0.0,
    kl: str = "latent_mean",
    kl_std: str = "std_t",
) -> TransitionLoss:
    """The per-transition loss (module docstring) by torch autograd: gradients reach ``v``; the rest is constant."""
    mean, std = sde_mean_std(x_t, v, sigma, sigma_next, kind=kind, noise_level=noise_level)
    std = std * per_sample(noise_scale, x_t)
    log_prob = gaussian_log_prob(x_next, mean, std, reduce)
    policy = clipped_policy_loss(log_prob - old_log_prob.detach().float(), advantages.detach().float(), clip_range)
    if weights is not None:
        policy = weights.detach().float() * policy
    divergence = torch.zeros_like(log_prob) if v_ref is None else transition_kl(
        x_t, v, v_ref, mean, std, sigma, sigma_next, kind=kind, noise_level=noise_level, kl=kl, kl_std=kl_std)
    loss = policy + beta * divergence if beta > 0 else policy
    return TransitionLoss(loss, policy, log_prob, divergence)


def transition_kl(x_t: Tensor, v: Tensor, v_ref: Tensor, mean: Tensor, std: Tensor, sigma: Tensor, sigma_next: Tensor,
                  *, kind: str, noise_level: Tensor, kl: str, kl_std: str = "std_t") -> Tensor:
    """Per-transition KL to the reference velocity ``v_ref``: between the transition means in latent space
    (``latent_mean``, with the policy's ``mean``, and ``std`` of the step read as ``kl_std`` says: module docstring)
    or the velocity MSE (``velocity_mse``)."""
    if kl == "latent_mean":
        ref_mean, _ = sde_mean_std(x_t, v_ref.detach(), sigma, sigma_next, kind=kind, noise_level=noise_level)
        return latent_mean_kl(mean, ref_mean, kl_std_scale(std, sigma, sigma_next, kind, kl_std))
    return velocity_mse_kl(v, v_ref.detach())


def kl_std_scale(std: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, kind: str, kl_std: str) -> Tensor:
    """The ``s`` of the latent-mean KL's ``2 s^2`` per transition (module docstring): the transition ``std``
    (``[N]`` or ``[N, 1, ...]``) for ``transition`` and for a kind registered with ``kl_std_t=False`` (``cps``), else ``std / sqrt(sigma - sigma_next)``
    (``std_t``, flow_grpo's released code). fp32, the shape of ``std``."""
    if kl_std not in KL_STDS:
        raise ValueError(f"unknown kl_std {kl_std!r}: expected one of {', '.join(KL_STDS)}")
    std = std.float()
    if kl_std == "transition" or not sde_kind(kind).kl_std_t:
        return std
    step = per_sample(sigma, std) - per_sample(sigma_next, std)
    return std / torch.sqrt(step.clamp_min(1e-12))


def latent_mean_kl(mean: Tensor, ref_mean: Tensor, std: Tensor, reduce: str = "mean") -> Tensor:
    """KL between the policy's and the reference's Gaussian transitions with a shared std (Flow-GRPO's KL).

    ``KL(N(mu_theta, std^2) || N(mu_ref, std^2)) = (mu_theta - mu_ref)^2 / (2 std^2)`` per dimension, reduced over all
    non-batch dimensions by ``mean`` (the Flow-GRPO convention, matching the ``mean`` log-prob) or ``sum``. ``std`` is
    the transition std (``Transitions.std``), ``[N]`` or broadcastable ``[N, 1, ...]``. Rows with ``std == 0`` are
    deterministic (ODE) transitions and get 0, as in ``gaussian_log_prob``. Returns ``[N]`` fp32.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"unknown reduction {reduce!r}: expected 'mean' or 'sum'")
    if mean.shape != ref_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)} and ref_mean {tuple(ref_mean.shape)} must have the same shape")
    std = _per_row(std, mean).float()
    stochastic = std > 0
    safe_std = torch.where(stochastic, std, torch.ones_like(std))
    kl = (mean.float() - ref_mean.float()) ** 2 / (2 * safe_std**2)
    kl = torch.where(stochastic, kl, torch.zeros_like(kl))
    dims = tuple(range(1, mean.ndim))
    return kl.mean(dim=dims) if reduce == "mean" else kl.sum(dim=dims)


def velocity_mse_kl(v: Tensor, v_ref: Tensor) -> Tensor:
    """UniGRPO's KL surrogate: ``mean over non-batch dims of (v_theta - v_ref)^2``, ``[N]`` fp32."""
    if v.shape != v_ref.shape:
        raise ValueError(f"v {tuple(v.shape)} and v_ref {tuple(v_ref.shape)} must have the same shape")
    return ((v.float() - v_ref.float()) ** 2).mean(dim=tuple(range(1, v.ndim)))


def _per_row(std: Tensor, like: Tensor) -> Tensor:
    """``std`` as ``[N, 1, ..., 1]`` (from ``[N]``) or as given when it already broadcasts against ``like``."""
    std = torch.as_tensor(std, device=like.device)
    if std.ndim == 1:
        if std.shape[0] != like.shape[0]:
            raise ValueError(f"std has {std.shape[0]} rows but mean has {like.shape[0]}")
        return std.reshape(-1, *([1] * (like.ndim - 1)))
    try:
        torch.broadcast_shapes(std.shape, like.shape)
    except RuntimeError:
        raise ValueError(f"std of shape {tuple(std.shape)} does not broadcast to {tuple(like.shape)}") from None
    return std
