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

GRPO-Guard (Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via Regulated
Clipping", arXiv 2510.22319; code ``scripts/train_sd3_GRPO_Guard.py`` of yifan123/flow_grpo), two options of the
term, both off by default:

* **RatioNorm** (``ratio_norm``). Every SDE step is Gaussian, ``x' = mu_old + sigma xi``, so with
  ``Delta = mu_theta - mu_old`` the mean-reduced log-ratio is ``mean_d(xi Delta) / sigma - ||Delta||^2_m /
  (2 sigma^2)``: a deterministic negative shift that grows as ``1/sigma^2`` at low noise, plus a spread that varies
  with the step. RatioNorm adds back ``b = ||Delta||^2_m / (2 sigma^2)`` and rescales by ``sigma``:

      log rho_hat = sigma (log p_theta - log p_old + b)  =  mean_d((x' - mu_old) Delta) / sigma

  (per sample: zero-mean, no ``1/sigma``), and clips ``rho_hat`` instead of the ratio. ``ratio_norm_bias: batch``
  (the default, the reference code) uses one ``b`` and one ``sigma`` per micro-batch, their means: the code's
  ``mean`` over an empty tuple of dimensions reduces over the whole batch; ``sample`` uses each transition's own
  (the paper's reading, and verl-omni's and Flow-Factory's). ``mu_old`` is rebuilt from the rollout's own velocity
  (``Transitions.velocity``, kept when the term asks) by the same function as ``mu_theta``, so on the first
  micro-batch ``Delta`` is exactly 0 and ``rho_hat`` exactly 1, on any backend. The guard's log-ratio always reduces
  by the mean over latent dimensions (a sum would grow it ``D`` times past the 2e-6 clip range).
* **Per-step gradient reweighting** (``step_reweight: inverse_dt``): each transition's policy loss is divided by
  ``-dt = sigma_t - sigma_{t+1}``. ``grad log rho_hat`` is proportional to ``dt`` (``d mu / d v`` is), so this
  equalises the gradient across noise levels (the reference divides a micro-batch's loss by ``mean(sqrt(-dt))^2``,
  the same number with one step per micro-batch). It also applies without RatioNorm, to the plain ratio.

Two more options of the term, off by default: **Flow-DPPO** (``trust_region: dppo``), the clip replaced by a mask on
the KL of the policy's and the rollout's step means (``flowalign.losses.flow_dppo``), and **rollout correction**
(``rollout_is``, ``rollout_rs``), verl's importance weights and rejection against the rollout's log-probs, here in
bypass mode: the rejection's keep mask multiplies each transition's weight (``flowalign.losses.rollout_correction``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.kernels import clipped_policy_loss, grpo_transition_loss
from flowalign.kernels.loss_reference import (check_loss_settings, kl_std_scale, latent_mean_kl, transition_kl,
                                           velocity_mse_kl)
from flowalign.losses.base import LossTerm, MicroBatch, PolicyOutput, register_loss
from flowalign.losses.flow_dppo import dppo_transition_loss, flow_dppo_loss
from flowalign.losses.rollout_correction import (check_rollout_correction, bypass_log_prob,
                                                 rollout_correction_weights)
from flowalign.settings import check, finite, option

__all__ = ["flow_dppo_loss", "grpo_loss", "guard_log_ratio", "guard_transition_loss", "kl_std_scale", "latent_mean_kl",
           "rollout_correction_weights", "step_reweight", "transition_grpo_loss", "velocity_mse_kl"]


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

    All inputs are ``[N]`` (or all ``[B, S]``: the mean is over every element); gradients flow through ``log_prob``
    and ``kl`` only (``old_log_prob``, ``advantages`` and ``weights`` are constants). ``weights`` defaults to 1; they
    multiply each element's clipped loss (rollout correction's weights, ``flowalign.losses.rollout_correction``, go
    here; a rejected element still counts in the mean). fp32 arithmetic, or fp64 for fp64 inputs. ``kl`` (per transition, e.g. ``latent_mean_kl``) enters the
    loss as ``beta * mean(kl)``; it is logged even when ``beta`` is 0.

    Stats: ``loss``, ``policy_loss``, ``kl`` (mean, 0 without ``kl``), ``approx_kl`` = mean of
    ``0.5 (log_prob - old_log_prob)^2``, ``clip_frac`` = fraction with ``|ratio - 1| > eps``, ``ratio_mean`` and
    ``ratio_max``.
    """
    check_loss_settings(clip_range, beta, kl_given=kl is not None, kl_source="a per-transition kl tensor")
    if log_prob.ndim not in (1, 2) or log_prob.numel() == 0:
        raise ValueError(f"log_prob must be a non-empty 1-D tensor [N] (or [B, S]), got shape "
                         f"{tuple(log_prob.shape)}")
    n = log_prob.shape
    _check_shape("old_log_prob", old_log_prob, n)
    _check_shape("advantages", advantages, n)
    dtype = torch.promote_types(log_prob.dtype, torch.float32)  # fp32, or fp64 kept for float64 checks

    log_ratio = log_prob.to(dtype) - old_log_prob.detach().to(dtype)
    per_transition = clipped_policy_loss(log_ratio, advantages.detach().to(dtype), clip_range)
    if weights is not None:
        _check_shape("weights", weights, n)
        per_transition = weights.detach().to(dtype) * per_transition
    policy_loss = per_transition.mean()

    kl_mean = torch.zeros((), device=log_prob.device, dtype=dtype)
    if kl is not None:
        _check_shape("kl", kl, n)
        kl_mean = kl.to(dtype).mean()
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


GUARD_BIASES = ("batch", "sample")
STEP_REWEIGHTS = ("none", "inverse_dt")


def guard_log_ratio(mean: Tensor, old_mean: Tensor, sample: Tensor, std: Tensor, *,
                    bias: str = "batch") -> tuple[Tensor, Tensor]:
    """GRPO-Guard's normalised log-ratio ``log rho_hat`` and the plain mean-reduced log-ratio, per transition ``[N]``
    (module docstring): ``mean`` is ``mu_theta`` (carries the gradient), ``old_mean`` ``mu_old``, ``sample`` the
    drawn ``x'`` (constants), ``std`` the transition std ``[N]`` (or ``[N, 1, ...]``).

    With ``d = x' - mu_old`` and ``Delta = mu_theta - mu_old`` (means over the latent dimensions):

        plain        = mean(2 d Delta - Delta^2) / (2 sigma^2)              (= log p_theta - log p_old)
        sample bias  : log rho_hat = mean(d Delta) / sigma
        batch bias   : log rho_hat = s (plain + mean_n mean(Delta_n^2) / (2 s^2)),   s = mean_n sigma_n

    Both are exactly 0 where ``mu_theta == mu_old``."""
    if bias not in GUARD_BIASES:
        raise ValueError(f"unknown RatioNorm bias {bias!r}: expected one of {', '.join(GUARD_BIASES)}")
    if not (mean.shape == old_mean.shape == sample.shape):
        raise ValueError(f"mean {tuple(mean.shape)}, old_mean {tuple(old_mean.shape)} and sample "
                         f"{tuple(sample.shape)} must have the same shape")
    dims = tuple(range(1, mean.ndim))
    sigma = std.float().reshape(-1)
    if sigma.shape[0] != mean.shape[0]:
        raise ValueError(f"std has {sigma.shape[0]} rows but mean has {mean.shape[0]}")
    d = sample.detach().float() - old_mean.detach().float()
    delta = mean.float() - old_mean.detach().float()
    cross, square = (d * delta).mean(dim=dims), (delta * delta).mean(dim=dims)
    plain = (2 * cross - square) / (2 * sigma**2)
    if bias == "sample":
        return cross / sigma, plain
    s = sigma.mean()
    return s * (plain + square.mean() / (2 * s**2)), plain


def step_reweight(sigma: Tensor, sigma_next: Tensor, kind: str = "inverse_dt") -> Tensor:
    """GRPO-Guard's per-transition weight of the policy loss: ``1 / (sigma - sigma_next)`` (``inverse_dt``), or 1
    (``none``); ``[N]`` fp32."""
    if kind not in STEP_REWEIGHTS:
        raise ValueError(f"unknown step reweighting {kind!r}: expected one of {', '.join(STEP_REWEIGHTS)}")
    ones = torch.ones_like(sigma, dtype=torch.float32)
    return ones / (sigma.float() - sigma_next.float()) if kind == "inverse_dt" else ones


def guard_transition_loss(
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
    clip_range: float,
    bias: str = "batch",
    weights: Tensor | None = None,
    v_ref: Tensor | None = None,
    beta: float = 0.0,
    kl: str = "latent_mean",
    kl_std: str = "std_t",
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss with RatioNorm (module docstring) from the policy velocity ``v`` and the rollout's ``v_old``:
    ``mean_n w_n max(-A rho_hat, -A clip(rho_hat, 1 - eps, 1 + eps)) + beta mean_n KL_n``, torch autograd (the
    reweighting, when on, is in ``weights``). Stats as ``grpo_loss``'s, on ``rho_hat``, plus ``guard/plain_ratio_mean``
    (the unnormalised ratio, below 1 on average: the bias RatioNorm removes) and ``guard/log_ratio_std``."""
    from flowalign.kernels.sde_reference import per_sample, sde_mean_std

    check_loss_settings(clip_range, beta, kl_given=v_ref is not None, kl_source="the reference velocity v_ref")
    mean, std = sde_mean_std(x_t, v, sigma, sigma_next, kind=kind, noise_level=noise_level)
    old_mean, _ = sde_mean_std(x_t, v_old.detach(), sigma, sigma_next, kind=kind, noise_level=noise_level)
    std = std * per_sample(noise_scale, x_t)
    log_ratio, plain = guard_log_ratio(mean, old_mean, x_next, std, bias=bias)
    per = clipped_policy_loss(log_ratio, advantages.detach().float(), clip_range)
    if weights is not None:
        per = weights.detach().float() * per
    policy_loss = per.mean()
    kl_rows = torch.zeros_like(per) if v_ref is None else transition_kl(
        x_t, v, v_ref, mean, std, sigma, sigma_next, kind=kind, noise_level=noise_level, kl=kl, kl_std=kl_std)
    kl_mean = kl_rows.mean()
    loss = policy_loss + beta * kl_mean if beta > 0 else policy_loss
    stats = loss_stats(loss, policy_loss, kl_mean, log_ratio.detach(), clip_range)
    with torch.no_grad():
        stats["guard/plain_ratio_mean"] = float(torch.exp(plain).mean())
        stats["guard/log_ratio_std"] = float(log_ratio.std(unbiased=False)) if log_ratio.numel() > 1 else 0.0
    return loss, stats


def _check_shape(name: str, tensor: Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name} must have shape {tuple(shape)} like log_prob, got {tuple(tensor.shape)}")




# ------------------------------------------------------------------------------------------------ the term


@dataclass
class GRPOLossConfig(ComponentConfig):
    clip_range: float = option(1e-4, "PPO ratio clip range: ratios outside [1 - c, 1 + c] get no gradient")
    beta: float = option(0.0, "weight of the KL penalty to the reference model; 0 = none")
    kl: Literal["latent_mean", "velocity_mse"] = option(
        "latent_mean", "KL estimate: between the transition means in latent space, or the velocity MSE")
    kl_std: Literal["std_t", "transition"] = option(
        "std_t", "the latent-mean KL's std s in (mu - mu_ref)^2 / (2 s^2): std_t, the SDE's diffusion coefficient "
        "without the step's sqrt(-dt) (flow_grpo's released train_sd3.py), or transition, the step's own std "
        "std_t sqrt(-dt): the exact KL of the two transitions, 1/|dt| times larger at the same beta (about 9x on 10 "
        "steps). cps steps use their transition std in both")
    ratio_norm: bool = option(
        False, "GRPO-Guard's RatioNorm: clip the recentred, rescaled ratio sigma (log p - log p_old + b) instead of "
        "the ratio (the rollout then keeps its velocities)")
    ratio_norm_bias: Literal["batch", "sample"] = option(
        "batch", "RatioNorm's b and sigma: one batch mean per micro-batch (the reference code) or per transition (the "
        "paper's reading)")
    step_reweight: Literal["none", "inverse_dt"] = option(
        "none", "GRPO-Guard's per-timestep gradient reweighting: divide each transition's policy loss by "
        "-dt = sigma_t - sigma_{t+1} (inverse_dt), or not")
    trust_region: Literal["clip", "dppo"] = option(
        "clip", "how far an update may move the policy: clip, PPO's ratio clip (clip_range); dppo, Flow-DPPO's "
        "divergence mask (docs/methods/flow_dppo.md): no clip, a transition is dropped when the KL between its "
        "policy and rollout step means reaches kl_mask_threshold and its ratio moved in its advantage's direction "
        "(the rollout then keeps its velocities, to rebuild its step means)")
    kl_mask_threshold: float = option(
        1e-5, "Flow-DPPO's divergence threshold delta: transitions with D >= delta may be dropped (the released >=)")
    add_kl_coefficient: bool = option(
        True, "Flow-DPPO: D = mean (mu - mu_old)^2 / (2 sigma^2) (true), or mean (mu - mu_old)^2 / 2 (false)")
    kl_reduction: Literal["mean", "sum"] = option(
        "mean", "Flow-DPPO's D over the latent dimensions: mean (both released codes; delta is calibrated to it) or "
        "sum (the paper's KL)")
    sigma_at_one: Literal["sampler", "clamp_0.99"] = option(
        "sampler", "Flow-DPPO's sigma in D: sampler, the step's own transition std (flowalign's and verl-omni's; at "
        "s = 1 the flow_grpo kind uses 1 - s_next in the denominator), or clamp_0.99, UniRL's std with s clamped to "
        "0.99 in 1 - s (10 eta sqrt(-dt) at s = 1; flow_grpo kind only)")
    rollout_is: Literal["token", "sequence"] | None = option(
        None, "rollout correction's importance weights (verl's rollout_is): token or sequence, or null for none. "
        "flowalign's rollouts store their own log-probs (bypass mode), so the PPO ratio already is the importance "
        "weight and these are logged only (rollout_corr/is_*)")
    rollout_is_threshold: float | str = option(
        2.0, "rollout correction's IS threshold: a float u truncates the weights at u (TIS); a string 'l_u' (e.g. "
        "'0.5_2.0', quoted) zeroes those outside [l, u] (IcePop)")
    rollout_is_batch_normalize: bool = option(False, "rollout correction: normalise the IS weights to mean 1")
    rollout_rs: str | None = option(
        None, "rollout correction's rejection (verl's rollout_rs), per step on log p_theta - log p_rollout: "
        "comma-chained modes of token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 (a step is one "
        "sequence element here); a rejected transition's loss is zeroed but still counts in the mean; null = off")
    rollout_rs_threshold: float | str | None = option(
        None, "rollout_rs's thresholds, one for all modes or one per mode (comma-separated): k1 modes 'l_u' ratio "
        "bounds (quoted: '0.5_2.0') or one float u (l = 1/u); k2/k3 modes an upper bound")

    def validate(self) -> None:
        finite("clip_range", self.clip_range, 0.0, strict=True)
        finite("beta", self.beta, 0.0)
        check(self.kl == "latent_mean" or self.kl_std == "std_t", "kl_std",
              f"= {self.kl_std!r} is the latent-mean KL's setting, but kl = {self.kl!r}: drop it, or set "
              "kl: latent_mean")
        check(self.ratio_norm or self.ratio_norm_bias == "batch", "ratio_norm_bias",
              f"= {self.ratio_norm_bias!r} is RatioNorm's setting: set ratio_norm: true, or drop it")
        dppo = self.trust_region == "dppo"
        finite("kl_mask_threshold", self.kl_mask_threshold, 0.0)
        for key, default in (("kl_mask_threshold", 1e-5), ("add_kl_coefficient", True), ("kl_reduction", "mean"),
                             ("sigma_at_one", "sampler")):
            check(dppo or getattr(self, key) == default, key,
                  f"= {getattr(self, key)!r} is Flow-DPPO's setting: set trust_region: dppo, or drop it")
        check(not (dppo and self.ratio_norm), "trust_region",
              "= 'dppo' replaces the ratio clip that ratio_norm (GRPO-Guard) normalises: use one of them")
        check_rollout_correction(self)


@register_loss("grpo", config=GRPOLossConfig)
class GRPOLoss(LossTerm):
    """the PPO-clipped GRPO loss on each transition's recomputed log-prob, plus beta * KL to the reference."""

    def wants_reference(self) -> bool:
        """A KL penalty, or the velocity MSE logged, needs the reference velocity."""
        return self.config.beta > 0 or self.config.kl == "velocity_mse"

    def rollout_fields(self) -> frozenset[str]:
        """RatioNorm and Flow-DPPO rebuild the old transition mean from the rollout's own velocity."""
        return frozenset({"velocity"}) if self.config.ratio_norm or self.config.trust_region == "dppo" else frozenset()

    def check(self, config) -> None:
        """Flow-DPPO needs the rollout's step means (rebuilt from its stored velocities) and, for UniRL's sigma, the
        flow_grpo SDE."""
        if self.config.trust_region != "dppo":
            return
        shape = config.components().shape
        check("velocity" in shape.fields, "loss.grpo.trust_region",
              f"= 'dppo' needs the rollout's step means (rebuilt from the velocities it stores), but rollout.name = "
              f"{config.rollout.name!r} stores no velocities: use a rollout shape that keeps them (group, tree, "
              "probe), or trust_region: clip")
        check(self.config.sigma_at_one != "clamp_0.99" or config.sampling.kind == "flow_grpo",
              "loss.grpo.sigma_at_one", f"= 'clamp_0.99' is UniRL's flow_grpo std, but sampling.kind = "
              f"{config.sampling.kind!r}: use sigma_at_one: sampler")

    def loss(self, micro: MicroBatch, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        st, cfg = micro.transitions, self.config
        x_t, x_next = st.x_t, st.x_next
        if st.log_prob_shift is not None:  # a guided rollout's log-prob under its guided mean (samplers.sde_step)
            from flowalign.samplers.sde import guided_log_prob_sample

            x_t, x_next = x_t.float(), guided_log_prob_sample(x_next, st.log_prob_shift)
        weights = micro.weights
        if cfg.step_reweight != "none":
            weights = weights * step_reweight(st.sigma, st.sigma_next, cfg.step_reweight).to(weights.device)
        v_ref = policy.v_ref if self.wants_reference() else None
        corrected = cfg.rollout_is is not None or cfg.rollout_rs is not None
        if corrected:  # bypass mode: rejection on the current policy's log-prob against the rollout's, per step
            current = bypass_log_prob(policy.v, x_t, x_next, st)
            _, keep, correction = rollout_correction_weights(
                current, st.log_prob, rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
                rollout_is_batch_normalize=cfg.rollout_is_batch_normalize, rollout_rs=cfg.rollout_rs,
                rollout_rs_threshold=cfg.rollout_rs_threshold)
            weights = weights * keep.to(weights)
        loss, stats = self.policy_loss(micro, policy, x_t, x_next, weights, v_ref)
        if corrected:
            stats.update(correction)
        return loss, stats

    def policy_loss(self, micro: MicroBatch, policy: PolicyOutput, x_t: Tensor, x_next: Tensor, weights: Tensor,
                    v_ref: Tensor | None) -> tuple[Tensor, dict[str, float]]:
        """The clipped (or RatioNorm-clipped, or Flow-DPPO-masked) loss of the micro-batch, with its stats."""
        st, cfg = micro.transitions, self.config
        if cfg.trust_region == "dppo":
            if st.velocity is None:
                raise RuntimeError("loss.grpo.trust_region = 'dppo' needs the rollout's velocities "
                                   "(Transitions.velocity): the rollout shape did not keep them")
            return dppo_transition_loss(
                policy.v, st.velocity, x_t, x_next, st.sigma, st.sigma_next, micro.advantages, kind=st.kind,
                noise_level=st.noise_level, noise_scale=st.noise_scale, reduce=st.reduce,
                kl_mask_threshold=cfg.kl_mask_threshold, add_kl_coefficient=cfg.add_kl_coefficient,
                kl_reduction=cfg.kl_reduction, sigma_at_one=cfg.sigma_at_one, weights=weights, v_ref=v_ref,
                beta=cfg.beta, kl=cfg.kl, kl_std=cfg.kl_std)
        if cfg.ratio_norm:
            if st.velocity is None:
                raise RuntimeError("loss.grpo.ratio_norm needs the rollout's velocities (Transitions.velocity): the "
                                   "rollout shape did not keep them")
            return guard_transition_loss(
                policy.v, st.velocity, x_t, x_next, st.sigma, st.sigma_next, micro.advantages, kind=st.kind,
                noise_level=st.noise_level, noise_scale=st.noise_scale, clip_range=cfg.clip_range,
                bias=cfg.ratio_norm_bias, weights=weights, v_ref=v_ref, beta=cfg.beta, kl=cfg.kl, kl_std=cfg.kl_std)
        # Log-prob, ratio, clip and KL in one op: fused Triton forward and backward on CUDA (model.kernels).
        return transition_grpo_loss(
            policy.v, x_t, x_next, st.sigma, st.sigma_next, st.log_prob, micro.advantages, kind=st.kind,
            noise_level=st.noise_level, noise_scale=st.noise_scale, reduce=st.reduce, clip_range=cfg.clip_range,
            weights=weights, v_ref=v_ref, beta=cfg.beta, kl=cfg.kl, kl_std=cfg.kl_std, backend=self.backend,
        )

    def set_up(self, parts) -> None:
        self.backend = parts.config.model.kernels

    backend = "auto"
