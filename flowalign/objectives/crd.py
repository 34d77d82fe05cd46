"""CRD, Centered Reward Distillation (Zhu, Wang, Lathuiliere, Kalogeiton 2026, "Diffusion Reinforcement Learning via
Centered Reward Distillation", arXiv 2603.14128), as the Flow-Factory port computes it (X-GenGroup/Flow-Factory@a0b2bc5
``src/flow_factory/trainers/crd.py``: ``optimize``, ``_compute_crd_loss``, ``compute_decay``; no authors' code was
found).

KL-regularised reward maximisation gives ``r = beta log(p_theta / p_old) + log Z(c)``; centring within a pool of
samples cancels ``Z(c)``, so centred implicit rewards are regressed onto centred external ones. Forward-process: each
final rollout sample is re-noised at ``T`` levels (fresh ``eps`` per sample and level), ``x_s = (1 - s) x0 + s eps``,
``u = eps - x0``, and per sample ``b``

    r_b = -mean_d [ (v_theta - u)^2 / w_theta - (v_old - u)^2 / w_old ],  w = sg(max(mean_d |v - u|, 1e-5)) (adaptive)
    a_b = clamp(clamp(A_b, -A_max, A_max) / A_max / 2 + 1/2, 0, 1)                                    (A_max = 5)
    R_c = a - sum_b p_b a_b,      R_theta_c = r - sg(sum_b p_b r_b)
    mse: mean_b (beta R_theta_c - R_c)^2,      bce: BCEWithLogits(beta R_theta_c, sigmoid(R_c))
    L   = (A_max / beta) loss + kl_beta mean_b (m + a_b (1 - m)) ||v_theta - v_ref||^2_m,   m = 1e-4 / kl_beta

(the reward-adaptive KL, strongest on the *best* samples; else ``kl_beta mean_b ||v_theta - v_ref||^2_m``), ``v_ref``
the base with CFG ``kl_cfg``. The centring weights ``p`` over the pool: uniform (``weight_temp < 0``); ``T > 0``
"dual direction", ``softmax(a / T)`` and ``softmax(-a / T)``, the loss the mean of both; ``T = 0`` a hard split,
``softmax(a)`` over ``{a > 0}`` and over ``{a < 0}`` (an empty pool falls back to uniform). As released, ``T = 0`` runs
on ``a`` in [0, 1], not on ``A``: the negative pool is always empty and the positive one is every sample with
``A > -A_max``, at temperature 1 (reproduced, not fixed). Equal rewards still give a loss (centred ``r`` pulled to 0).

The pool: the port centres over the micro-batch (gathered over ranks; samples unshuffled, so consecutive members of
one or more groups); flowalign's pool is a unit of ``batch_size`` consecutive samples on any process layout
(``centering: batch``), or each prompt's group within it (``centering: group``, the paper's "within prompt").

``v_old`` is a snapshot blended after every iteration, ``old <- d old + (1 - d) theta``, ``d = crd_decay(k, spec)``
(``k`` optimizer steps so far; ``d <= 0`` copies, ``d >= 1`` freezes), and the rollouts sample with a second snapshot
on its own schedule. ``use_old_for_loss: false`` puts the base (no CFG) in place of ``v_old``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from flowalign.components import PolicyCopy
from flowalign.objectives.base import DataUnit, ObjectiveContext, PolicyOutput, register_objective
from flowalign.objectives.forward import (ForwardObjective, ForwardObjectiveConfig, forward_generator, latent_mse,
                                          noised, reference_with_cfg)
from flowalign.settings import check, finite, option

__all__ = ["CENTERINGS", "CRD", "CRDConfig", "DECAY_PRESETS", "LOSS_TYPES", "crd_decay", "crd_loss", "crd_strata",
           "parse_decay"]

OLD, SAMPLING = "crd_old", "crd_sampling"
LOSS_TYPES = ("mse", "bce")
CENTERINGS = ("batch", "group")
# (start, start_value, slope, end): the value is start_value before step `start`, then
# min(start_value + (k - start) slope, end). The port's presets, by number and by name.
DECAY_PRESETS: dict = {
    0: (0, 0.0, 0.0, 0.0), 1: (0, 0.0, 0.001, 0.5), 2: (75, 0.0, 0.0075, 0.999), 3: (0, 1.0, 0.0, 1.0),
    4: (0, 0.0, 0.02, 0.99), 5: (0, 0.0, 0.01, 0.5), 6: (0, 0.0, 0.0075, 0.999),
    "none": (0, 0.0, 0.0, 0.0), "slow": (0, 0.0, 0.001, 0.5), "medium": (75, 0.0, 0.0075, 0.999),
    "offline": (0, 1.0, 0.0, 1.0), "fast": (0, 0.0, 0.02, 0.99), "moderate": (0, 0.0, 0.01, 0.5),
}


def parse_decay(spec) -> tuple[int, float, float, float]:
    """``(start, start_value, slope, end)`` of a decay spec: a preset number (0-6, also as a string), a preset name
    (``none``, ``slow``, ``medium``, ``offline``, ``fast``, ``moderate``) or ``"start-start_value-slope-end"``."""
    key = spec
    if isinstance(key, str):
        try:
            key = int(key)
        except ValueError:
            pass
    if not isinstance(key, bool) and (isinstance(key, int) or isinstance(key, str)) and key in DECAY_PRESETS:
        return DECAY_PRESETS[key]
    if isinstance(key, str) and "-" in key:
        parts = key.split("-")
        if len(parts) != 4:
            raise ValueError(f"a decay spec is 'start-start_value-slope-end' (4 numbers), got {spec!r}")
        try:
            start, value, slope, end = (float(p) for p in parts)
        except ValueError:
            raise ValueError(f"a decay spec is 'start-start_value-slope-end' (4 numbers), got {spec!r}") from None
        return int(start), value, slope, end
    names = ", ".join(str(k) for k in DECAY_PRESETS)
    raise ValueError(f"unknown decay {spec!r}: use a preset ({names}) or 'start-start_value-slope-end'")


def crd_decay(step: int, spec) -> float:
    """The port's ``compute_decay``: ``start_value`` before step ``start``, then ``min(start_value + (step - start)
    slope, end)`` (``parse_decay`` reads ``spec``)."""
    start, value, slope, end = parse_decay(spec)
    if step < start:
        return value
    return min(value + (step - start) * slope, end)


def _centre_weights(a: Tensor, temperature: float) -> list[Tensor]:
    """The centring weights over one pool: one vector (uniform) or two (the dual directions)."""
    if temperature < 0:
        return [torch.full_like(a, 1.0 / len(a))]
    if temperature > 0:
        return [torch.softmax(a / temperature, dim=0), torch.softmax(-a / temperature, dim=0)]
    weights = []
    for mask in (a > 0.0, a < 0.0):  # on a in [0, 1], as released: the second pool is always empty
        if not bool(mask.any()):
            weights.append(torch.full_like(a, 1.0 / len(a)))
        else:
            weights.append(torch.softmax(a.masked_fill(~mask, float("-inf")), dim=0))
    return weights


def crd_loss(v: Tensor, v_old: Tensor, v_ref: Tensor | None, u: Tensor, advantages: Tensor, *, crd_beta: float = 1.0,
             loss_type: str = "mse", adaptive_logp: bool = True, weight_temp: float = -1.0, kl_beta: float = 0.1,
             reward_adaptive_kl: bool = True, adv_clip_max: float = 5.0, group_ids: Tensor | None = None,
             centering: str = "batch") -> tuple[Tensor, dict[str, Tensor]]:
    """CRD's loss on one pool of samples (module docstring) and its stats.

    ``v`` (with gradient), ``v_old``, ``v_ref`` and ``u`` are ``[B, ...]`` (``v_old``, ``v_ref`` detached here;
    ``v_ref=None`` drops the KL); ``advantages`` ``[B]`` unclamped. ``centering="group"`` centres within each of
    ``group_ids`` (the loss is still the mean over all samples). Stats (detached): ``r_theta``, ``a`` and ``kl``
    (``||v - v_ref||^2_m``) ``[B]``; ``policy_loss`` (the scaled ``(A_max / beta) loss``), ``kl_loss``,
    ``unweighted_policy_loss``."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    if centering not in CENTERINGS:
        raise ValueError(f"centering must be one of {', '.join(CENTERINGS)}, got {centering!r}")
    if centering == "group" and group_ids is None:
        raise ValueError("centering='group' needs group_ids")
    v_old = v_old.detach()
    dims = tuple(range(1, v.ndim))
    if adaptive_logp:
        with torch.no_grad():
            w_theta = (v.double() - u.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
            w_old = (v_old.double() - u.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
        r = -((v - u) ** 2 / w_theta - (v_old - u) ** 2 / w_old)
    else:
        r = -((v - u) ** 2 - (v_old - u) ** 2)
    r_theta = r.mean(dim=dims)
    a = ((advantages.to(r_theta.dtype).clamp(-adv_clip_max, adv_clip_max) / adv_clip_max) / 2.0 + 0.5).clamp(0, 1)
    a = a.to(r_theta.device)
    if centering == "batch":
        pools = [torch.arange(len(a), device=a.device)]
    else:
        ids = group_ids.to(a.device)
        pools = [torch.nonzero(ids == g).flatten() for g in torch.unique(ids)]
    directions = None
    terms = []
    for pool in pools:
        a_pool, r_pool = a[pool], r_theta[pool]
        weights = _centre_weights(a_pool, weight_temp)
        directions = len(weights)
        for p in weights:
            centred = a_pool - (a_pool * p).sum(dim=0, keepdim=True)
            centred_theta = r_pool - (r_pool.detach() * p).sum(dim=0, keepdim=True).detach()
            if loss_type == "bce":
                target = torch.sigmoid(centred.detach())
                terms.append(F.binary_cross_entropy_with_logits(crd_beta * centred_theta, target, reduction="none"))
            else:
                terms.append((crd_beta * centred_theta - centred) ** 2)
    if directions == 1:
        unweighted = torch.cat(terms).mean()
    else:
        unweighted = 0.5 * torch.cat(terms[0::2]).mean() + 0.5 * torch.cat(terms[1::2]).mean()
    policy = unweighted * adv_clip_max / max(crd_beta, 1e-8)
    loss = policy
    stats = {"r_theta": r_theta.detach(), "a": a.detach(), "unweighted_policy_loss": unweighted.detach(),
             "policy_loss": policy.detach()}
    if v_ref is not None:
        kl = latent_mse(v, v_ref.detach())
        if reward_adaptive_kl:
            floor = 1e-4 / max(kl_beta, 1e-8)
            kl_loss = kl_beta * torch.mean((floor + a * (1 - floor)) * kl)
        else:
            kl_loss = kl_beta * kl.mean()
        loss = loss + kl_loss
        stats.update(kl=kl.detach(), kl_loss=kl_loss.detach())
    else:
        stats["kl_loss"] = torch.zeros((), dtype=policy.dtype, device=policy.device)
    return loss, stats


def crd_strata(sigmas: Tensor, count: int, timestep_range: float) -> tuple[Tensor, Tensor]:
    """``(lower, upper)`` grid indices of the port's ``discrete`` draw: the rollout grid's levels ``s >= 1 -
    timestep_range`` span indices ``[i0, i1]``, cut into ``count`` strata at ``floor(linspace(i0, i1, count + 1))``;
    an index is ``lower + floor(u (upper - lower))``, ``u ~ U[0, 1)``."""
    valid = torch.nonzero(sigmas.double() * 1000 >= 1000 * (1 - timestep_range) - 1e-3).flatten()
    if len(valid) == 0:
        raise ValueError(f"no level of the rollout grid lies in timestep_range {timestep_range:g}")
    boundaries = torch.linspace(int(valid.min()), int(valid.max()), count + 1)
    return boundaries[:-1].long(), boundaries[1:].long()


@dataclass
class CRDConfig(ForwardObjectiveConfig):
    crd_beta: float = option(1.0, "beta of the implicit reward beta log(p_theta / p_old) (port default 1)")
    loss_type: Literal["mse", "bce"] = option("mse", "the port's crd_loss_type: mse, or bce (BCE with logits "
                                                     "against sigmoid of the centred reward)")
    use_old_for_loss: bool = option(True, "the implicit reward's denominator is the lagging copy v_old (port); false = "
                                          "the base model (no CFG)")
    adaptive_logp: bool = option(True, "divide each squared error by its detached mean absolute value (port)")
    weight_temp: float = option(-1.0, "centring weights: < 0 uniform (port), > 0 dual softmax(+-a / T), 0 the hard "
                                      "split (on a in [0, 1], as released)")
    centering: Literal["batch", "group"] = option(
        "batch", "the centring pool: batch = the unit of batch_size samples (the port's micro-batch), group = each "
                 "prompt's group within it (the paper)")
    old_model_decay: str | int = option(
        "0-0.25-0.005-0.999", "v_old's decay spec 'start-start_value-slope-end' or a preset (0-6, none, slow, medium, "
                              "offline, fast, moderate); port default min(0.25 + 0.005 k, 0.999)")
    sampling_model_decay: str | int = option(
        "75-0.0-0.0075-0.999", "the sampling copy's decay spec (port default: 0 for 75 steps, then "
                               "min(0.0075 (k - 75), 0.999))")
    sample_with_copy: bool = option(True, "roll out with the sampling copy (port); false = with the trained weights")
    adv_clip_max: float = option(5.0, "advantages are clamped to +-this and mapped to a = A / (2 A_max) + 1/2")
    kl_beta: float = option(0.1, "weight of the velocity KL to the base (port 0.1); 0 = none")
    kl_cfg: float = option(4.5, "CFG scale of the KL's reference velocity (port 4.5); 1 = none. > 1 needs "
                                "sampling.guidance_scale > 1 (the negative prompts)")
    reward_adaptive_kl: bool = option(True, "weight each sample's KL by m + a (1 - m), m = 1e-4 / kl_beta (port)")
    timestep_fraction: float = option(0.99, "trained levels per sample: int(sampling.num_steps * fraction) (port)")
    timestep_range: float = option(0.99, "the levels are drawn from the grid's s >= 1 - range, stratified (port "
                                         "'discrete' over 0.99)")
    batch_size: int | None = option(None, "samples per unit (the centring pool); null = the rollout's chunk, "
                                          "sampling.batch_size or all of a process's samples")

    def validate(self) -> None:
        super().validate()
        finite("crd_beta", self.crd_beta, 0.0, strict=True)
        check(self.loss_type in LOSS_TYPES, "loss_type", f"must be one of {', '.join(LOSS_TYPES)}, got "
                                                         f"{self.loss_type!r}")
        finite("weight_temp", self.weight_temp, -float("inf"))
        check(self.centering in CENTERINGS, "centering", f"must be 'batch' or 'group', got {self.centering!r}")
        for key in ("old_model_decay", "sampling_model_decay"):
            try:
                parse_decay(getattr(self, key))
            except ValueError as error:
                check(False, key, str(error))
        finite("adv_clip_max", self.adv_clip_max, 0.0, strict=True)
        finite("kl_beta", self.kl_beta, 0.0)
        finite("kl_cfg", self.kl_cfg, 1.0)
        finite("timestep_fraction", self.timestep_fraction, 0.0, strict=True, high=1.0)
        finite("timestep_range", self.timestep_range, 0.0, strict=True, high=1.0)
        if self.batch_size is not None:
            check(isinstance(self.batch_size, int) and not isinstance(self.batch_size, bool) and self.batch_size >= 2,
                  "batch_size", f"must be an integer >= 2 (a pool to centre) or null, got {self.batch_size!r}")


def _copy_decay(spec):
    return lambda k: min(max(crd_decay(k, spec), 0.0), 1.0)  # <= 0 copies, >= 1 freezes, as the port's blend


@register_objective("crd", config=CRDConfig)
class CRD(ForwardObjective):
    """CRD: centred implicit rewards regressed onto centred mapped advantages (module docstring)."""

    config: CRDConfig
    sampling_setting = "sample_with_copy"

    @property
    def needs_reference(self) -> bool:
        cfg = self.config
        return not cfg.use_old_for_loss or (cfg.kl_beta > 0 and cfg.kl_cfg <= 1)

    def policy_copies(self) -> list[PolicyCopy]:
        cfg = self.config
        copies = []
        if cfg.use_old_for_loss:
            copies.append(PolicyCopy(OLD, _copy_decay(cfg.old_model_decay), "CRD's old model v_old"))
        if cfg.sample_with_copy:
            copies.append(PolicyCopy(SAMPLING, _copy_decay(cfg.sampling_model_decay), "CRD's sampling model",
                                     evaluated=False))  # the rollouts sample with it; the loss never reads it
        return copies

    def sampling_policy(self) -> str | None:
        return SAMPLING if self.config.sample_with_copy else None

    def slots(self, config) -> int:
        return int(config.sampling.num_steps * self.config.timestep_fraction)

    def samples_per_unit(self, config) -> int | None:
        return self.config.batch_size

    def check(self, config) -> None:
        super().check(config)
        cfg = self.config
        if cfg.kl_cfg > 1 and cfg.kl_beta > 0:
            check(config.sampling.guidance_scale > 1, self.key("kl_cfg"),
                  f"= {cfg.kl_cfg:g} evaluates the KL's reference with CFG, which needs the negative prompts the "
                  "rollout encodes only with sampling.guidance_scale > 1: raise it, or set kl_cfg=1 (no CFG)")
        if cfg.centering == "group" and cfg.batch_size is not None:
            check(cfg.batch_size % config.data.group_size == 0, self.key("batch_size"),
                  f"= {cfg.batch_size} with centering: group must hold whole groups of data.group_size = "
                  f"{config.data.group_size}")

    # --- the units ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        cfg, rollout = self.config, self.rollout_of(context)
        device = context.device if context.device is not None else rollout.x0.device
        x0, count = rollout.x0.float(), self.slots(context.config)
        grid = rollout.sigmas[:-1]
        lower, upper = crd_strata(grid, count, cfg.timestep_range)
        noise = torch.stack([torch.randn((count, *x0.shape[1:]), dtype=torch.float32,
                                         generator=forward_generator(context.seed, iteration, int(j), "crd_sample"))
                             for j in rollout.sample_ids])  # [n, T, ...]
        size = cfg.batch_size or self.default_unit_size(context.config, rollout)
        chunks = self.chunks(len(rollout), size)
        indices = []
        for rows in chunks:
            g = forward_generator(context.seed, iteration, int(rollout.sample_ids[rows[0]]) // size, "crd_unit")
            indices.append(lower + (torch.rand(count, generator=g) * (upper - lower)).long())
        units = []
        for slot in range(count):
            for rows, index in zip(chunks, indices):
                local = torch.tensor(list(rows))
                sigma = grid[index[slot]].float().expand(len(local)).clone().to(device)
                eps, clean = noise[local, slot].to(device), x0[local].to(device)
                unit = DataUnit(x=noised(clean, sigma, eps), sigma=sigma, cond=rollout.cond_of(local),
                                data={"target": eps - clean, "advantages": rollout.advantages[local].float().to(device),
                                      "group_ids": rollout.group_ids[local].to(device), "slot": slot,
                                      "index": int(index[slot])})
                if cfg.kl_cfg > 1 and cfg.kl_beta > 0:
                    unit.data["v_ref"] = reference_with_cfg(context.model, unit, cfg.kl_cfg)
                units.append(unit)
        return units

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        v = policy.v.float()
        v_old = policy.v_copies[OLD] if cfg.use_old_for_loss else policy.v_ref
        reference = None
        if cfg.kl_beta > 0:
            reference = unit.data["v_ref"] if cfg.kl_cfg > 1 else policy.v_ref
        value, parts = crd_loss(v, v_old.float(), None if reference is None else reference.float(),
                                unit.data["target"].float(), unit.data["advantages"], crd_beta=cfg.crd_beta,
                                loss_type=cfg.loss_type, adaptive_logp=cfg.adaptive_logp, weight_temp=cfg.weight_temp,
                                kl_beta=cfg.kl_beta, reward_adaptive_kl=cfg.reward_adaptive_kl,
                                adv_clip_max=cfg.adv_clip_max, group_ids=unit.data["group_ids"],
                                centering=cfg.centering)
        loss = cfg.weight * value
        stats = {"loss": float(loss.detach()), "policy_loss": float(parts["policy_loss"]),
                 "unweighted_policy_loss": float(parts["unweighted_policy_loss"]),
                 "r_theta": float(parts["r_theta"].mean()), "a_mean": float(parts["a"].mean()),
                 "old_deviate": float(latent_mse(v.detach(), v_old.float()).mean()), "sigma": float(unit.sigma[0])}
        if reference is not None:
            stats.update(kl=float(parts["kl"].mean()), kl_loss=float(parts["kl_loss"]))
        return loss, stats
