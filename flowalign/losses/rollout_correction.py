"""Rollout correction: importance weights and rejection for a rollout whose log-probs come from another engine.

Not a paper method: verl's Rollout Correction for LLM RL (``docs/algo/rollout_corr_math.md`` of verl-project/verl;
references: "When Speed Kills Stability" (Li et al. 2025), truncated importance sampling (TIS), IcePop), ported to
diffusion by verl-omni (``verl_omni/trainer/diffusion/rollout_correction.py``, ``workers/utils/losses.py::
_apply_bypass_rc``). flowalign matches verl@8a69493 ``verl/trainer/ppo/rollout_corr_helper.py``.

Log-probs are ``[B, S]`` (``S`` the trained steps of a sample; a ``[B]`` input is one step, ``S = 1``). With
``lr = log p_old - log p_rollout`` (``old`` the training forward's log-prob before any update, ``rollout`` the
rollout engine's) and ``clamp`` the released safety bound ``[-20, 20]``:

* **Importance weights** (``rollout_is``): ``token``: ``w = exp(clamp(lr))``; ``sequence``: ``w = exp(clamp(sum_S
  lr))``, the same for every step of a sample. A float threshold ``u`` truncates (TIS: ``min(w, u)``); a string
  ``"l_u"`` is IcePop (``w`` kept where ``l <= w <= u``, else 0). ``rollout_is_batch_normalize`` divides by their
  mean (``token``: over all elements; ``sequence``: over samples), unless that mean is <= 1e-8. Detached.
* **Rejection** (``rollout_rs``, comma-chained, all must pass): per element ``k1 = -clamp(lr)``, ``k2 =
  clamp(lr)^2 / 2``, ``k3 = exp(clamp(lr)) - 1 - clamp(lr)``; ``token_k*`` per element, ``seq_sum_k*`` /
  ``seq_mean_k*`` / ``seq_max_k{2,3}`` per sample (a failing sample loses every step). ``k1`` keeps ``log l <= stat
  <= log u`` (``"l_u"``, or one float ``u`` meaning ``l = 1/u``); the others keep ``stat <= u``. Thresholds are given
  once for all options or one per option, comma-separated.

The weights go to ``grpo_loss(weights=...)``, which multiplies each element's clipped loss by them and takes the mean
over **all** elements (a rejected element still counts in the denominator, so rejection dilutes the gradient by
``kept / total``).

**Bypass** (verl-omni's ``bypass_mode``; what flowalign's rollouts always are): the old log-prob *is* the rollout's,
so the PPO ratio is the importance weight; per step the rejection runs on ``(log p_theta, log p_rollout)`` (the
current policy, ``[B, 1]``), only its keep mask enters the loss, and ``rollout_is`` is diagnostics.

As released, the sample means divide by ``count + 1e-8`` (verl's ``masked_mean``): kept here, since it moves a mean
of two steps by 5e-9 relative.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["IS_LEVELS", "RS_OPTIONS", "SAFETY_BOUND", "bypass_log_prob", "check_rollout_correction", "parse_is_threshold",
           "parse_rs_options", "parse_rs_thresholds", "rollout_correction_weights"]

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
_MEAN_EPS = 1e-8  # verl's masked_mean denominator


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``(upper, lower)`` of an IS threshold: a number (or a numeric string) is TIS's ``upper`` (``lower`` None); a
    string ``"l_u"`` is IcePop's ``[l, u]``. ValueError/TypeError on anything else, non-positive bounds or ``l > u``."""
    if isinstance(spec, bool):
        raise TypeError("rollout_is_threshold must be a float or a string 'lower_upper', not a bool")
    if isinstance(spec, (int, float)):
        upper, lower = float(spec), None
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError("rollout_is_threshold must not be an empty string")
        try:
            if "_" in text:
                low, high = text.split("_", 1)
                lower, upper = float(low), float(high)
            else:
                upper, lower = float(text), None
        except ValueError:
            raise ValueError(f"rollout_is_threshold {spec!r} is neither a number nor 'lower_upper' "
                             "(e.g. 2.0 or '0.5_2.0')") from None
    else:
        raise TypeError(f"rollout_is_threshold must be a float or a string 'lower_upper', got {spec!r}")
    if not upper > 0:
        raise ValueError(f"rollout_is_threshold's upper bound must be > 0, got {upper}")
    if lower is not None and not 0 < lower <= upper:
        raise ValueError(f"rollout_is_threshold's lower bound must be > 0 and <= the upper {upper}, got {lower}")
    return upper, lower


