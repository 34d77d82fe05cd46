"""Flow-DPPO: Flow-GRPO's ratio clip replaced by a divergence mask (the ``grpo`` loss's ``trust_region: dppo``).

"Flow-DPPO: Divergence Proximal Policy Optimization" (arXiv 2606.11025, 2026). Code: Tencent-Hunyuan/UniRL@1a7b501
``unirl/algorithms/flowdppo.py`` (``_flowdppo_kl_adv_loss``, ``FlowDPPO._compute_sigma_t``) and verl-project/
verl-omni@a1139ba ``verl_omni/trainer/diffusion/diffusion_algos.py::FlowDPPOLoss``. flowalign matches the two codes.

Every SDE step is a Gaussian with the same std ``sigma = std_t sqrt(-dt)`` under the policy and under the rollout's
(old) policy, so their KL is a function of the two step means alone. Per transition ``n`` (or per sample and step
``[B, S]``), with ``rho = exp(log p_theta - log p_old)``:

    D_n     = mean_d (mu_theta - mu_old)^2 / (2 sigma^2)     (add_kl_coefficient; else mean_d (mu_theta - mu_old)^2 / 2)
    drop_n  = D_n >= delta  and  ((rho_n > 1 and A_n > 0)  or  (rho_n < 1 and A_n < 0))
    L       = mean_n where(drop_n, 0, -A_n rho_n)

A step that moved the policy little (``D < delta``) always trains, and so does a step whose ratio moved against its
advantage (a correction); only a step that has already moved far *in the advantage's direction* is dropped. There is no
ratio clip and no advantage clamp. ``D`` decides the mask only: no gradient flows through it.

Code vs docs: the docs say ``D > delta``, both codes ``>=`` (kept); the paper sums over latent dimensions, both codes
take the mean (``kl_reduction: mean``, ``sum`` the paper's reading). A masked ratio that overflowed to ``inf`` gives a
finite loss but, in the released code, a NaN gradient (``where``'s backward multiplies 0 by ``inf``): here the masked
elements' ratio is computed from a zeroed log-ratio, so their gradient is exactly 0 and every other value and gradient
is the released one.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["KL_REDUCTIONS", "flow_dppo_loss", "unirl_sigma"]

KL_REDUCTIONS = ("mean", "sum")


def _broadcast_sigma(sigma: Tensor | float, layout: torch.Size, mean_ndim: int, like: Tensor) -> Tensor:
    """``sigma`` as a tensor broadcastable to the means: a scalar, a tensor broadcastable to the log-prob layout
    (``[N]``, ``[B, S]``, ``[S]``, ``[B, 1]``), or one already shaped like the means (``[1, S, 1, 1, 1]``)."""
    sigma = torch.as_tensor(sigma, device=like.device).to(like.dtype)
    if sigma.ndim > len(layout):  # shaped for the means: plain broadcasting, as the released codes do
        try:
            torch.broadcast_shapes(sigma.shape, like.shape)
        except RuntimeError:
            raise ValueError(f"sigma of shape {tuple(sigma.shape)} broadcasts neither to the log-probs "
                             f"{tuple(layout)} nor to the means {tuple(like.shape)}") from None
        return sigma
    try:
        sigma = sigma.expand(layout) if sigma.ndim else sigma
    except RuntimeError:
        raise ValueError(f"sigma of shape {tuple(sigma.shape)} does not broadcast to the log-probs "
                         f"{tuple(layout)}") from None
    return sigma.reshape(*sigma.shape, *([1] * (mean_ndim - sigma.ndim)))


def flow_dppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    sigma: Tensor | float | None,
    *,
    kl_mask_threshold: float = 1e-5,
    add_kl_coefficient: bool = True,
    kl_reduction: Literal["mean", "sum"] = "mean",
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-DPPO's loss (module docstring) and its per-element stats.

    ``log_prob``, ``old_log_prob`` ``[N]`` or ``[B, S]``; ``advantages`` the same shape (or ``[B]``, broadcast over
    the steps as UniRL does); ``mean`` (``mu_theta``) and ``old_mean`` (``mu_old``) ``[N, ...]`` / ``[B, S, ...]``;
    ``sigma`` the step's transition std ``std_t sqrt(-dt)``, a scalar or broadcastable to the log-probs or to the means
    (unused, and may be None, when ``add_kl_coefficient`` is off). ``weights`` (optional, e.g. rollout-correction
    weights) multiply each element's loss, as verl-omni's ``rollout_is_weights``.

    Gradients reach ``log_prob`` only: ``old_log_prob``, ``advantages`` and the means are constants (the means only
    decide the mask). The arithmetic keeps the inputs' dtype (float64 stays float64; float32 at least).

    Stats (detached tensors of the log-prob layout): ``kl`` (``D``), ``keep`` (bool, the elements that train),
    ``pos_masked`` / ``neg_masked`` (dropped with ``A > 0`` / ``A < 0``) and ``ratio``."""
    if kl_reduction not in KL_REDUCTIONS:
        raise ValueError(f"unknown kl_reduction {kl_reduction!r}: expected one of {', '.join(KL_REDUCTIONS)}")
    if log_prob.ndim not in (1, 2) or log_prob.numel() == 0:
        raise ValueError(f"log_prob must be a non-empty [N] or [B, S] tensor, got {tuple(log_prob.shape)}")
    layout = log_prob.shape
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    if old_log_prob.shape != layout:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)} must have log_prob's shape {tuple(layout)}")
    adv = advantages.detach().to(dtype)
    if adv.shape != layout:
        if log_prob.ndim == 2 and adv.shape in (layout[:1], (layout[0], 1)):
            adv = adv.reshape(-1, 1).expand(layout)
        else:
            raise ValueError(f"advantages {tuple(advantages.shape)} must have log_prob's shape {tuple(layout)} "
                             f"(or [B] for a [B, S] layout)")
    if mean.shape != old_mean.shape or mean.shape[:len(layout)] != layout:
        raise ValueError(f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must be the same shape, "
                         f"starting with the log-probs' {tuple(layout)}")

    with torch.no_grad():
        square = (mean.detach().to(dtype) - old_mean.detach().to(dtype)) ** 2
        if add_kl_coefficient:
            if sigma is None:
                raise ValueError("add_kl_coefficient needs sigma (the step's std_t sqrt(-dt))")
            per_dim = square / (2 * _broadcast_sigma(sigma, layout, mean.ndim, square) ** 2)
        else:
            per_dim = square / 2
        dims = tuple(range(len(layout), mean.ndim))
        if not dims:
            divergence = per_dim
        else:
            divergence = per_dim.mean(dim=dims) if kl_reduction == "mean" else per_dim.sum(dim=dims)

    log_ratio = log_prob.to(dtype) - old_log_prob.detach().to(dtype)
    ratio = torch.exp(log_ratio.detach())
    high = divergence >= kl_mask_threshold  # the released >=
    pos_masked = high & (ratio > 1.0) & (adv > 0)
    neg_masked = high & (ratio < 1.0) & (adv < 0)
    keep = ~(pos_masked | neg_masked)
    # A dropped element's ratio is exp(0): the same zero loss, and a zero gradient even where exp(log_ratio) is inf.
    kept_ratio = torch.exp(torch.where(keep, log_ratio, torch.zeros_like(log_ratio)))
    per_element = torch.where(keep, -adv * kept_ratio, torch.zeros((), dtype=dtype, device=log_prob.device))
    if weights is not None:
        if weights.shape != layout:
            raise ValueError(f"weights {tuple(weights.shape)} must have log_prob's shape {tuple(layout)}")
        per_element = per_element * weights.detach().to(dtype)
    stats = {"kl": divergence, "keep": keep, "pos_masked": pos_masked, "neg_masked": neg_masked, "ratio": ratio}
    return per_element.mean(), stats


