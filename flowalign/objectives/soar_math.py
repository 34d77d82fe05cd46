"""SOAR's math (Qin et al. 2026, "Self-Correction for Optimal Alignment and Refinement", arXiv 2604.12617), as the
released training script computes it: pure functions on tensors, used by the ``soar`` objective.

Notation: sigma ``s`` runs from 1 (noise ``z1``) to 0 (data ``z0``); ``z_s = (1 - s) z0 + s z1``; the model predicts
``v = z1 - z0``. Time ``t`` in [0, 1] indexes the training table (``t = 1`` noise).

* The training table: ``n = 1000`` entries ``sigma_i = shift σ / (1 + (shift - 1) σ)``, ``σ = (n - i)/n``,
  ``i = 0..n-1`` (1 down to about 0.003 at shift 3, no trailing 0), ``timestep_i = n sigma_i``, in fp32 exactly as
  diffusers' ``FlowMatchEulerDiscreteScheduler(shift=3)`` builds it before ``set_timesteps`` (``training_table``).
* ``t -> sigma``: entry ``clamp(floor((1 - t) n), 0, n - 1)`` (``table_sigma``).
* The model's timestep at an auxiliary sigma ``s'`` (``aux_model_sigma``): the first entry with ``sigma <= s'``
  (index ``i*``), converted to ``t' = 1 - i*/n`` and back through ``t -> sigma``; in fp32 that round trip lands on
  entry ``i* - 1`` for 165 of the 1000 indices at shift 3, which ``mode="released"`` reproduces; ``mode="continuous"``
  gives the model ``s'`` itself (the sigma the target uses).
* One stop-gradient Euler step ``t1 = max(t0 - 1/K, 0)`` (in t), ``z1' = z_t0 + v_cfg (s1 - s0)``, or a stochastic
  step (``rollout_step``) for the samples with ``t1 > 0``.
* Auxiliary sigmas ``s' = s1 + u (1 - s1)``, ``u ~ U[0, 1)`` (``aux_sigmas``); auxiliary points re-noised toward the
  *same* noise, ``a = clamp((s' - s1) / max(1 - s1, 1e-8), 0, 1)``, ``z' = (1 - a) z1' + a z1``, and their correction
  targets ``v_corr = (z' - z0) / s'`` (``soar_aux_points``): the velocity that lands on ``z0`` from ``z'``.
* The loss, normalised by the global counts (``soar_loss``):
  ``L = (sum_b l_base + lambda sum l_aux) / max(B_global + lambda N_aux_global, 1) * num_processes``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from flowalign.samplers import ode_step, predict_x0

__all__ = ["AuxPoints", "ROLLOUT_KINDS", "aux_model_sigma", "aux_sigmas", "clean_boundary", "next_time",
           "rollout_step", "soar_aux_points", "soar_loss", "table_sigma", "training_table"]

ROLLOUT_KINDS = ("ode", "flow_sde", "cps", "simple", "sde")


class AuxPoints(NamedTuple):
    """Auxiliary latents ``[N, B, ...]`` and their correction targets ``v_corr`` ``[N, B, ...]``."""

    latents: Tensor
    targets: Tensor


@lru_cache(maxsize=8)
def _table(shift: float, size: int) -> tuple[Tensor, Tensor]:
    sigmas = torch.arange(size, 0, -1, dtype=torch.float32) / size
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas, sigmas * size


def training_table(shift: float = 3.0, size: int = 1000) -> tuple[Tensor, Tensor]:
    """``(sigmas, timesteps)``, ``[size]`` fp32 each: the shifted training table (module docstring); copies."""
    sigmas, timesteps = _table(float(shift), int(size))
    return sigmas.clone(), timesteps.clone()


def _index_of_time(t: Tensor, size: int) -> Tensor:
    return ((1.0 - t) * size).long().clamp(0, size - 1)


def table_sigma(t: Tensor, sigmas: Tensor) -> Tensor:
    """The table's sigma for times ``t`` (fp32): entry ``clamp(floor((1 - t) n), 0, n - 1)``."""
    t = torch.as_tensor(t, dtype=torch.float32)
    return sigmas.to(t.device)[_index_of_time(t, len(sigmas))]


