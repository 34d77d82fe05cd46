"""The memoryless SDE of adjoint matching, as DRL samples with it (Beltran-Velez et al. 2026, arXiv 2606.19162,
Alg. 2 and Eqs. 34–35; flowalign.objectives.adjoint_matching_math holds the adjoint and the loss that train on its
trajectories).

flowalign's sigma is ``s = 1 - t`` (the paper's time runs from noise 0 to data 1) and its velocity ``v = dx/ds`` is
minus the paper's. With offsets ``delta`` and ``eps`` (the paper: both one step, ``1 / K``) and ``u = 1 - s + delta``:

* **Memoryless SDE.** ``dX = (2 v_paper - X / u) dt + sqrt(2 (1 - t + eps) / u) dB``; without the offsets this is
  ``sde_step(kind="flow_grpo", noise_level=sqrt(2))``.
* **Local-linear step** (Eq. 35) from ``s`` to ``s'``: ``Phi = u / u'``, ``Omega = u' (1 - Phi^2)``,
  ``V = (1 + delta + eps)(1 - Phi^2) - (2/3)(u' - Phi^2 u)``, and ``X' = Phi X - Omega v(X, s) + sqrt(V) xi``.
* **Euler–Maruyama with offsets** (Eq. 34), ``dt = s - s'``:
  ``X' = X + (-2 v - X / u) dt + sqrt(2 (s + eps) dt / u) xi``.
* **A trajectory** (``sample_memoryless``): those steps on the grid, the last one a deterministic denoising call.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import Tensor

from .sde import check_sigmas

__all__ = ["INTEGRATORS", "Integrator", "check_integrator", "diffusion_coefficient", "local_linear_coefficients",
           "memoryless_step", "sample_memoryless", "u_offset"]

Integrator = Literal["local_linear", "euler"]
INTEGRATORS: tuple[str, ...] = ("local_linear", "euler")


def u_offset(sigma: Tensor | float, delta: float) -> Tensor:
    return 1.0 - torch.as_tensor(sigma, dtype=torch.float64) + delta


def check_integrator(integrator: str) -> None:
    if integrator not in INTEGRATORS:
        raise ValueError(f"integrator must be one of {INTEGRATORS}, got {integrator!r}")


def local_linear_coefficients(sigma: float | Tensor, sigma_next: float | Tensor, *, delta: float,
                              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(Phi, Omega, V)`` of the local-linear step from ``sigma`` to ``sigma_next`` (Eq. 35), in float64."""
    u, u_next = u_offset(sigma, delta), u_offset(sigma_next, delta)
    phi = u / u_next
    omega = u_next * (1 - phi ** 2)
    variance = (1 + delta + eps) * (1 - phi ** 2) - 2.0 / 3.0 * (u_next - phi ** 2 * u)
    return phi, omega, variance


def diffusion_coefficient(sigma: float | Tensor, *, delta: float, eps: float) -> Tensor:
    """``sigma_k = sqrt(2 (s + eps) / u)``, the memoryless SDE's noise scale with the paper's offsets."""
    return torch.sqrt(2 * (torch.as_tensor(sigma, dtype=torch.float64) + eps) / u_offset(sigma, delta))


def memoryless_step(x: Tensor, v: Tensor, sigma: float | Tensor, sigma_next: float | Tensor, noise: Tensor, *,
                    delta: float, eps: float, integrator: Integrator = "local_linear") -> Tensor:
    """One step of the memoryless SDE from ``sigma`` to ``sigma_next`` with the standard normal ``noise``."""
    check_integrator(integrator)
    if integrator == "local_linear":
        phi, omega, variance = local_linear_coefficients(sigma, sigma_next, delta=delta, eps=eps)
        out = phi * x.double() - omega * v.double() + variance.clamp_min(0).sqrt() * noise.double()
    else:
        dt = torch.as_tensor(sigma, dtype=torch.float64) - torch.as_tensor(sigma_next, dtype=torch.float64)
        drift = -2 * v.double() - x.double() / u_offset(sigma, delta)
        out = x.double() + drift * dt + diffusion_coefficient(sigma, delta=delta, eps=eps) * dt.sqrt() * noise.double()
    return out.to(x.dtype)


def sample_memoryless(velocity: Callable[[Tensor, Tensor], Tensor], x: Tensor, sigmas: Tensor, *,
                      generator: torch.Generator | None = None, delta: float | None = None, eps: float | None = None,
                      integrator: Integrator = "local_linear") -> list[Tensor]:
    """A trajectory ``X_0 .. X_K`` of the memoryless SDE from the noise ``x`` on ``sigmas`` (the paper's grid:
    ``torch.linspace(1, 0, K + 1)``), the last step one deterministic denoising call ``X_K = X_{K-1} - sigma_{K-1} v``
    (the paper's Alg. 2; in float64 like the steps, so not ``predict_x0``, which is fp32); ``delta`` and ``eps``
    default to the first step's size."""
    check_sigmas(sigmas)
    step = float(sigmas[0] - sigmas[1])
    delta = step if delta is None else delta
    eps = step if eps is None else eps
    states = [x]
    for k in range(len(sigmas) - 1):
        v = velocity(states[-1], sigmas[k])
        if k == len(sigmas) - 2:
            states.append((states[-1].double() - float(sigmas[k]) * v.double()).to(x.dtype))
            break
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)  # a CPU generator: any device
        states.append(memoryless_step(states[-1], v, sigmas[k], sigmas[k + 1], noise, delta=delta, eps=eps,
                                      integrator=integrator))
    return states
