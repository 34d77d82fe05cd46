"""Multi-reward advantages: GDPO's decoupled normalisation and Pref-GRPO's weighted per-reward advantages.

GDPO: NVIDIA, "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization",
arXiv 2601.05242 (2026); code ``NVlabs/GDPO@41f74c5`` (trl's ``grpo_trainer.py``, the advantage block). Pref-GRPO:
"Pref-GRPO: Pairwise Preference Reward-based GRPO", arXiv 2508.20751 (2025); code ``CodeGoat24/Pref-GRPO@3e787f6``
(``fastvideo/rewards/dispatcher.py::compute_weighted_advantages``). Spec: METHODS-3.md §4, §5.

Scores ``s_kb`` (reward ``k``, sample ``b``), weights ``w_k``. GRPO normalises the weighted sum once per group,
``A = norm_g(sum_k w_k s_k)``; GDPO normalises each reward in its group first, then renormalises the weighted sum over
the whole batch:

    A_k = (s_k - mean_g(s_k)) / std_g(s_k) ,    c = sum_k w_k A_k ,    A = (c - mean_B(c)) / std_B(c).

The three released codes differ in the details; each is a ``variant``:

============== ================== ============ ================= ================================ ====================
variant        per-reward std     batch std    eps               one reward (``R = 1``)           NaN scores
============== ================== ============ ================= ================================ ====================
``nvlabs``     unbiased           unbiased     ``std + 1e-4``    the GRPO rule (no batch step)    ``nan_to_num`` -> 0;
                                                                                                  GRPO rule: ``nansum``
``flow_factory`` population       population   ``max(std,1e-6)`` still batch-normalises           propagate
``pref_grpo``  unbiased           unbiased     ``std + 1e-8``    per group, then the batch step   propagate
============== ================== ============ ================= ================================ ====================

Groups: ``nvlabs`` and ``pref_grpo`` read consecutive blocks (``view(-1, G)``), so their group ids must be contiguous
runs (an id that comes back later is a ValueError); ``flow_factory`` groups by id in any order.

``aggregation="sum"`` is each variant's GRPO rule: ``nvlabs`` ``r = nansum_k w_k s_k``, ``A = r - mean_g(r)``, divided
by ``std_g(r) + 1e-4`` when ``scale_rewards``; ``flow_factory`` ``r = sum_k w_k s_k``, ``A = (r - mean_g(r)) /
max(std, 1e-6)`` with the population std over the batch (``global_std``) or the group (every group the same size, as
it raises otherwise); ``pref_grpo`` the weighted sum of the per-reward group advantages without the batch step
(``--apply_gdpo`` off).

Unbiased stds of a group of one are NaN, as released (``nvlabs``' GDPO path drops them in its ``nansum``).
Everything is float64.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["GDPO_AGGREGATIONS", "GDPO_VARIANTS", "gdpo_advantages", "per_reward_advantages", "batch_normalize",
           "pref_grpo_advantages"]

GDPO_VARIANTS = ("nvlabs", "flow_factory", "pref_grpo")
GDPO_AGGREGATIONS = ("gdpo", "sum")
_EPS = {"nvlabs": 1e-4, "pref_grpo": 1e-8}
_FLOOR = 1e-6  # flow_factory's max(std, 1e-6)


def _groups(group_ids: Tensor, variant: str) -> list[Tensor]:
    """The index sets of the groups: contiguous runs (nvlabs, pref_grpo) or ids in any order (flow_factory)."""
    if variant == "flow_factory":
        return [(group_ids == g).nonzero().flatten() for g in torch.unique(group_ids)]
    values, counts = torch.unique_consecutive(group_ids, return_counts=True)
    if len(torch.unique(values)) != len(values):
        raise ValueError(f"gdpo variant {variant!r} reads groups as consecutive blocks (the released view(-1, G)), but "
                         f"the group ids {group_ids.tolist()} are not contiguous runs: sort the batch by group, or use "
                         "variant='flow_factory' (groups by id in any order)")
    starts = torch.cumsum(counts, 0) - counts
    return [torch.arange(int(s), int(s) + int(c)) for s, c in zip(starts, counts)]


def _std(x: Tensor, variant: str) -> Tensor:
    """The std of ``x`` (population for flow_factory, else unbiased: NaN for one value, as torch gives, unwarned)."""
    if variant != "flow_factory" and x.numel() < 2:
        return torch.full((), torch.nan, dtype=x.dtype)
    return x.std(unbiased=variant != "flow_factory")


def _divide(centred: Tensor, std: Tensor, variant: str) -> Tensor:
    if variant == "flow_factory":  # python's max(std, 1e-6): a NaN std stays NaN
        return centred / torch.where(std < _FLOOR, torch.full_like(std, _FLOOR), std)
    return centred / (std + _EPS[variant])


def _check(scores: Any, weights: Any, group_ids: Any, variant: str, aggregation: str) -> tuple[Tensor, Tensor, Tensor]:
    if variant not in GDPO_VARIANTS:
        raise ValueError(f"unknown gdpo variant {variant!r}: expected one of {', '.join(GDPO_VARIANTS)}")
    if aggregation not in GDPO_AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}: expected one of {', '.join(GDPO_AGGREGATIONS)}")
    scores = torch.as_tensor(scores, dtype=torch.float64)
    if scores.ndim == 1:
        scores = scores[None]
    if scores.ndim != 2 or scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError(f"scores must be [R, B] with R, B >= 1, got shape {tuple(scores.shape)}")
    weights = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if weights.shape != (scores.shape[0],) or not torch.isfinite(weights).all():
        raise ValueError(f"weights must be {scores.shape[0]} finite numbers (one per reward), got {weights.tolist()}")
    group_ids = torch.as_tensor(group_ids)
    if group_ids.shape != (scores.shape[1],) or group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be {scores.shape[1]} integers, got {group_ids.dtype} "
                         f"{tuple(group_ids.shape)}")
    return scores, weights, group_ids.cpu()


def per_reward_advantages(scores: Tensor, group_ids: Tensor, *, variant: str) -> Tensor:
    """``A_k = (s_k - mean_g(s_k)) / std_g(s_k)`` per reward row and group, with the ``variant``'s std and eps
    (module docstring); ``scores [R, B]`` float64 in, ``[R, B]`` out."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    out = torch.zeros_like(scores)
    for rows in _groups(torch.as_tensor(group_ids).cpu(), variant):
        block = scores[:, rows]
        centred = block - block.mean(dim=1, keepdim=True)
        out[:, rows] = _divide(centred, _row_std(block, variant), variant)
    return out