def next_time(t0: Tensor, num_sampling_steps: int) -> Tensor:
    """``t1 = max(t0 - 1/K, 0)``: one sampling step of ``K`` later, in t (not sigma)."""
    return (t0 - 1.0 / float(num_sampling_steps)).clamp_min(0.0)


def clean_boundary(t0: Tensor, num_sampling_steps: int) -> Tensor:
    """Samples whose step reaches ``t1 = 0`` (they keep only the ODE path)."""
    return next_time(t0, num_sampling_steps) <= 0


def aux_sigmas(sigma_t1: Tensor, u: Tensor) -> Tensor:
    """``s' = s1 + u (1 - s1)`` for uniforms ``u`` ``[N, B]`` (the upper end is 1: the released code's
    ``sigma_upper``, whatever its ``sigma_upper_ratio`` says)."""
    return sigma_t1.unsqueeze(0) + u * (1.0 - sigma_t1).unsqueeze(0)


def aux_model_sigma(sigma_aux: Tensor, sigmas: Tensor, mode: Literal["released", "continuous"] = "released") -> Tensor:
    """The sigma the model is evaluated at for auxiliary sigmas ``sigma_aux`` (its timestep is ``n`` times it).

    ``released``: the table entry the released code's round trip lands on (module docstring), so the model sees the
    table's timestep; ``continuous``: ``sigma_aux`` itself."""
    if mode == "continuous":
        return sigma_aux.clone()
    if mode != "released":
        raise ValueError(f"mode must be 'released' or 'continuous', got {mode!r}")
    size = len(sigmas)
    table = sigmas.to(device=sigma_aux.device, dtype=sigma_aux.dtype)
    index = torch.searchsorted(-table, -sigma_aux.contiguous()).clamp(0, size - 1)
    t = 1.0 - index.float() / size
    return table[_index_of_time(t, size)]


def soar_aux_points(z0: Tensor, z1: Tensor, z_t1: Tensor, sigma_t1: Tensor, sigma_aux: Tensor) -> AuxPoints:
    """Auxiliary points between the one-step state ``z_t1`` and the same noise ``z1``, and their targets.

    ``z0``, ``z1``, ``z_t1``: ``[B, ...]``; ``sigma_t1``: ``[B]``; ``sigma_aux``: ``[N, B]``. With
    ``a = clamp((s' - s1) / max(1 - s1, 1e-8), 0, 1)``: ``z' = (1 - a) z_t1 + a z1`` and ``v_corr = (z' - z0) / s'``,
    both ``[N, B, ...]``. For an on-trajectory ``z_t1 = (1 - s1) z0 + s1 z1``, ``v_corr = z1 - z0``."""
    if z0.shape != z1.shape or z0.shape != z_t1.shape:
        raise ValueError(f"z0, z1 and z_t1 must have one shape, got {tuple(z0.shape)}, {tuple(z1.shape)}, "
                         f"{tuple(z_t1.shape)}")
    batch = z0.shape[0]
    if sigma_t1.shape != (batch,) or sigma_aux.ndim != 2 or sigma_aux.shape[1] != batch:
        raise ValueError(f"sigma_t1 must be [B] and sigma_aux [N, B] with B = {batch}, got {tuple(sigma_t1.shape)} "
                         f"and {tuple(sigma_aux.shape)}")
    view = (*sigma_aux.shape, *([1] * (z0.ndim - 1)))
    alpha = ((sigma_aux - sigma_t1) / (1.0 - sigma_t1).clamp_min(1e-8)).clamp(0.0, 1.0)
    alpha = alpha.view(view).to(z0.dtype)
    latents = (1.0 - alpha) * z_t1 + alpha * z1
    targets = (latents - z0) / sigma_aux.view(view).to(z0.dtype)
    return AuxPoints(latents, targets)


