"""VGPO's value-anchored advantages for one GRPO group (Shao et al., "Value-Anchored Group Policy Optimization for Flow
Models", arXiv:2512.12387).

No public code exists and the paper's equations were not available: this is flowalign's reconstruction from the
reviews that cite Eqs. (8)-(13), Alg. 1 and Apps. A.2/B (the project's specification notes, METHODS.md section 1,
steps 2-5; the method page docs/methods/vgpo.md). Every formula below is a chosen reading, not a confirmed one. Notation: ``G`` trajectories of one prompt, ``T``
transitions each; ``R[g, i]`` is the *instant* reward of transition ``i`` of trajectory ``g``, the reward of the
one-step clean estimate of the state it lands on (Eq. 9; the last one is the terminal reward).

* Value (Eq. 10): ``Q_i = sum_{j >= i} gamma^(j - i) R_j`` (``= R_i + gamma Q_{i+1}``) along the sampled trajectory.
* Timestep weight (Eq. 11): ``omega_i = Q_i / mean_i' Q_i'``, the mean over the trajectory's own ``T`` steps. Rewards
  must be >= 0 so that ``omega >= 0``; a trajectory whose values are all 0 (every instant reward 0, a failed
  verifier) has no weighting to give and gets ``omega = 1`` on every step.
* Group statistics per step: ``mu_i``, ``std_i`` over the ``G`` trajectories (population std unless
  ``std_unbiased``; a single trajectory has std 0). A step whose std is below ``flowalign.advantages.ZERO_STD``
  is degenerate: its std and its centred values ``Q_i - mu_i`` count as exactly 0 (the project's rule for groups
  with equal rewards, so rounding never makes a signal).
* ADAE (Eq. 13), ``variant="reconstruction"``: ``A_i = omega_i ((Q_i - mu_i) + alpha_i Q_i) / (std_i + eps)`` with
  ``alpha_i = k std_i`` on the first ``alpha_steps`` transitions (App. A.2) and 0 after. At a degenerate step the
  absolute term ``k std Q / (std + eps)`` is 0 too: the reconstruction does not rescue a group whose values agree.
* ``variant="std_free"``: ``A_i = omega_i ((Q_i - mu_i) / (std_i + eps) + a_i Q_i)`` with ``a_i = k`` on the first
  ``alpha_steps`` transitions and 0 after: the absolute term without the std, which keeps a signal where the
  group's values agree.

``relative = (Q_i - mu_i) / (std_i + eps)`` (0 at degenerate steps) is returned too, for logging.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from flowalign.advantages import ZERO_STD

__all__ = ["VARIANTS", "discounted_values", "value_anchored_advantages"]

VARIANTS = ("reconstruction", "std_free")


def discounted_values(instant_rewards: Tensor, gamma: float) -> Tensor:
    """``Q_i = R_i + gamma Q_{i+1}`` (``Q_{T-1} = R_{T-1}``) per row of ``[G, T]`` rewards, float64."""
    rewards = torch.as_tensor(instant_rewards, dtype=torch.float64)
    values = torch.empty_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for i in range(rewards.shape[1] - 1, -1, -1):
        running = rewards[:, i] + gamma * running
        values[:, i] = running
    return values


def value_anchored_advantages(
    instant_rewards: Tensor,
    *,
    gamma: float,
    k: float,
    alpha_steps: int = 5,
    eps: float = 1e-4,
    std_unbiased: bool = False,
    variant: Literal["reconstruction", "std_free"] = "reconstruction",
) -> dict[str, Tensor]:
    """VGPO's value-anchored advantages of one group (module docstring: Eqs. 10, 11 and 13 as reconstructed).

    ``instant_rewards`` is ``[G, T]``: row ``g`` holds the instant rewards of trajectory ``g``, column ``i`` those of
    transition ``i`` (finite, >= 0). Returns float64 tensors: ``Q``, ``omega``, ``relative`` and ``advantages``
    (``[G, T]`` each), and the group statistics ``mu``, ``std`` and ``alpha`` (``[T]``; ``alpha`` is the absolute
    term's coefficient: ``k std_i`` for the reconstruction, ``k`` for the std-free variant, on the first
    ``alpha_steps`` transitions).
    """
    rewards = torch.as_tensor(instant_rewards, dtype=torch.float64)
    if rewards.ndim != 2 or rewards.shape[0] < 1 or rewards.shape[1] < 1:
        raise ValueError(f"instant_rewards must be [G, T] with G, T >= 1 (one group), got shape "
                         f"{tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("instant_rewards must be finite: leave trajectories with an invalid reward out of the group")
    if (rewards < 0).any():
        raise ValueError(f"instant_rewards must be >= 0 (omega = Q / mean Q needs values of one sign), got a minimum "
                         f"of {float(rewards.min()):g}: use a reward bounded below by 0")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}, got {variant!r}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    if not k >= 0.0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    if isinstance(alpha_steps, bool) or not isinstance(alpha_steps, int) or alpha_steps < 0:
        raise ValueError(f"alpha_steps must be an integer >= 0, got {alpha_steps!r}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps!r}")

    num_traj, num_steps = rewards.shape
    values = discounted_values(rewards, gamma)
    mean_value = values.mean(dim=1, keepdim=True)
    omega = torch.where(mean_value > 0, values / mean_value.clamp_min(torch.finfo(torch.float64).tiny),
                        torch.ones_like(values))

    mu = values.mean(dim=0)
    if num_traj > 1:
        std = values.std(dim=0, unbiased=std_unbiased)
    else:
        std = torch.zeros(num_steps, dtype=torch.float64)
    degenerate = std < ZERO_STD
    std = torch.where(degenerate, torch.zeros_like(std), std)
    centered = torch.where(degenerate, torch.zeros_like(values), values - mu)
    relative = centered / (std + eps)

    early = torch.arange(num_steps) < alpha_steps
    if variant == "reconstruction":
        alpha = torch.where(early, k * std, torch.zeros_like(std))
        advantages = omega * (centered + alpha * values) / (std + eps)
    else:
        alpha = torch.where(early, torch.full_like(std, float(k)), torch.zeros_like(std))
        advantages = omega * (relative + alpha * values)
    return {"Q": values, "omega": omega, "relative": relative, "advantages": advantages, "mu": mu, "std": std,
            "alpha": alpha}