def parse_rs_options(spec: str) -> list[str]:
    """The comma-chained rejection modes, in order, each once; ValueError naming an unknown one."""
    if not isinstance(spec, str):
        raise ValueError(f"rollout_rs must be a comma-separated string of modes, got {spec!r}")
    options: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs mode {part!r}: expected one of {', '.join(RS_OPTIONS)} "
                             "(comma-separated to chain them)")
        if part not in options:
            options.append(part)
    if not options:
        raise ValueError("rollout_rs names no mode: give one of " + ", ".join(RS_OPTIONS))
    return options


def parse_rs_thresholds(options: list[str], spec: float | str | None) -> dict[str, tuple[float | None, float]]:
    """``{option: (lower, upper)}``: one threshold for every option or one per option (comma-separated). ``k1``
    modes take ``"l_u"`` or one number ``u`` (``l = 1/u``); the others one upper bound (no ``_``)."""
    if spec is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    parts = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold gives {len(parts)} thresholds for {len(options)} rollout_rs modes: "
                         "give one for all, or one per mode")
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for option, text in zip(options, parts):
        try:
            if option.endswith("k1"):
                if "_" in text:
                    low, high = text.split("_", 1)
                    lower, upper = float(low), float(high)
                else:
                    upper = float(text)
                    lower = float(str(1.0 / upper))
            elif "_" in text:
                raise ValueError(f"rollout_rs_threshold for {option!r} is one upper bound, without '_': got {text!r}")
            else:
                lower, upper = None, float(text)
        except (ValueError, ZeroDivisionError) as e:
            if "without '_'" in str(e):
                raise
            raise ValueError(f"rollout_rs_threshold {text!r} for {option!r} is not a number"
                             + (" nor 'lower_upper'" if option.endswith("k1") else "")) from None
        if not upper > 0 or (lower is not None and not lower > 0):
            raise ValueError(f"rollout_rs_threshold for {option!r} must be positive, got {text!r}")
        out[option] = (lower, upper)
    return out


def _sample_mean(values: Tensor) -> Tensor:
    """The released per-sample mean over steps: ``sum / (S + 1e-8)``."""
    return values.sum(dim=-1) / (values.shape[-1] + _MEAN_EPS)


def _importance_weights(log_ratio: Tensor, level: str, threshold: float | str, normalize: bool,
                        stats: dict[str, float]) -> Tensor:
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is {level!r}: expected one of {', '.join(IS_LEVELS)}")
    upper, lower = parse_is_threshold(threshold)
    if level == "token":
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        total = log_ratio.sum(dim=-1, keepdim=True)
        raw = torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    if lower is None:  # TIS
        weights = raw.clamp(max=upper)
    else:  # IcePop
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
        stats["rollout_corr/is_out_of_bounds"] = float(((raw < lower) | (raw > upper)).float().mean())
    weights = weights.detach()
    stats["rollout_corr/is_mean"] = float(weights.sum() / (weights.numel() + _MEAN_EPS))
    stats["rollout_corr/is_max"] = float(weights.max())
    stats["rollout_corr/is_min"] = float(weights.min())
    stats["rollout_corr/is_raw_above"] = float((raw > upper).float().mean())
    if normalize:
        mean = (weights.sum() / (weights.numel() + _MEAN_EPS) if level == "token"
                else _sample_mean(weights).sum() / max(weights.shape[0], 1))
        if mean > 1e-8:
            weights = weights / mean
        stats["rollout_corr/is_batch_norm_factor"] = float(mean) if mean > 1e-8 else 1.0
    return weights


def _rejection_mask(log_ratio: Tensor, options: str, thresholds: float | str | None,
                    stats: dict[str, float]) -> Tensor:
    names = parse_rs_options(options)
    bounds = parse_rs_thresholds(names, thresholds)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_step = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    keep = torch.ones_like(log_ratio)
    for name in names:
        lower, upper = bounds[name]
        estimator = per_step[name[-2:]]
        if name.startswith("token"):
            stat = estimator
        elif name.startswith("seq_sum"):
            stat = estimator.sum(dim=-1, keepdim=True)
        elif name.startswith("seq_mean"):
            stat = _sample_mean(estimator).unsqueeze(-1)
        else:  # seq_max
            stat = estimator.max(dim=-1, keepdim=True).values
        if name.endswith("k1"):  # ratio bounds compared in log space
            passed = (stat >= math.log(lower)) & (stat <= math.log(upper))
        else:
            passed = stat <= upper
        passed = passed.expand_as(log_ratio)
        stats[f"rollout_corr/rs_{name}_rejected"] = float((~passed).float().mean())
        keep = keep * passed.to(log_ratio.dtype)
    stats["rollout_corr/rs_rejected"] = float((1 - keep).mean())
    stats["rollout_corr/rs_samples_rejected"] = float((keep < 0.5).any(dim=-1).float().mean())
    return keep


