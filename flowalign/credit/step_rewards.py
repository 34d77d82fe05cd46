"""Per-step rewards from the rewards of intermediate states (DenseGRPO, TP-GRPO) and DenseGRPO's noise calibration.

Notation: a trajectory visits states ``x_0 .. x_T`` (``x_0`` the initial noise, ``x_T`` the final latent); ``R_k`` is
the reward of the clean estimate of ``x_k`` (``flowalign.reward_models.intermediate``), so ``R_T`` is the terminal
reward. Transition ``t`` (0-based) is ``x_t -> x_{t+1}``. All functions take ``R`` as ``[B, T + 1]`` and return
per-transition values ``[B, T]``; NaN marks a value that cannot be computed (an invalid reward).

* **Dense increments** (DenseGRPO, Deng et al. 2026): ``dR_t = R_{t+1} - R_t``, the reward the step itself added.
* **Return to go**: ``R_T - R_t``, what the rest of the trajectory from ``x_t`` added (a lower-variance variant worth
  measuring when the estimates saturate early).
* **Turning points** (TP-GRPO, Tong et al. 2026, arXiv:2602.06422): with ``d_t = R_{t+1} - R_t`` and the global
  trend ``D = R_T - R_0`` (``R_0`` from the trajectory's *own* initial noise; the public code draws fresh noise for
  it, which compares against an unrelated image), transition ``t`` is a turning point when

  - ``t = 0``: ``sign(d_0) sign(R_T - R_1) > 0``;
  - ``t >= 1``: ``sign(d_{t-1}) sign(D) < 0`` and ``sign(d_t) sign(D) > 0`` and ``sign(d_t) sign(R_T - R_{t+1}) > 0``:
    the local trend flips back towards the global one and stays consistent with it to the end.

  A turning point's reward is the aggregated ``R_T - R_t`` (its delayed effect); every other transition gets
  ``d_t``. A zero sign never qualifies, so the last transition (``R_T - R_T = 0``) is never a turning point.
  ``balanced``: within each pool (a GRPO group), when both signs occur, only ``min(#positive, #negative)`` turning
  points of each sign keep the aggregated reward, those of the trajectories with the largest ``|D|`` (ties by
  index); the others revert to ``d_t``. (The public code balances over each per-GPU sampling batch, which makes the
  result depend on the process layout.)

DenseGRPO's noise calibration (:func:`calibrate_noise`) adjusts a per-step noise level ``psi(t)`` from the signs of
the dense rewards its SDE steps produce: ``psi(t) += eps2`` where ``|#(dR_t > 0) - #(dR_t < 0)| < eps1``, else
``psi(t) -= eps2`` (docs/design/math.md#calibration; eps1 = 2, eps2 = 0.01).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["ESTIMATORS", "calibrate_noise", "dense_increments", "return_to_go", "turning_point_rewards"]

ESTIMATORS = ("terminal", "dense", "return_to_go", "turning_point", "registers")


def _check(rewards: Tensor) -> Tensor:
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [B, T + 1] with T >= 1 (R_0 .. R_T), got shape {tuple(rewards.shape)}")
    return rewards


def dense_increments(rewards: Tensor) -> Tensor:
    """``dR_t = R_{t+1} - R_t`` per transition, ``[B, T]`` float64."""
    rewards = _check(rewards)
    return rewards[:, 1:] - rewards[:, :-1]


def return_to_go(rewards: Tensor) -> Tensor:
    """``R_T - R_t`` per transition, ``[B, T]`` float64."""
    rewards = _check(rewards)
    return rewards[:, -1:] - rewards[:, :-1]


def turning_point_rewards(
    rewards: Tensor, *, balanced: bool = False, pools: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """TP-GRPO step rewards: ``(step_rewards [B, T], is_turning_point [B, T])``; see the module docstring.

    ``pools[b]`` groups the trajectories that ``balanced`` balances together (default: all of them). A trajectory with
    a NaN reward anywhere gets NaN step rewards and no turning point.
    """
    rewards = _check(rewards)
    increments = dense_increments(rewards)
    final = rewards[:, -1:]
    sign_d = torch.sign(increments)
    sign_global = torch.sign(final - rewards[:, :1])
    sign_rest = torch.sign(final - rewards[:, 1:])  # sign(R_T - R_{t+1}) for transition t
    consistent = sign_d * sign_rest > 0
    turning = torch.zeros_like(consistent)
    turning[:, 0] = consistent[:, 0]
    if increments.shape[1] > 1:
        flips_back = (sign_d[:, :-1] * sign_global < 0) & (sign_d[:, 1:] * sign_global > 0)
        turning[:, 1:] = flips_back & consistent[:, 1:]
    finite = torch.isfinite(rewards).all(dim=1, keepdim=True)
    turning &= finite
    if balanced:
        turning = _balance(turning, (final - rewards[:, :1]).flatten(), pools)
    step_rewards = torch.where(turning, final - rewards[:, :-1], increments)
    return torch.where(finite, step_rewards, torch.full_like(step_rewards, float("nan"))), turning


def _balance(turning: Tensor, trend: Tensor, pools: Tensor | None) -> Tensor:
    """Keep ``min(#pos, #neg)`` turning points of each sign per pool, by decreasing ``|trend|`` (ties by index)."""
    pools = torch.zeros(turning.shape[0], dtype=torch.long) if pools is None else torch.as_tensor(pools)
    if pools.shape != (turning.shape[0],):
        raise ValueError(f"pools must have one entry per trajectory ({turning.shape[0]}), got {tuple(pools.shape)}")
    kept = turning.clone()
    for pool in pools.unique():
        rows, cols = torch.nonzero(turning & (pools == pool)[:, None], as_tuple=True)
        signs = torch.sign(trend[rows])
        positive, negative = int((signs > 0).sum()), int((signs < 0).sum())
        if positive == 0 or negative == 0:
            continue
        quota = min(positive, negative)
        for side in (1.0, -1.0):
            members = [(-abs(float(trend[r])), int(r), int(c)) for r, c in zip(rows, cols) if torch.sign(trend[r]) == side]
            for _, r, c in sorted(members)[quota:]:
                kept[r, c] = False
    return kept


def calibrate_noise(
    levels: Sequence[float] | Tensor,
    increments: Tensor,
    *,
    eps1: float = 2.0,
    eps2: float = 0.01,
    steps: Sequence[int] | None = None,
    low: float = 0.0,
    high: float | None = None,
) -> Tensor:
    """One DenseGRPO calibration update of the per-step noise levels ``psi``.

    ``increments`` is ``[B, T]`` (``dR`` of a batch of trajectories sampled with ``levels``; NaN entries are ignored).
    For each step in ``steps`` (default: every step with a positive level), ``psi += eps2`` when the counts of positive
    and negative ``dR`` differ by less than ``eps1``, else ``psi -= eps2``; the result is clamped to ``[low, high]``.
    Steps outside ``steps`` keep their level.
    """
    levels = torch.as_tensor(levels, dtype=torch.float64).clone()
    increments = torch.as_tensor(increments, dtype=torch.float64)
    if increments.ndim != 2 or increments.shape[1] != levels.numel():
        raise ValueError(
            f"increments must be [B, T] with T = {levels.numel()} (one per noise level), got {tuple(increments.shape)}"
        )
    if steps is None:
        steps = [t for t in range(levels.numel()) if levels[t] > 0]
    for t in steps:
        column = increments[:, t]
        column = column[torch.isfinite(column)]
        imbalance = abs(int((column > 0).sum()) - int((column < 0).sum()))
        levels[t] += eps2 if imbalance < eps1 else -eps2
    return levels.clamp(min=low, max=high)
