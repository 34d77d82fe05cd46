"""Group-relative advantages (GRPO) for flow models.

Reference: Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL" (arXiv:2505.05470), eq. 5,
following DeepSeekMath's GRPO (Shao et al. 2024). The K images sampled for one prompt form a group, and the
advantage of image ``i`` of group ``g`` is

    A_i = (r_i - mean_g(r)) / (std + eps),        eps = 1e-4 (docs/design/math.md#advantages),

where ``std`` is either the group's own std (``std="group"``) or the std over the whole gathered batch
(``std="global"``, Flow-GRPO's ``global_std`` option, more stable with small groups). Both are *population* stds
(``unbiased=False``, numpy's ``np.std`` default, as Flow-GRPO uses): a group of K rewards is divided by K, not K - 1.
The mean is always the group's mean.

Conventions:

* Groups whose valid rewards have std < 1e-6 (all equal, or fewer than two valid members) carry no ranking signal:
  their advantages are exactly 0 and they are counted in the stats (``zero_std_groups``, ``zero_std_frac``).
* Invalid samples (``valid`` False, or a non-finite reward) get advantage 0 and are left out of every mean and std,
  so one NaN reward never spreads into its group.
* Advantages are clipped to ``[-clip, clip]`` (5 by default, docs/design/math.md#advantages).

The rewards passed in must be the **gathered** global batch. A group can span processes (its K images are sampled on
different ranks), so normalising per process would use a partial group's mean and std: the advantages would then
depend on how the batch was sharded, and a group split 1 + (K - 1) would give its lone member advantage 0. The
trainer gathers rewards and group ids across processes, calls this once, and keeps its own slice.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["STD_MODES", "ZERO_STD", "group_advantages", "group_normalize"]

STD_MODES = ("group", "global")
ZERO_STD = 1e-6


def group_normalize(
    values: Tensor,
    group_ids: Tensor,
    valid: Tensor | None = None,
    *,
    std: str = "group",
    eps: float = 1e-4,
) -> tuple[Tensor, dict]:
    """``(v - mean_group) / (std + eps)`` per sample, without clipping; see the module docstring for the rules.

    Returns ``(normalized [B] float32, stats)`` with ``stats`` = ``num_groups``, ``zero_std_groups``,
    ``zero_std_frac`` and ``num_invalid`` (python numbers). Internally float64, so equal rewards really cancel.
    """
    values, group_ids, valid = _check_inputs(values, group_ids, valid, std, eps)
    valid = valid & torch.isfinite(values)
    x = torch.where(valid, values.double(), torch.zeros((), dtype=torch.float64, device=values.device))
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1

    counts = _group_sum(valid.double(), group, num_groups)
    group_mean = _group_sum(x, group, num_groups) / counts.clamp_min(1)
    centered = torch.where(valid, x - group_mean[group], torch.zeros_like(x))
    group_std = (_group_sum(centered**2, group, num_groups) / counts.clamp_min(1)).sqrt()
    zero_std = group_std < ZERO_STD  # also true for groups with 0 or 1 valid members

    if std == "group":
        denominator = group_std[group] + eps
    else:
        n_valid = int(valid.sum())
        global_centered = torch.where(valid, x - x.sum() / max(n_valid, 1), torch.zeros_like(x))
        global_std = ((global_centered**2).sum() / max(n_valid, 1)).sqrt()
        denominator = global_std + eps
    keep = valid & ~zero_std[group]
    normalized = torch.where(keep, centered / denominator, torch.zeros_like(x))

    stats = {
        "num_groups": num_groups,
        "zero_std_groups": int(zero_std.sum()),
        "zero_std_frac": float(zero_std.double().mean()),
        "num_invalid": int((~valid).sum()),
    }
    return normalized.float(), stats


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    valid: Tensor | None = None,
    *,
    std: str = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> tuple[Tensor, dict]:
    """Flow-GRPO advantages ``clip((r - mean_group) / (std + eps), -clip, clip)`` for a gathered batch.

    ``rewards``, ``group_ids`` and ``valid`` are ``[B]``; group ids may be any integers in any order (a group need not
    be contiguous). ``clip=None`` disables clipping. Returns ``(advantages [B] float32, stats)``; ``stats`` holds
    ``num_groups``, ``zero_std_groups``, ``zero_std_frac``, ``num_invalid`` and ``clip_frac`` (the fraction of valid
    samples whose advantage was clipped).
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 (or None for no clipping), got {clip!r}")
    advantages, stats = group_normalize(rewards, group_ids, valid, std=std, eps=eps)
    clipped = torch.zeros_like(advantages, dtype=torch.bool)
    if clip is not None:
        clipped = advantages.abs() > clip
        advantages = advantages.clamp(-clip, clip)
    n_valid = len(advantages) - stats["num_invalid"]
    stats["clip_frac"] = float(clipped.sum()) / n_valid if n_valid else 0.0
    return advantages, stats


def _group_sum(values: Tensor, group: Tensor, num_groups: int) -> Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, group, values)


def _check_inputs(
    values: Tensor, group_ids: Tensor, valid: Tensor | None, std: str, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    if std not in STD_MODES:
        raise ValueError(f"unknown std mode {std!r}: expected one of {', '.join(STD_MODES)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    values = torch.as_tensor(values)
    if values.ndim != 1 or values.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D tensor [B], got shape {tuple(values.shape)}")
    group_ids = torch.as_tensor(group_ids, device=values.device)
    if group_ids.shape != values.shape or group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids must be integers of shape {tuple(values.shape)}, got {group_ids.dtype} "
            f"{tuple(group_ids.shape)}"
        )
    if valid is None:
        valid = torch.ones(values.shape, dtype=torch.bool, device=values.device)
    else:
        valid = torch.as_tensor(valid, device=values.device)
        if valid.shape != values.shape or valid.dtype != torch.bool:
            raise ValueError(f"valid must be a bool tensor of shape {tuple(values.shape)}, got {valid.dtype} "
                             f"{tuple(valid.shape)}")
    return values.detach(), group_ids, valid