def _row_std(block: Tensor, variant: str) -> Tensor:
    """Each row's std over the group's members, ``[R, 1]`` (unbiased: NaN for a group of one, as torch gives)."""
    if variant != "flow_factory" and block.shape[1] < 2:
        return torch.full((block.shape[0], 1), torch.nan, dtype=block.dtype)
    return block.std(dim=1, unbiased=variant != "flow_factory", keepdim=True)


def batch_normalize(combined: Tensor, *, variant: str) -> Tensor:
    """GDPO's batch step ``(c - mean_B(c)) / std_B(c)`` with the ``variant``'s std and eps."""
    combined = torch.as_tensor(combined, dtype=torch.float64)
    return _divide(combined - combined.mean(), _std(combined, variant), variant)


def gdpo_advantages(scores: Any, weights: Any, group_ids: Any, *, variant: str = "nvlabs", aggregation: str = "gdpo",
                    scale_rewards: bool = True, global_std: bool = True) -> Tensor:
    """Multi-reward advantages ``[B]`` (float64) from ``scores [R, B]``, ``weights [R]`` and ``group_ids [B]``.

    ``aggregation="gdpo"`` normalises each reward within its group, weight-sums and renormalises over the batch;
    ``"sum"`` is the variant's GRPO rule (no batch step). ``scale_rewards`` (``nvlabs``' GRPO rule) divides by the
    group std; ``global_std`` (``flow_factory``'s GRPO rule) takes the std over the batch instead of the group. The
    variants' stds, eps, one-reward rule, NaN rule and group layout are in the module docstring (METHODS-3.md §5).
    """
    scores, weights, group_ids = _check(scores, weights, group_ids, variant, aggregation)
    if variant == "nvlabs":
        if aggregation == "gdpo" and scores.shape[0] > 1:  # "only apply gdpo when having more than one reward"
            advantages = per_reward_advantages(torch.nan_to_num(scores), group_ids, variant=variant)
            return batch_normalize((advantages * weights[:, None]).nansum(dim=0), variant=variant)
        rewards = (scores * weights[:, None]).nansum(dim=0)
        out = torch.zeros_like(rewards)
        for rows in _groups(group_ids, variant):
            block = rewards[rows]
            out[rows] = block - block.mean()
            if scale_rewards:
                out[rows] = out[rows] / (_std(block, variant) + _EPS[variant])
        return out
    if variant == "flow_factory" and aggregation == "sum":
        rewards = (scores * weights[:, None]).sum(dim=0)
        groups = _groups(group_ids, variant)
        sizes = {len(rows) for rows in groups}
        if len(sizes) > 1:
            raise ValueError(f"gdpo variant 'flow_factory' with aggregation='sum' needs every group the same size (the "
                             f"released code raises on a group size mismatch), got sizes {sorted(sizes)}")
        out = torch.zeros_like(rewards)
        for rows in groups:
            block = rewards[rows]
            std = _std(rewards, variant) if global_std else _std(block, variant)
            out[rows] = _divide(block - block.mean(), std, variant)
        return out
    combined = (per_reward_advantages(scores, group_ids, variant=variant) * weights[:, None]).sum(dim=0)
    return batch_normalize(combined, variant=variant) if aggregation == "gdpo" else combined