def rollout_step(kind: str, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, noise: Tensor | None = None, *,
                 noise_scale: float = 0.5, sigma_max: float | None = None) -> Tensor:
    """One step ``sigma -> sigma_next`` (``[B]`` each) from ``x`` with velocity ``v``, as the released rollout takes it.

    ``ode``: ``x + v dt``. The stochastic kinds use ``noise`` (standard normal, like ``x``), ``a = noise_scale``:

    * ``flow_sde``: the ``flow_grpo`` step, ``std = a sqrt(s / (1 - s))`` with ``sigma_max`` (the table's second
      entry) in place of ``s`` in the denominator when ``s = 1``; mean ``x (1 + std^2 dt / (2 s)) +
      v (1 + std^2 (1 - s) / (2 s)) dt``, plus ``std sqrt(-dt) noise``;
    * ``cps``: ``std = s' sin(a pi / 2)``, mean ``x0_hat (1 - s') + eps_hat sqrt(s'^2 - std^2)``, plus ``std noise``;
    * ``simple``: ``x + v dt + a sqrt(|dt|) noise``;
    * ``sde``: ``x0_hat (1 - s') + s' noise``.

    Computed in fp32, returned in ``x``'s dtype. The ODE step is ``flowalign.samplers.ode_step`` and ``x0_hat`` is
    ``flowalign.samplers.predict_x0``. The stochastic kinds stay the released script's own arithmetic: ``flow_sde`` and
    ``cps`` are the formulas of ``kernels/sde_reference.sde_mean_std`` (``flow_grpo``, ``cps``) but not its bits
    (``flow_sde`` divides by ``1 - sigma_max`` at ``s = 1`` where the kernel divides by ``1 - s'``, and multiplies
    ``std^2 / (2 s)`` by ``dt`` in another order; ``cps`` takes ``sin`` in float64), and ``simple`` and ``sde`` are not
    kernel kinds."""
    if kind not in ROLLOUT_KINDS:
        raise ValueError(f"rollout kind must be one of {', '.join(ROLLOUT_KINDS)}, got {kind!r}")
    if kind == "ode":
        return ode_step(x, v, sigma, sigma_next)
    view = (-1, *([1] * (x.ndim - 1)))
    xf, vf = x.float(), v.float()
    s, s_next = sigma.float().view(view), sigma_next.float().view(view)
    dt = s_next - s
    if noise is None or noise.shape != x.shape:
        raise ValueError(f"rollout kind {kind!r} needs standard-normal noise shaped like x {tuple(x.shape)}")
    xi = noise.float()
    if kind == "simple":
        out = xf + vf * dt + noise_scale * dt.abs().sqrt() * xi
    elif kind == "sde":
        out = (1.0 - s_next) * predict_x0(x, v, sigma) + s_next * xi
    elif kind == "flow_sde":
        if sigma_max is None:
            raise ValueError("rollout kind 'flow_sde' needs sigma_max (the training table's second sigma)")
        safe = torch.where(s == 1, torch.full_like(s, sigma_max), s)
        std = torch.sqrt(s / (1 - safe)) * noise_scale
        mean = xf * (1 + (std.square() / (2 * s)) * dt) + vf * (1 + (std.square() * (1 - s) / (2 * s))) * dt
        out = mean + std * (-dt).clamp_min(0.0).sqrt() * xi
    else:  # cps
        std = s_next * math.sin(noise_scale * math.pi / 2)
        mean = (predict_x0(x, v, sigma) * (1 - s_next)
                + (xf + vf * (1 - s)) * (s_next.square() - std.square()).clamp_min(0.0).sqrt())
        out = mean + std * xi
    return out.to(x.dtype)


def soar_loss(base_losses: Tensor, aux_losses: Tensor, *, lambda_aux: float = 1.0, base_count: float | None = None,
              aux_count: float | None = None, num_processes: int = 1) -> Tensor:
    """``(sum l_base + lambda sum l_aux) / max(B_global + lambda N_aux_global, 1) * num_processes``.

    ``base_losses`` / ``aux_losses``: this process's per-sample and per-(point, sample) MSEs; ``base_count`` /
    ``aux_count``: their numbers over every process (the released code all-reduces them; default: this process's).
    Averaged over processes (DDP), the gradient is that of the global sum over the global count."""
    base_count = float(base_losses.numel()) if base_count is None else float(base_count)
    aux_count = float(aux_losses.numel()) if aux_count is None else float(aux_count)
    total = base_losses.float().sum() + lambda_aux * aux_losses.float().sum()
    return total / max(base_count + lambda_aux * aux_count, 1.0) * num_processes
