"""TP-GRPO's process rewards and advantages as its released code computes them (Tong et al. 2026, arXiv:2602.06422;
code ``YunzeTong/TurningPoint-GRPO``, ``scripts/my_train_sd3_fast_with_op3.py``, block "Process Reward Computation",
and ``flow_grpo/stat_tracking.py::PerPromptStatTracker``).

Inputs per trajectory ``b``: ``R_sde`` (the reward of the trained trajectory's image), ``R_0`` (the reward of a pure ODE
rollout) and ``R_1 .. R_n`` (the reward of the ODE completion after the ``i``-th of the ``n`` SDE window steps; the
released code reuses the final image for ``R_n``, so ``R_n = R_sde`` there). Column ``i - 1`` of every ``[B, n]``
output belongs to the ``i``-th window step. With the released option names (defaults: the values of every released
``*_op3`` configuration, ``RELEASED_OPTIONS``)::

    D = R_sde - R_0      d_i = R_i - R_{i-1}      s_i = sign(d_i) sign(D)      G = D  (R_sde if not use_delta_global)
    I_1 = [s_1 > 0]                       (0 unless apply_first_step_bonus),
          or [sign(d_1) sign(R_sde - R_1) > 0]     with select_first_step_only_from_consistent_trajectory
    I_i = [s_{i-1} < 0 and s_i > 0]       (indicator_wo_delta_global_constraint: [d_{i-1} d_i < 0]), i >= 2,
          times [D > 0]                   if select_only_positive_intermediate_step,
          times [sign(d_i) sign(R_sde - R_i) > 0]  if select_inter_step_only_from_consistent_trajectory
    all I = 0 (and no balancing or propagation) while global_step < turn_on_bonus_global_step

    take_delta_global_as_main (released):  M_i = G,    C_i = d_i
    otherwise:                              M_i = d_i,  C_i = G   (use_sde_minus_rt: C_i = R_sde - R_{i-1})
    B_i = eta I_i C_i,   P_i = M_i + B_i;   drop_original_reward_when_having_bonus: M_i = 0 where B_i != 0

``use_balanced_bonus`` keeps, within each pool (the released code: one per-process sampling batch), as many turning
points of each sign of ``V`` (``d_i`` if take_delta_global_as_main, else ``G``) as the rarer sign has, the largest
``|V|`` by ``torch.topk`` over the row-major order; the others (and those with ``V = 0``) lose their indicator.
``propagate_bonus_to_future_steps`` sweeps each trajectory with ``g_i = R_sde - R_{i-1}``: from ``i = n`` down, a
turning point with ``g_i < 0`` switches on and increments ``c-``, and every step from there on adds ``c- g_i``; then
from ``i = 1`` up the same with ``g_i > 0`` and ``c+``; the sum is the bonus ``B_i = eta val_i``.

Advantages per column, grouped by prompt: ``(P - mean) / (std + 1e-4)`` with the population std (``global_std``: the
std of the whole column; ``per_prompt_stat_tracking = False``: the column's mean and std). Everything is float64 (the
released code computes the process rewards in float32); NaN rewards propagate as they would there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["RELEASED_OPTIONS", "check_released_options", "released_process_rewards", "tp_grpo_process_rewards"]

# The released option names with the values every released *_op3 configuration sets (config/my_grpo.py).
RELEASED_OPTIONS: dict[str, Any] = {
    "take_delta_global_as_main": True,
    "use_delta_global": True,
    "use_sde_minus_rt": False,
    "eta": 1.0,
    "apply_first_step_bonus": True,
    "select_first_step_only_from_consistent_trajectory": False,
    "select_only_positive_intermediate_step": False,
    "select_inter_step_only_from_consistent_trajectory": False,
    "indicator_wo_delta_global_constraint": False,
    "use_balanced_bonus": False,
    "drop_original_reward_when_having_bonus": False,
    "propagate_bonus_to_future_steps": False,
    "turn_on_bonus_global_step": 0,
}
# The released advantage options (config.sample.global_std, config.per_prompt_stat_tracking).
ADVANTAGE_OPTIONS: dict[str, Any] = {"global_std": False, "per_prompt_stat_tracking": True}
EPS = 1e-4


def check_released_options(options: Mapping[str, Any], accepted: Mapping[str, Any] = RELEASED_OPTIONS) -> dict:
    """The options with the released defaults filled in; an unknown name is a TypeError naming it and the accepted
    ones, a value of the wrong kind a ValueError naming the option."""
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"unknown TP-GRPO option(s) {', '.join(map(repr, unknown))}; the released code's options are "
                        f"{', '.join(sorted(accepted))}")
    values = {**accepted, **options}
    for name, value in values.items():
        default = accepted[name]
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"TP-GRPO option {name} must be true or false, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"TP-GRPO option {name} must be an integer >= 0, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"TP-GRPO option {name} must be a finite number, got {value!r}")
    return values


def _column(name: str, value, size: int | None) -> Tensor:
    value = torch.as_tensor(value, dtype=torch.float64)
    if value.ndim != 1 or (size is not None and value.shape[0] != size):
        want = "[B]" if size is None else f"[{size}] (one per trajectory)"
        raise ValueError(f"{name} must have shape {want}, got {tuple(value.shape)}")
    return value


def released_process_rewards(sde_reward, ode_reward, intermediate_rewards, *, global_step: int = 0,
                             pools=None, **options) -> dict[str, Tensor]:
    """The released process rewards and their parts (module docstring): a mapping with ``delta_global`` ``[B]``,
    ``d``, ``s``, ``indicators``, ``main``, ``bonus`` and ``process_rewards`` (each ``[B, n]``, float64).

    ``pools[b]`` labels the balancing pool of trajectory ``b`` (default: one pool, as the released code balances one
    sampling batch at a time); it matters only with ``use_balanced_bonus``.
    """
    o = check_released_options(options)
    sde = _column("sde_reward", sde_reward, None)
    size = sde.shape[0]
    ode = _column("ode_reward", ode_reward, size)
    inter = torch.as_tensor(intermediate_rewards, dtype=torch.float64)
    if inter.ndim != 2 or inter.shape[0] != size or inter.shape[1] < 1:
        raise ValueError(f"intermediate_rewards must be [B, n] = [{size}, n >= 1] (R_1 .. R_n, R_n the final image's), "
                         f"got {tuple(inter.shape)}")
    n = inter.shape[1]
    sequence = torch.cat([ode[:, None], inter], dim=1)  # R_0 .. R_n
    delta = sde - ode
    d = sequence[:, 1:] - sequence[:, :-1]
    s = torch.sign(d) * torch.sign(delta)[:, None]
    sign_rest = torch.sign(sde[:, None] - sequence[:, 1:])  # sign(R_sde - R_i) for column i - 1
    on = global_step >= o["turn_on_bonus_global_step"]

    indicators = torch.zeros_like(d)
    if on:
        if o["apply_first_step_bonus"]:
            if o["select_first_step_only_from_consistent_trajectory"]:
                indicators[:, 0] = (torch.sign(d[:, 0]) * sign_rest[:, 0] > 0).double()
            else:
                indicators[:, 0] = (s[:, 0] > 0).double()
        if n > 1:
            if o["indicator_wo_delta_global_constraint"]:
                later = (d[:, :-1] * d[:, 1:] < 0).double()
            else:
                later = (s[:, :-1] < 0).double() * (s[:, 1:] > 0).double()
            if o["select_only_positive_intermediate_step"]:
                later = later * (torch.sign(delta) > 0).double()[:, None]
            if o["select_inter_step_only_from_consistent_trajectory"]:
                later = later * (torch.sign(d[:, 1:]) * sign_rest[:, 1:] > 0).double()
            indicators[:, 1:] = later

    global_term = delta if o["use_delta_global"] else sde
    if o["take_delta_global_as_main"]:
        main = global_term[:, None].expand(-1, n).clone()
        candidate = d.clone()
    else:
        main = d.clone()
        candidate = global_term[:, None].expand(-1, n).clone()
        if o["use_sde_minus_rt"]:
            candidate = sde[:, None] - sequence[:, :-1]

    if on and o["use_balanced_bonus"]:
        ranking = d if o["take_delta_global_as_main"] else global_term[:, None].expand(-1, n)
        indicators = _balance(indicators, ranking, pools)

    if on and o["propagate_bonus_to_future_steps"]:
        values, indicators = _propagate(indicators, sde[:, None] - sequence[:, :-1])
        bonus = o["eta"] * values
    else:
        bonus = o["eta"] * indicators * candidate
    if o["drop_original_reward_when_having_bonus"]:
        main = torch.where(bonus != 0, torch.zeros_like(main), main)
    return {"delta_global": delta, "d": d, "s": s, "indicators": indicators, "main": main, "bonus": bonus,
            "process_rewards": main + bonus}


def _balance(indicators: Tensor, ranking: Tensor, pools) -> Tensor:
    """The released ``use_balanced_bonus`` within each pool (rows in their order; ``torch.topk`` as released)."""
    size = indicators.shape[0]
    pools = torch.zeros(size, dtype=torch.long) if pools is None else torch.as_tensor(pools)
    if pools.shape != (size,):
        raise ValueError(f"pools must have one entry per trajectory ({size}), got {tuple(pools.shape)}")
    out = indicators.clone()
    for pool in pools.unique():
        rows = torch.nonzero(pools == pool).flatten()
        block, values = indicators[rows], ranking[rows]
        mask = block > 0
        at_turns = values[mask]
        positive, negative = at_turns > 0, at_turns < 0
        num_positive, num_negative = int(positive.sum()), int(negative.sum())
        if at_turns.numel() == 0 or num_positive == 0 or num_negative == 0:
            continue
        keep = min(num_positive, num_negative)
        flat = torch.where(mask.flatten())[0]
        kept = []
        for side in (positive, negative):
            indices = flat[side]
            if int(side.sum()) > keep:
                _, top = torch.topk(torch.abs(at_turns[side]), keep)
                indices = indices[top]
            kept.append(indices)
        balanced = torch.zeros(block.numel(), dtype=block.dtype)
        balanced[torch.cat(kept)] = 1.0
        out[rows] = balanced.reshape(block.shape)
    return out


def _propagate(indicators: Tensor, gain: Tensor) -> tuple[Tensor, Tensor]:
    """The released ``propagate_bonus_to_future_steps`` sweeps, ``gain[b, i - 1] = R_sde - R_{i-1}``: the bonus
    values before ``eta`` and the indicators with every step a sweep switched on set to 1."""
    values, propagated = torch.zeros_like(gain), indicators.clone()
    for b in range(gain.shape[0]):
        for order, sign in ((reversed(range(gain.shape[1])), -1.0), (range(gain.shape[1]), 1.0)):
            count, active = 0, False
            for i in order:
                g = float(gain[b, i])
                if indicators[b, i] > 0 and g * sign > 0:
                    active, count = True, count + 1
                    values[b, i] += count * g
                elif active:
                    propagated[b, i] = 1.0
                    values[b, i] += count * g
    return values, propagated


def _advantages(process_rewards: Tensor, prompts: Sequence, *, global_std: bool,
                per_prompt_stat_tracking: bool) -> Tensor:
    """Per column: ``(P - mean) / (std + 1e-4)`` per prompt (population std; ``global_std``: the column's std), or
    over the whole column without ``per_prompt_stat_tracking`` (released ``PerPromptStatTracker.update``)."""
    if not per_prompt_stat_tracking:
        mean = process_rewards.mean(dim=0, keepdim=True)
        return (process_rewards - mean) / (process_rewards.std(dim=0, unbiased=False, keepdim=True) + EPS)
    labels = list(prompts)
    advantages = torch.empty_like(process_rewards)
    column_std = process_rewards.std(dim=0, unbiased=False, keepdim=True)
    for prompt in dict.fromkeys(labels):
        rows = torch.tensor([i for i, p in enumerate(labels) if p == prompt])
        group = process_rewards[rows]
        std = column_std if global_std else group.std(dim=0, unbiased=False, keepdim=True)
        advantages[rows] = (group - group.mean(dim=0, keepdim=True)) / (std + EPS)
    return advantages


def tp_grpo_process_rewards(sde_reward, ode_reward, intermediate_rewards, prompts: Sequence, *, global_step: int = 0,
                            pools=None, **options) -> dict[str, Tensor]:
    """TP-GRPO's process rewards and per-timestep, per-prompt advantages as its released code computes them.

    ``sde_reward`` and ``ode_reward`` are ``[B]`` (``R_sde``, ``R_0``), ``intermediate_rewards`` ``[B, n]``
    (``R_1 .. R_n``), ``prompts`` one label per trajectory (the groups of the advantages). ``options`` are the
    released code's own names (``RELEASED_OPTIONS``, plus ``global_std`` and ``per_prompt_stat_tracking``), defaulting
    to the released ``*_op3`` values; an unknown name is a TypeError. Returns the mapping of
    :func:`released_process_rewards` plus ``advantages`` ``[B, n]`` (float64, unclipped; the released loss clips at 5).
    """
    accepted = {**RELEASED_OPTIONS, **ADVANTAGE_OPTIONS}
    values = check_released_options(options, accepted)
    if len(prompts) != torch.as_tensor(sde_reward).reshape(-1).shape[0]:
        raise ValueError(f"prompts must have one entry per trajectory ({torch.as_tensor(sde_reward).numel()}), "
                         f"got {len(prompts)}")
    process = {k: v for k, v in values.items() if k in RELEASED_OPTIONS}
    out = released_process_rewards(sde_reward, ode_reward, intermediate_rewards, global_step=global_step, pools=pools,
                                   **process)
    out["advantages"] = _advantages(out["process_rewards"], prompts, global_std=values["global_std"],
                                    per_prompt_stat_tracking=values["per_prompt_stat_tracking"])
    return out