def unirl_sigma(sigma: Tensor, sigma_next: Tensor, noise_level: Tensor | float) -> Tensor:
    """UniRL's ``sigma_t`` of the divergence (``FlowDPPO._compute_sigma_t``): the flow_grpo kind's transition std
    with ``s`` clamped to 0.99 in the denominator, ``a sqrt(s / (1 - min(s, 0.99))) sqrt(s - s_next)``; at ``s = 1``
    that is ``10 a sqrt(-dt)`` where flowalign's sampler (and verl-omni) use ``1 - s_next`` in the denominator
    (``sigma_at_one: clamp_0.99``). fp32 ``[N]``."""
    s, s_next = sigma.float(), sigma_next.float()
    std_t = torch.sqrt(s / (1.0 - s.clamp(max=0.99))) * torch.as_tensor(noise_level, dtype=torch.float32,
                                                                         device=s.device)
    return std_t * torch.sqrt(s - s_next)


def dppo_transition_loss(
    v: Tensor,
    v_old: Tensor,
    x_t: Tensor,
    x_next: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    advantages: Tensor,
    *,
    kind: str,
    noise_level: Tensor,
    noise_scale: Tensor | float = 1.0,
    reduce: str = "mean",
    kl_mask_threshold: float = 1e-5,
    add_kl_coefficient: bool = True,
    kl_reduction: str = "mean",
    sigma_at_one: str = "sampler",
    weights: Tensor | None = None,
    v_ref: Tensor | None = None,
    beta: float = 0.0,
    kl: str = "latent_mean",
    kl_std: str = "std_t",
) -> tuple[Tensor, dict[str, float]]:
    """``flow_dppo_loss`` from the policy velocity ``v`` and the rollout's ``v_old`` (``Transitions.velocity``):
    ``mu_theta`` and ``mu_old`` are the SDE step's means at the two velocities, the std the sampler's (times the
    transition's noise scale), and both log-probs are ``log N(x_next; mu, std^2)`` by the same function, so at the
    rollout's own weights the ratio is exactly 1 and ``D`` exactly 0 on every backend (UniRL's ``old_logp_source:
    replay``; on the CPU it is bitwise the rollout's stored log-prob). ``sigma_at_one: clamp_0.99`` takes ``D``'s
    sigma from ``unirl_sigma`` (flow_grpo kind only). Plus ``beta`` times the KL to ``v_ref`` (the ``grpo`` loss's
    options). Stats: the ``grpo`` loss's (``clip_frac`` is the dropped fraction) and ``dppo/*``."""
    from flowalign.kernels.loss_reference import transition_kl
    from flowalign.kernels.sde_reference import gaussian_log_prob, per_sample, sde_mean_std

    mean, std = sde_mean_std(x_t, v, sigma, sigma_next, kind=kind, noise_level=noise_level)
    old_mean, _ = sde_mean_std(x_t, v_old.detach(), sigma, sigma_next, kind=kind, noise_level=noise_level)
    std = std * per_sample(noise_scale, x_t)
    log_prob = gaussian_log_prob(x_next, mean, std, reduce)
    old_log_prob = gaussian_log_prob(x_next, old_mean, std, reduce).detach()
    if sigma_at_one == "clamp_0.99":
        if kind != "flow_grpo":
            raise ValueError(f"sigma_at_one='clamp_0.99' is UniRL's flow_grpo sigma, but the steps are {kind!r}")
        divergence_sigma = unirl_sigma(sigma, sigma_next, noise_level) * per_sample(noise_scale, x_t).reshape(-1)
    elif sigma_at_one == "sampler":
        divergence_sigma = std.reshape(-1)
    else:
        raise ValueError(f"unknown sigma_at_one {sigma_at_one!r}: expected 'sampler' or 'clamp_0.99'")
    policy_loss, rows = flow_dppo_loss(log_prob, old_log_prob, advantages, mean, old_mean, divergence_sigma,
                                       kl_mask_threshold=kl_mask_threshold, add_kl_coefficient=add_kl_coefficient,
                                       kl_reduction=kl_reduction, weights=weights)
    kl_rows = torch.zeros_like(log_prob) if v_ref is None else transition_kl(
        x_t, v, v_ref, mean, std, sigma, sigma_next, kind=kind, noise_level=noise_level, kl=kl, kl_std=kl_std)
    kl_mean = kl_rows.mean()
    loss = policy_loss + beta * kl_mean if beta > 0 else policy_loss
    with torch.no_grad():
        log_ratio = log_prob.detach() - old_log_prob
        ratio = rows["ratio"]
        dropped = (~rows["keep"]).float()
        stats = {"loss": float(loss), "policy_loss": float(policy_loss), "kl": float(kl_mean),
                 "approx_kl": float((0.5 * log_ratio**2).mean()), "clip_frac": float(dropped.mean()),
                 "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()),
                 "dppo/divergence_mean": float(rows["kl"].mean()), "dppo/divergence_max": float(rows["kl"].max()),
                 "dppo/high_divergence_frac": float((rows["kl"] >= kl_mask_threshold).float().mean()),
                 "dppo/pos_masked_frac": float(rows["pos_masked"].float().mean()),
                 "dppo/neg_masked_frac": float(rows["neg_masked"].float().mean())}
    return loss, stats