def rollout_correction_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """The rollout-correction weights and keep mask (module docstring) of ``[B, S]`` (or ``[B]``) log-probs.

    Returns ``(weights, keep_mask, stats)``: ``weights`` the detached importance weights times the keep mask, or
    None when ``rollout_is`` (or its threshold) is None; ``keep_mask`` 1 where every rejection mode passes (all ones
    without ``rollout_rs``), in the log-probs' dtype; ``stats`` floats under ``rollout_corr/``, with the mismatch
    itself: ``log_ratio_mean`` / ``log_ratio_abs_max`` and ``k3_kl`` (mean ``exp(lr) - 1 - lr``). Bypass mode is
    ``rollout_correction_weights(log_prob, rollout_log_prob, rollout_rs=...)`` per step with only ``keep_mask`` used.
    Inputs are read without gradient."""
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)} and rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)} must have the same shape")
    if old_log_prob.ndim not in (1, 2) or old_log_prob.numel() == 0:
        raise ValueError(f"log-probs must be a non-empty [B, S] (or [B]) tensor, got {tuple(old_log_prob.shape)}")
    one_step = old_log_prob.ndim == 1
    dtype = torch.promote_types(torch.promote_types(old_log_prob.dtype, rollout_log_prob.dtype), torch.float32)
    old, rollout = old_log_prob.detach().to(dtype), rollout_log_prob.detach().to(dtype)
    if one_step:
        old, rollout = old.unsqueeze(-1), rollout.unsqueeze(-1)
    log_ratio = old - rollout
    stats = {"rollout_corr/log_ratio_mean": float(log_ratio.mean()),
             "rollout_corr/log_ratio_abs_max": float(log_ratio.abs().max()),
             "rollout_corr/k3_kl": float((torch.exp(log_ratio) - 1 - log_ratio).mean())}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights = _importance_weights(log_ratio, rollout_is, rollout_is_threshold, rollout_is_batch_normalize, stats)
    keep = torch.ones_like(log_ratio)
    if rollout_rs is not None:
        keep = _rejection_mask(log_ratio, rollout_rs, rollout_rs_threshold, stats)
        if weights is not None:
            weights = weights * keep
    if one_step:
        keep = keep.squeeze(-1)
        weights = None if weights is None else weights.squeeze(-1)
    return weights, keep, stats


def check_rollout_correction(settings) -> None:
    """ConfigError naming the setting (``rollout_is_threshold``, ``rollout_rs``, ``rollout_rs_threshold``) when the
    ``grpo`` loss's rollout-correction settings would not parse, before anything loads."""
    from flowalign.settings import check

    try:
        parse_is_threshold(settings.rollout_is_threshold)
    except (TypeError, ValueError) as e:
        check(False, "rollout_is_threshold", f"= {settings.rollout_is_threshold!r}: {e}")
    if settings.rollout_rs is None:
        check(settings.rollout_rs_threshold is None, "rollout_rs_threshold",
              f"= {settings.rollout_rs_threshold!r} is rollout_rs's setting, but rollout_rs is null: set rollout_rs "
              "(e.g. token_k1), or drop it")
        return
    try:
        names = parse_rs_options(settings.rollout_rs)
    except ValueError as e:
        check(False, "rollout_rs", f"= {settings.rollout_rs!r}: {e}")
    check(settings.rollout_rs_threshold is not None, "rollout_rs_threshold",
          f"is needed by rollout_rs = {settings.rollout_rs!r}: e.g. '0.5_2.0' for a k1 mode, 0.01 for k2/k3")
    try:
        bounds = parse_rs_thresholds(names, settings.rollout_rs_threshold)
    except (TypeError, ValueError) as e:
        check(False, "rollout_rs_threshold", f"= {settings.rollout_rs_threshold!r}: {e}")
    for name, (lower, upper) in bounds.items():
        if lower is not None and lower > upper:
            check(False, "rollout_rs_threshold", f"= {settings.rollout_rs_threshold!r} gives {name} the bounds "
                  f"[{lower:g}, {upper:g}], which reject everything: give lower <= upper")


def bypass_log_prob(v: Tensor, x_t: Tensor, x_next: Tensor, transitions) -> Tensor:
    """The current policy's log-prob of each transition, without gradient: ``log N(x_next; mu(x_t, v), std^2)`` with
    the step's std times its noise scale and the rollout's reduction (what bypass-mode rejection compares with the
    rollout's ``Transitions.log_prob``). ``[N]`` fp32."""
    from flowalign.kernels.sde_reference import gaussian_log_prob, per_sample, sde_mean_std

    st = transitions
    with torch.no_grad():
        mean, std = sde_mean_std(x_t, v.detach(), st.sigma, st.sigma_next, kind=st.kind, noise_level=st.noise_level)
        return gaussian_log_prob(x_next, mean, std * per_sample(st.noise_scale, x_t), st.reduce)
