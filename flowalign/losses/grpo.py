"""The GRPO loss over a minibatch of transitions and its KL terms (the per-step weights: ``flowalign.credit.steps``).

Every trained unit is one transition ``x_t -> x_{t+1}`` (docs/design/math.md#iteration); this module sees only
per-transition tensors.

PPO-clip objective (Flow-GRPO, Liu et al. 2025, eq. 6; Schulman et al. 2017), per transition ``n``:

    ratio_n = exp(log_prob_n - old_log_prob_n)
    L_n     = -w_n * min(A_n ratio_n, A_n clip(ratio_n, 1 - eps, 1 + eps))
    loss    = mean_n L_n + beta * mean_n KL_n

``old_log_prob`` is the log-prob the rollout stored and is treated as a constant; with Flow-GRPO's ``mean`` log-prob
reduction the clip range is tiny (around 1e-4). All arithmetic is fp32: bf16 log-probs drift, so the ratio would not
be 1 on the first inner step (docs/design/math.md#first-ratio).
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowalign.kernels import clipped_policy_loss, grpo_transition_loss
from flowalign.kernels.loss_reference import check_loss_settings, latent_mean_kl, velocity_mse_kl

__all__ = ["grpo_loss", "latent_mean_kl", "transition_grpo_loss", "velocity_mse_kl"]


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


def _check_shape(name: str, tensor: Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} like log_prob, got {tuple(tensor.shape)}")




# ------------------------------------------------------------------------------------------------ the term

from dataclasses import dataclass  # noqa: E402
from typing import Literal  # noqa: E402

from flowalign.components import ComponentConfig  # noqa: E402
from flowalign.losses import LossTerm, MicroBatch, PolicyOutput, register_loss  # noqa: E402
from flowalign.settings import finite, option  # noqa: E402


@dataclass
class GRPOLossConfig(ComponentConfig):
    clip_range: float = option(1e-4, "PPO ratio clip range: ratios outside [1 - c, 1 + c] get no gradient")
    beta: float = option(0.0, "weight of the KL penalty to the reference model; 0 = none")
    kl: Literal["latent_mean", "velocity_mse"] = option(
        "latent_mean", "KL estimate: between the transition means in latent space, or the velocity MSE")

    def validate(self) -> None:
        finite("clip_range", self.clip_range, 0.0, strict=True)
        finite("beta", self.beta, 0.0)


@register_loss("grpo", config=GRPOLossConfig)
class GRPOLoss(LossTerm):
    """the PPO-clipped GRPO loss on each transition's recomputed log-prob, plus beta * KL to the reference."""

    def wants_reference(self) -> bool:
        """A KL penalty, or the velocity MSE logged, needs the reference velocity."""
        return self.config.beta > 0 or self.config.kl == "velocity_mse"

    def loss(self, micro: MicroBatch, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        st, cfg = micro.transitions, self.config
        x_t, x_next = st.x_t, st.x_next
        if st.log_prob_shift is not None:  # a guided rollout's log-prob under its guided mean (samplers.sde_step)
            from flowalign.samplers.sde import guided_log_prob_sample

            x_t, x_next = x_t.float(), guided_log_prob_sample(x_next, st.log_prob_shift)
        # Log-prob, ratio, clip and KL in one op: fused Triton forward and backward on CUDA (model.kernels).
        return transition_grpo_loss(
            policy.v, x_t, x_next, st.sigma, st.sigma_next, st.log_prob, micro.advantages, kind=st.kind,
            noise_level=st.noise_level, noise_scale=st.noise_scale, reduce=st.reduce, clip_range=cfg.clip_range,
            weights=micro.weights, v_ref=policy.v_ref if self.wants_reference() else None, beta=cfg.beta, kl=cfg.kl,
            backend=self.backend,
        )

    def set_up(self, parts) -> None:
        self.backend = parts.config.model.kernels

    backend = "auto"
