"""The registry of SDE step kinds: each kind is one registered function giving a step's Gaussian mean and std.

A kind is a function ``(x, v, s, s_next, a) -> (mean, std)`` of fp32 tensors: the state ``x`` and the velocity ``v``
(shape ``[batch, ...]``), the sigma ``s``, the next sigma ``s_next`` and the noise level ``a`` (each broadcastable
``[batch or 1, 1, ..., 1]``). It returns the step's mean (shape of ``x``) and std (broadcastable ``[batch or 1, 1,
..., 1]``); everything else (the draw, the rounding, the exact log-prob, the checks, the loss) is shared::

    from flowalign.samplers import register_sde_kind

    @register_sde_kind("ode_plus_noise")
    def ode_plus_noise(x, v, s, s_next, a):
        return x + (s_next - s) * v, a * (s - s_next).sqrt()

after which ``sampling.kind: ode_plus_noise`` works in a config (``flowalign.training.config`` checks the name
against this registry, with a did-you-mean). ``max_noise_level`` bounds the noise level (``cps``: 1);
``kl_std_t=False`` says the std is not ``std_t sqrt(s - s')`` (``cps``), so the latent-mean KL uses the transition
std (``loss_reference.kl_std_scale``).

The three built-in kinds (formulas in ``flowalign.samplers.sde``) also have a fused Triton kernel (``FUSED_KINDS``,
``sde_triton``, ``loss_triton``); a registered kind without one runs on the torch reference path on every device,
and ``flowalign.kernels.dispatch`` says so once per kind.

This registry lives in ``kernels`` (the lowest layer, which imports nothing of flowalign) because the reference step
and the reference GRPO loss both read the kind here; ``flowalign.samplers`` re-exports it.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

__all__ = ["FUSED_KINDS", "SDEKind", "register_sde_kind", "registered_sde_kinds", "sde_kind"]

# (x, v, s, s_next, a) -> (mean, std), all fp32 (module docstring)
MeanStd = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], "tuple[Tensor, Tensor]"]

# The kinds with a Triton kernel (sde_triton.KIND_CODES, loss_triton).
FUSED_KINDS = ("flow_grpo", "dance", "cps")


@dataclass(frozen=True)
class SDEKind:
    """A registered SDE step kind: its name, its ``mean_std`` function and what the shared checks need of it."""

    name: str
    mean_std: MeanStd
    max_noise_level: float | None = None
    kl_std_t: bool = True

    @property
    def fused(self) -> bool:
        """Whether a Triton kernel runs this kind (the built-in ones)."""
        return self.name in FUSED_KINDS


_KINDS: dict[str, SDEKind] = {}


def register_sde_kind(name: str, *, max_noise_level: float | None = None,
                      kl_std_t: bool = True) -> Callable[[MeanStd], MeanStd]:
    """Decorator: register ``fn(x, v, s, s_next, a) -> (mean, std)`` as the SDE kind ``name`` (module docstring).
    A name already registered is refused (ValueError), so a kind cannot silently replace another."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an SDE kind's name must be a non-empty string, got {name!r}")
    if max_noise_level is not None and not (math.isfinite(max_noise_level) and max_noise_level > 0):
        raise ValueError(f"max_noise_level must be a finite number > 0 or None, got {max_noise_level!r}")

    def register(fn: MeanStd) -> MeanStd:
        if name in _KINDS:
            raise ValueError(f"SDE kind {name!r} is already registered (by {_KINDS[name].mean_std.__module__}."
                             f"{_KINDS[name].mean_std.__qualname__}): choose another name")
        _KINDS[name] = SDEKind(name, fn, max_noise_level, kl_std_t)
        return fn

    return register


def registered_sde_kinds() -> tuple[str, ...]:
    """Every registered kind's name, the built-in ones first, then in registration order."""
    return tuple(_KINDS)


def sde_kind(name: str) -> SDEKind:
    """The registered kind ``name``; ValueError naming the registered ones (and the closest) otherwise."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        close = difflib.get_close_matches(str(name), list(_KINDS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown SDE kind {name!r}: expected one of {', '.join(_KINDS)} (or register one with "
                         f"flowalign.samplers.register_sde_kind){hint}") from None


# ------------------------------------------------------------------------------------------------ the built-in kinds


@register_sde_kind("flow_grpo")
def flow_grpo(x: Tensor, v: Tensor, s: Tensor, s_next: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """Flow-GRPO's SDE (Liu et al. 2025, eq. 9)."""
    dt = s_next - s
    # At s = 1 the ratio s / (1 - s) is infinite; Flow-GRPO uses the next sigma in the denominator there.
    denominator = torch.where(s >= 1, 1 - s_next, 1 - s)
    std_t = a * torch.sqrt(s / denominator)
    mean = x * (1 + std_t**2 * dt / (2 * s)) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_t * torch.sqrt(-dt)


@register_sde_kind("dance")
def dance(x: Tensor, v: Tensor, s: Tensor, s_next: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """DanceGRPO's SDE (Xue et al. 2025): a constant diffusion coefficient."""
    dt = s_next - s
    x0_hat = x - s * v
    score = -(x - x0_hat * (1 - s)) / s**2
    mean = x + dt * v - 0.5 * a**2 * score * dt
    return mean, a * torch.sqrt(-dt)


@register_sde_kind("cps", max_noise_level=1.0, kl_std_t=False)
def cps(x: Tensor, v: Tensor, s: Tensor, s_next: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """Coefficient-preserving sampling (Wang & Yu 2025): the next state's noise coefficient is exactly ``s'``."""
    x0_hat = x - s * v
    x1_hat = x + (1 - s) * v
    std = s_next * torch.sin(a * math.pi / 2)
    mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt((s_next**2 - std**2).clamp_min(0))
    return mean, std
