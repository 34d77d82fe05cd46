"""Adjoint matching on the memoryless SDE, as DRL trains with it (Beltran-Velez et al. 2026, "The Reward Was in Your
Data All Along", arXiv 2606.19162, Alg. 2 and App. F–G; adjoint matching itself: Domingo-Enrich et al. 2025). No
public code exists; this follows the paper's equations as ``../shared/METHODS.md`` §3 transcribes them.

The paper's time ``t`` runs from noise (0) to data (1); flowalign's sigma is ``s = 1 - t`` and its velocity
``v = dx/ds`` is minus the paper's, so every formula below is the paper's with ``t = 1 - s`` and ``v -> -v``.
With offsets ``delta`` and ``eps`` (the paper: both one step, ``1 / K``) and ``u = 1 - s + delta``:

* **Memoryless SDE.** ``dX = (2 v_paper - X / u) dt + sqrt(2 (1 - t + eps) / u) dB``; without the offsets this is
  ``sde_step(kind="flow_grpo", noise_level=sqrt(2))`` (METHODS.md §3, Identity 2).
* **Local-linear step** (Eq. 35) from ``s`` to ``s'``: ``Phi = u / u'``, ``Omega = u' (1 - Phi^2)``,
  ``V = (1 + delta + eps)(1 - Phi^2) - (2/3)(u' - Phi^2 u)``, and ``X' = Phi X - Omega v(X, s) + sqrt(V) xi``.
* **Euler–Maruyama with offsets** (Eq. 34), ``dt = s - s'``:
  ``X' = X + (-2 v - X / u) dt + sqrt(2 (s + eps) dt / u) xi``.
* **Lean adjoint** (Eqs. 37–38), backwards from ``a_K = -lambda grad r(X_K)`` with the *base* velocity's
  vector-Jacobian product ``J^T a = (d v_base / d x)(X', s')^T a'``: local-linear ``a = Phi (a' - 2 dt J^T a')``,
  Euler ``a = a' - dt (2 J^T a' + a' / u')``.
* **Loss** at the trained steps ``S``: ``L = 1/(2|S|) sum_k ||(2 / sigma_k)(v_theta - v_base)(X_k, s_k) - sigma_k a_k||^2``
  with ``sigma_k = sqrt(2 (s_k + eps) / u_k)`` (the diffusion coefficient), the norm summed over a sample's
  dimensions; the trainer averages it over samples. At the optimum ``v_theta - v_base = sigma^2 a / 2``: the
  memoryless SDE's optimal control toward ``p_base exp(lambda r)``.
* **Stratified steps**: a fraction (0.4) of the ``K`` steps, half drawn below ``t = 0.6`` and half at or above it.
* **Outlier clipping**: per-sample losses above ``tau_n = rho tau_{n-1} + (1 - rho) min(q_alpha, c tau_{n-1})`` are
  masked, ``q_alpha`` the batch's alpha-quantile (alpha 0.9, rho 0.9, spike cap c 5; the first batch starts the
  threshold at its own quantile).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from flowalign.samplers.memoryless import (INTEGRATORS, Integrator, check_integrator, diffusion_coefficient,
                                          local_linear_coefficients, u_offset)


def lean_adjoint_step(adjoint_next: Tensor, vjp_next: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, *,
                      delta: float, eps: float = 0.0, integrator: Integrator = "local_linear") -> Tensor:
    """The lean adjoint one step back, ``a_k`` from ``a_{k+1}`` and ``J^T a_{k+1}`` (the base velocity's
    vector-Jacobian product at ``(X_{k+1}, sigma_next)``); ``eps`` is not used (the adjoint has no noise term)."""
    check_integrator(integrator)
    dt = torch.as_tensor(sigma, dtype=torch.float64) - torch.as_tensor(sigma_next, dtype=torch.float64)
    a, jta = adjoint_next.double(), vjp_next.double()
    if integrator == "local_linear":
        phi = local_linear_coefficients(sigma, sigma_next, delta=delta, eps=eps)[0]
        out = phi * (a - 2 * dt * jta)
    else:
        out = a - dt * (2 * jta + a / u_offset(sigma_next, delta))
    return out.to(adjoint_next.dtype)


def lean_adjoints(states: list[Tensor], sigmas: Tensor, terminal_adjoint: Tensor,
                  velocity: Callable[[Tensor, Tensor], Tensor], *, delta: float, eps: float = 0.0,
                  integrator: Integrator = "local_linear") -> list[Tensor]:
    """Every ``a_k`` of a trajectory ``states`` (``X_0 .. X_K`` on ``sigmas``, ``K + 1`` of each), backwards from
    ``terminal_adjoint`` (``-lambda grad r(X_K)``); ``velocity(x, sigma)`` is the base model's, whose
    vector-Jacobian products ``torch.autograd.functional.vjp`` takes (one reverse pass per step, no graph kept)."""
    if len(states) != len(sigmas):
        raise ValueError(f"{len(states)} states for {len(sigmas)} sigmas: give X_0 .. X_K on sigma_0 .. sigma_K")
    backwards = [terminal_adjoint]
    for k in range(len(sigmas) - 2, -1, -1):
        _, vjp = torch.autograd.functional.vjp(lambda x, s=sigmas[k + 1]: velocity(x, s), states[k + 1], backwards[-1])
        backwards.append(lean_adjoint_step(backwards[-1], vjp, sigmas[k], sigmas[k + 1], delta=delta, eps=eps,
                                           integrator=integrator))
    return backwards[::-1]


def adjoint_matching_loss(v_theta: Tensor, v_base: Tensor, adjoint: Tensor, sigma: float | Tensor, *, delta: float,
                          eps: float) -> Tensor:
    """Per-sample ``1/2 ||(2 / sigma_k)(v_theta - v_base) - sigma_k a_k||^2`` at one step (summed over a sample's
    dimensions; float32 out); ``sigma`` a float or one per row ``[B]``. Average it over the trained steps and the
    samples."""
    scale = diffusion_coefficient(sigma, delta=delta, eps=eps).float().to(v_theta.device)
    if scale.ndim:  # one noise level per row
        scale = scale.reshape(-1, *([1] * (v_theta.ndim - 1)))
    residual = (2 / scale) * (v_theta.float() - v_base.float()) - scale * adjoint.float()
    return 0.5 * residual.pow(2).flatten(1).sum(1)


def stratified_steps(num_steps: int, *, fraction: float = 0.4, split: float = 0.6,
                     generator: torch.Generator | None = None) -> Tensor:
    """The trained step indices: ``round(fraction K)`` of the ``K`` steps, half with ``t_k < split`` (``sigma > 1 -
    split``) and half at or above it, each half drawn without replacement; sorted."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    t = torch.arange(num_steps, dtype=torch.float64) / num_steps
    low, high = torch.nonzero(t < split).flatten(), torch.nonzero(t >= split).flatten()
    total = max(1, round(fraction * num_steps))
    take_low = min(len(low), total // 2 + total % 2)
    take_high = min(len(high), total - take_low)
    picked = [pool[torch.randperm(len(pool), generator=generator)[:n]]
              for pool, n in ((low, take_low), (high, take_high))]
    return torch.sort(torch.cat(picked)).values


@dataclass
class OutlierClip:
    """Adaptive clipping of per-sample losses (App. G): ``tau_n = rho tau_{n-1} + (1 - rho) min(q_alpha, c
    tau_{n-1})``; ``mask`` keeps the losses at or under ``tau_n``. ``tau`` is None until the first batch (which
    sets it to its own quantile); it is the state a checkpoint keeps."""

    alpha: float = 0.9
    rho: float = 0.9
    cap: float = 5.0
    tau: float | None = None

    def quantile(self, losses: Tensor) -> float:
        """``q_alpha`` of a batch's per-sample losses."""
        return float(torch.quantile(losses.detach().double(), self.alpha))

    def update(self, quantile: float) -> float:
        """``tau_n`` from ``tau_{n-1}`` and a batch's ``q_alpha`` (the first batch: ``q_alpha`` itself)."""
        self.tau = quantile if self.tau is None else self.rho * self.tau + (1 - self.rho) * min(quantile,
                                                                                                 self.cap * self.tau)
        return self.tau

    def mask(self, losses: Tensor) -> Tensor:
        """Update ``tau`` with this batch's quantile, then keep the losses at or under it (the paper's order)."""
        self.update(self.quantile(losses))
        return losses.detach() <= self.tau


__all__ = ["INTEGRATORS", "OutlierClip", "adjoint_matching_loss", "lean_adjoint_step", "lean_adjoints",
           "stratified_steps"]
