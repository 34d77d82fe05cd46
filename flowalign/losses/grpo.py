"""The GRPO loss over a minibatch of transitions, its KL terms, and per-step weights.

Every trained unit is one transition ``x_t -> x_{t+1}`` (DESIGN.md §3); this module sees only per-transition tensors.

PPO-clip objective (Flow-GRPO, Liu et al. 2025, eq. 6; Schulman et al. 2017), per transition ``n``:

    ratio_n = exp(log_prob_n - old_log_prob_n)
    L_n     = -w_n * min(A_n ratio_n, A_n clip(ratio_n, 1 - eps, 1 + eps))
    loss    = mean_n L_n + beta * mean_n KL_n

``old_log_prob`` is the log-prob the rollout stored and is treated as a constant; with Flow-GRPO's ``mean`` log-prob
reduction the clip range is tiny (around 1e-4). All arithmetic is fp32: bf16 log-probs drift, so the ratio would not
be 1 on the first inner step (DESIGN.md §5).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowalign.kernels import clipped_policy_loss, grpo_transition_loss
from flowalign.kernels.loss_reference import check_loss_settings, latent_mean_kl, velocity_mse_kl

__all__ = ["grpo_loss", "latent_mean_kl", "noise_aware_weights", "transition_grpo_loss", "velocity_mse_kl"]


def grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    weights: Tensor | None = None,
    kl: Tensor | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped GRPO loss (formula in the module docstring) and its detached stats, from per-transition log-probs.

    The readable reference of ``transition_grpo_loss`` (the one training calls, which computes the log-prob and KL
    from the velocity in the same op): tests/test_loss.py checks the two agree on the same transitions.

    All inputs are ``[N]``; gradients flow through ``log_prob`` and ``kl`` only (``old_log_prob``, ``advantages`` and
    ``weights`` are constants). ``weights`` defaults to 1. ``kl`` (per transition, e.g. ``latent_mean_kl``) enters the
    loss as ``beta * mean(kl)``; it is logged even when ``beta`` is 0.

    Stats: ``loss``, ``policy_loss``, ``kl`` (mean, 0 without ``kl``), ``approx_kl`` = mean of
    ``0.5 (log_prob - old_log_prob)^2``, ``clip_frac`` = fraction with ``|ratio - 1| > eps``, ``ratio_mean`` and
    ``ratio_max``.
    """
    check_loss_settings(clip_range, beta, kl_given=kl is not None, kl_source="a per-transition kl tensor")
    if log_prob.ndim != 1 or log_prob.numel() == 0:
        raise ValueError(f"log_prob must be a non-empty 1-D tensor [N], got shape {tuple(log_prob.shape)}")
    n = log_prob.shape
    _check_shape("old_log_prob", old_log_prob, n)
    _check_shape("advantages", advantages, n)

    log_ratio = log_prob.float() - old_log_prob.detach().float()
    per_transition = clipped_policy_loss(log_ratio, advantages.detach().float(), clip_range)
    if weights is not None:
        _check_shape("weights", weights, n)
        per_transition = weights.detach().float() * per_transition
    policy_loss = per_transition.mean()

    kl_mean = torch.zeros((), device=log_prob.device)
    if kl is not None:
        _check_shape("kl", kl, n)
        kl_mean = kl.float().mean()
    loss = policy_loss + beta * kl_mean if beta > 0 else policy_loss

    return loss, loss_stats(loss, policy_loss, kl_mean, log_ratio, clip_range)


def transition_grpo_loss(
    v: Tensor,
    x_t: Tensor,
    x_next: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float,
    **transition,
) -> tuple[Tensor, dict[str, float]]:
    """``grpo_loss`` straight from the policy velocity: the log-prob of ``x_t -> x_next``, the KL to ``v_ref`` and the
    clipped loss in one op (``flowalign.kernels.grpo_transition_loss``, whose keywords ``transition`` passes on: the
    SDE ``kind``, ``noise_level``, ``weights``, ``v_ref``, ``beta``, ``kl``, ``backend``...; fused Triton forward and
    backward on CUDA, the torch reference elsewhere). Same loss (``mean_n (w_n L_n + beta KL_n)``) and stats as
    ``grpo_loss``."""
    rows = grpo_transition_loss(v, x_t, x_next, sigma, sigma_next, old_log_prob, advantages, clip_range=clip_range,
                                **transition)
    loss = rows.loss.mean()
    log_ratio = rows.log_prob.detach() - old_log_prob.detach().float()
    return loss, loss_stats(loss, rows.policy.mean(), rows.kl.mean(), log_ratio, clip_range)


def loss_stats(loss: Tensor, policy_loss: Tensor, kl: Tensor, log_ratio: Tensor, clip_range: float) -> dict[str, float]:
    """Detached scalars to log: the loss and its parts, ``approx_kl`` = mean ``0.5 log_ratio^2``, ``clip_frac``, and
    the mean and max ratio."""
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        return {
            "loss": float(loss),
            "policy_loss": float(policy_loss),
            "kl": float(kl),
            "approx_kl": float((0.5 * log_ratio**2).mean()),
            "clip_frac": float(((ratio - 1.0).abs() > clip_range).float().mean()),
            "ratio_mean": float(ratio.mean()),
            "ratio_max": float(ratio.max()),
        }


def noise_aware_weights(std: Tensor, stochastic_mask: Tensor | None = None) -> Tensor:
    """TempFlow-GRPO's noise-aware step weights ``w_t = c * std_t sqrt(-dt)`` (He et al. 2025, "TempFlow-GRPO").

    ``std`` is the transition std ``std_t sqrt(-dt)`` the rollout stores in ``Transitions.std``. ``c`` makes the mean
    weight over the trained transitions (``stochastic_mask``, all of them by default) exactly 1, so the loss keeps
    its scale; untrained transitions get weight 0. Returns ``[N]`` fp32, detached.
    """
    std = std.detach().float()
    if std.ndim != 1 or std.numel() == 0:
        raise ValueError(f"std must be a non-empty 1-D tensor [N], got shape {tuple(std.shape)}")
    if stochastic_mask is None:
        mask = torch.ones_like(std, dtype=torch.bool)
    else:
        mask = torch.as_tensor(stochastic_mask, device=std.device)
        if mask.shape != std.shape or mask.dtype != torch.bool:
            raise ValueError(f"stochastic_mask must be a bool tensor of shape {tuple(std.shape)}, got {mask.dtype} "
                             f"{tuple(mask.shape)}")
    trained = std[mask]
    if not torch.isfinite(trained).all() or (trained < 0).any():
        raise ValueError("transition stds of trained transitions must be finite and >= 0")
    if trained.numel() == 0 or not trained.sum() > 0:
        raise ValueError("noise-aware weights need at least one trained transition with std > 0")
    c = 1.0 / trained.mean()
    return torch.where(mask, c * std, torch.zeros_like(std))


def _check_shape(name: str, tensor: Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} like log_prob, got {tuple(tensor.shape)}")