def pref_grpo_advantages(rewards: Mapping[str, Any], weights: Mapping[str, float] | Sequence[float], group_ids: Any,
                         *, apply_gdpo: bool, flex: Any = None) -> Tensor:
    """Pref-GRPO's advantages ``[B]`` (float64): the weighted sum of per-reward group advantages, ``(r - mean_g) /
    (std_g + 1e-8)`` (unbiased std, consecutive groups), renormalised over the batch with ``apply_gdpo`` (unbiased
    std + 1e-8): ``gdpo_advantages(..., variant="pref_grpo")``.

    ``weights``: a mapping name -> weight (the released ``reward_spec``; its order is the sum's order, a name missing
    from ``rewards`` is a ValueError) or one weight per entry of ``rewards``. ``flex``: the record
    ``flowalign.reward_models.pairwise.flex_win_rates`` returns (its ``overall``, ``dim_mean``, ``mask``,
    ``overall_weight``, ``dim_weight``; a mapping with those keys also does, the weights defaulting to the released
    1 and 1), or None. With ``apply_gdpo`` and ``flex``, the Flex reward's advantage is the
    ``(ow, dw)`` blend ``(ow adv(overall) + dw adv(dim_mean)) / (ow + dw)`` where the sample had category comparisons
    (``mask``), else ``adv(overall)``; with ``dw = 0`` it is ``adv(overall)``. The Flex reward is the entry named
    ``unifiedreward_flex``, else the one entry whose name contains ``flex``.
    """
    if isinstance(weights, Mapping):
        order = list(weights)
        missing = [name for name in order if name not in rewards]
        if missing:
            raise ValueError(f"weights name {missing[0]!r}, which rewards do not hold (rewards: {', '.join(rewards)})")
        w = [float(weights[name]) for name in order]
    else:
        order, w = list(rewards), [float(x) for x in weights]
        if len(w) != len(order):
            raise ValueError(f"got {len(w)} weights for {len(order)} rewards")
    scores = torch.stack([torch.as_tensor(rewards[name], dtype=torch.float64).flatten() for name in order])
    scores, weight_row, group_ids = _check(scores, w, group_ids, "pref_grpo", "gdpo")
    advantages = per_reward_advantages(scores, group_ids, variant="pref_grpo")
    if apply_gdpo and flex is not None:
        row = _flex_row(order)
        field = flex.get if isinstance(flex, Mapping) else lambda key, default=None: getattr(flex, key, default)
        parts = torch.stack([torch.as_tensor(field("overall"), dtype=torch.float64).flatten(),
                             torch.as_tensor(field("dim_mean"), dtype=torch.float64).flatten()])
        if parts.shape[1] != scores.shape[1]:
            raise ValueError(f"flex holds {parts.shape[1]} samples, rewards {scores.shape[1]}")
        overall_adv, dim_adv = per_reward_advantages(parts, group_ids, variant="pref_grpo")
        ow, dw = float(field("overall_weight", 1.0)), float(field("dim_weight", 1.0))
        if dw > 0:
            mask = torch.as_tensor(field("mask"), dtype=torch.bool).flatten()
            advantages[row] = torch.where(mask, (ow * overall_adv + dw * dim_adv) / (ow + dw), overall_adv)
        else:
            advantages[row] = overall_adv
    combined = (advantages * weight_row[:, None]).sum(dim=0)
    return batch_normalize(combined, variant="pref_grpo") if apply_gdpo else combined


def _flex_row(order: list[str]) -> int:
    if "unifiedreward_flex" in order:
        return order.index("unifiedreward_flex")
    rows = [i for i, name in enumerate(order) if "flex" in name]
    if len(rows) != 1:
        raise ValueError("flex is given, but no single reward is the Flex one (name it 'unifiedreward_flex'); "
                         f"rewards: {', '.join(order)}")
    return rows[0]

