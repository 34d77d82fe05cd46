"""The entry points of the fused ops: check the inputs, then run the Triton kernel or the torch reference.

Both paths see the same checks, so a bad input fails the same way on CPU and GPU, with the argument's name and
shapes, before any kernel is compiled. Non-contiguous latents are copied to contiguous ones for the kernels (the
gradient still has the input's shape).
"""

from __future__ import annotations

import logging

from torch import Tensor

from .backend import check_latent, check_same_dtype, resolve_backend, row_values
from .loss_reference import KL_FORMS, KL_STDS, TransitionLoss, check_loss_settings, grpo_transition_loss_reference
from .sde_kinds import sde_kind
from .sde_reference import StepOutput, check_kind, check_reduce, check_step_values, sde_step_reference

logger = logging.getLogger(__name__)
_STATED: set[str] = set()  # the unfused kinds whose fallback was already stated


def runs_fused(kind: str, backend: str) -> bool:
    """Whether the Triton path runs a step of ``kind`` on the resolved ``backend``: only the kinds with a kernel
    (``sde_kinds.FUSED_KINDS``) do; a registered kind without one runs the torch reference even where Triton was
    asked for, and this says so once per kind (a warning), so the fallback is never silent."""
    if backend == "torch":
        return False
    if sde_kind(kind).fused:
        return True
    if kind not in _STATED:
        _STATED.add(kind)
        logger.warning("SDE kind %r has no Triton kernel: its steps and losses run on the torch reference path "
                       "(flowalign.kernels.sde_kinds)", kind)
    return False


def sde_transition(
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
    backend: str | None = None,
) -> StepOutput:
    """One SDE step from ``x`` with velocity ``v``: ``x' = mu + c std noise`` (or the given ``prev_sample``) and its
    exact log-prob. Exactly one of ``noise`` and ``prev_sample`` is given; sigmas, the noise level and the noise scale
    ``c`` are scalars or ``[batch]``. Returns the sample (``x.dtype``), the fp32 mean, and ``[batch]`` std and
    log-prob, from the fused Triton kernel or ``sde_step_reference`` (``backend``: ``flowalign.kernels.backend``).

    ``flowalign.samplers.sde_step`` draws the noise and validates the step; it calls this.
    """
    check_kind(kind)
    check_reduce(reduce)
    check_latent("x", x)
    check_latent("v", v, x)
    if (noise is None) == (prev_sample is None):
        raise ValueError("give exactly one of noise (to draw x') and prev_sample (to score a given x')")
    if noise is not None:
        check_latent("noise", noise, x)
    else:
        check_latent("prev_sample", prev_sample, x)
    rows = tuple(row_values(name, value, x) for name, value in (
        ("sigma", sigma), ("sigma_next", sigma_next), ("noise_level", noise_level), ("noise_scale", noise_scale)))
    if not runs_fused(kind, resolve_backend(x, backend)):
        return sde_step_reference(x, v, sigma, sigma_next, kind=kind, noise_level=noise_level, noise_scale=noise_scale,
                                  noise=noise, prev_sample=prev_sample, reduce=reduce)
    from .sde_triton import sde_step_triton

    return sde_step_triton(x.contiguous(), v.contiguous(), rows, kind=kind, reduce=reduce,
                           noise=None if noise is None else noise.contiguous(),
                           prev_sample=None if prev_sample is None else prev_sample.contiguous())


def grpo_transition_loss(
    v: Tensor,
    x_t: Tensor,
    x_next: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    kind: str,
    noise_level: float | Tensor,
    noise_scale: float | Tensor = 1.0,
    reduce: str = "mean",
    clip_range: float,
    weights: Tensor | None = None,
    v_ref: Tensor | None = None,
    beta: float = 0.0,
    kl: str = "latent_mean",
    kl_std: str = "std_t",
    backend: str | None = None,
) -> TransitionLoss:
    """The per-transition GRPO loss of ``x_t -> x_next`` under the policy velocity ``v`` (``loss_reference``).

    ``v`` carries the gradient; ``x_t``, ``x_next`` (same dtype) and ``v_ref`` (``v``'s dtype, no grad) are constants.
    ``old_log_prob``, ``advantages`` and ``weights`` (default 1) are ``[batch]``; sigmas, noise level and scale are
    scalars or ``[batch]``. With ``v_ref`` the ``kl`` form (``latent_mean`` or ``velocity_mse``) is computed and
    added as ``beta * kl``; ``kl_std`` is the latent-mean KL's std (``std_t``, flow_grpo's released code, or
    ``transition``: ``loss_reference``'s docstring). The fused path is ``loss_triton.FusedTransitionLoss``, whose backward is a Triton kernel.
    """
    check_kind(kind)
    check_reduce(reduce)
    check_latent("v", v)
    check_latent("x_t", x_t, v, "v")
    check_latent("x_next", x_next, v, "v")
    check_same_dtype("x_next", x_next, x_t, "x_t")
    if v_ref is not None:
        check_latent("v_ref", v_ref, v, "v")
        check_same_dtype("v_ref", v_ref, v, "v")
    for name, tensor in (("x_t", x_t), ("x_next", x_next), ("v_ref", v_ref)):
        if tensor is not None and tensor.requires_grad:
            raise ValueError(f"{name} requires grad, but the loss differentiates only v: pass {name}.detach()")
    if kl not in KL_FORMS:
        raise ValueError(f"unknown kl {kl!r}: expected one of {', '.join(KL_FORMS)}")
    if kl_std not in KL_STDS:
        raise ValueError(f"unknown kl_std {kl_std!r}: expected one of {', '.join(KL_STDS)}")
    check_loss_settings(clip_range, beta, kl_given=v_ref is not None, kl_source="the reference velocity v_ref")
    rows = tuple(row_values(name, value, v) for name, value in (
        ("sigma", sigma), ("sigma_next", sigma_next), ("noise_level", noise_level), ("noise_scale", noise_scale)))
    check_step_values(*rows, kind=kind)
    old = row_values("old_log_prob", old_log_prob, v, scalar_ok=False)
    adv = row_values("advantages", advantages, v, scalar_ok=False)
    weight = row_values("weights", 1.0 if weights is None else weights, v, scalar_ok=weights is None)
    if not runs_fused(kind, resolve_backend(v, backend)):
        return grpo_transition_loss_reference(
            v, x_t, x_next, sigma, sigma_next, old_log_prob, advantages, kind=kind, noise_level=noise_level,
            noise_scale=noise_scale, reduce=reduce, clip_range=clip_range, weights=weights, v_ref=v_ref, beta=beta,
            kl=kl, kl_std=kl_std)
    from .loss_triton import grpo_transition_loss_triton

    return grpo_transition_loss_triton(
        v.contiguous(), x_t.contiguous(), x_next.contiguous(), None if v_ref is None else v_ref.contiguous(), rows,
        old, adv, weight, kind=kind, reduce=reduce, clip_range=clip_range, beta=beta, kl=kl, kl_std=kl_std)
