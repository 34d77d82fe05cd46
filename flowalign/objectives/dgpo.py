"""DGPO, Direct Group Preference Optimization (Luo, Hu, Tang 2025, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", arXiv 2510.08425), as its released training script computes it (Luo-Yihong/DGPO@01ceb4b
``scripts/train_sd3_dgpo.py``: ``compute_group_dgpo_loss_allreduce``, ``generate_shared_noise_for_groups`` and the
loop in ``main``; ``config/dgpo*.py``).

A group-level Diffusion-DPO on the rollout's final samples (any sampler, no log-prob is read). Each prompt's group is
split by the sign of the advantage ``A`` (clamped to ``+-adv_clip_max``; the clamp breaks the zero sum, as released)
into ``G+`` and ``G-``, and ``log sigmoid(R(G+) - R(G-))`` is maximised with the Diffusion-DPO implicit reward. At
each of ``M`` training noise levels (grid indices drawn without replacement from ``{0, ..., trunc_steps}``, shared by
every sample) each group shares one noise ``eps`` (redrawn at every level), ``x_s = (1 - s) x0 + s eps``,
``u = eps - x0``, and

    dsm_i     = ||u - v_theta(x_s)||^2_m                      (conditional, no CFG)
    dsm_ref_i = ||u - v_dgpo_ref||^2_m                        (v_ref: the base, CFG kl_cfg; or v_old: use_ema_ref)
    S_g       = (beta_dpo / K) sum_{i in g} A_i sg(dsm_i - dsm_ref_i)          (K = the configured group size)
    L         = mean_i sg(sigmoid(S_g(i))) A_i dsm_i + kl_beta mean_i ||v_theta - v_ref||^2_m .

``L``'s gradient is ``K / (beta_dpo B)`` times that of ``sum_g -log sigmoid(-S_g)``: the README's objective with
``R_theta(G) = -(beta / K) sum_{i in G} |A_i| (dsm_i - dsm_ref_i)``; the *value* is the surrogate, so the DPO loss is
logged apart (``dpo_loss``: the mean over groups of ``-log sigmoid(-S_g)``).

PPO-style clip (released, "added after review"): with the lagging copy ``v_old``, ``ratio_i = exp(dsm_old_i -
dsm_i)``; sample ``i`` is clipped iff ``A_i > 0`` and ``ratio > 1 + c``, or ``A_i <= 0`` and ``ratio < 1 - c``;
``clip_dsm`` replaces ``dsm_i`` by ``sg(dsm_i)`` there (same value, no gradient), ``clip_kl`` does so to its KL.
``v_old`` moves after every optimizer step by ``old <- d old + (1 - d) theta``, ``d = min(0.3, 0.001 k)`` (``k``
the steps before it, so ``d = 0`` at the first), and from ``k > switch_ema_ref`` the rollouts sample with it.

Departures (docs/methods/dgpo.md): the copy moves at the end of an iteration (one optimizer step per iteration in the
preset: the same thing); units are made once per iteration, so several inner epochs reuse their levels and noise
(released: a fresh draw per inner epoch); the rollout is flowalign's Euler ODE, not DPM-Solver.
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

__all__ = ["DGPO", "DGPOConfig", "NOISE_MODES", "dgpo_decay", "dgpo_loss", "dgpo_timestep_indices"]

OLD = "dgpo_old"
NOISE_MODES = ("per_timestep", "per_iteration", "independent")


def dgpo_loss(v: Tensor, u: Tensor, v_ref: Tensor, advantages: Tensor, group_ids: Tensor, *, beta_dpo: float,
              group_size: int, v_old: Tensor | None = None, clip_range: float | None = None, clip_dsm: bool = True,
              clip_kl: bool = False, use_ema_ref: bool = False, kl_beta: float = 0.0,
              adv_clip_max: float = 5.0) -> tuple[Tensor, dict[str, Tensor]]:
    """DGPO's loss on one micro-batch of whole groups (module docstring) and its stats.

    ``v`` (with gradient), ``u`` (the target ``eps - x0``), ``v_ref`` and ``v_old`` are ``[B, ...]``; ``v_ref`` and
    ``v_old`` are detached here. ``advantages`` ``[B]`` are the unclamped tracker output (clamped here to
    ``+-adv_clip_max``), ``group_ids`` ``[B]`` any integers in any order; ``group_size`` is ``K``, the configured
    group size (not the count present). The clip runs when ``v_old`` is given and ``clip_dsm or clip_kl`` (then
    ``clip_range`` is required); ``use_ema_ref`` takes ``v_old`` as the DPO reference (it must be given).

    Stats (detached): ``dsm``, ``dsm_ref`` ``[B]``; ``group_sums`` ``S_g`` in sorted-id order; ``sample_weights``
    ``sigmoid(S_g(i))`` ``[B]``; ``should_clip`` ``[B]`` bool (when the clip runs); ``dgpo_loss`` and ``kl_loss``
    (scalars, ``kl_loss`` 0 without KL); ``dpo_loss`` (mean over groups of ``-log sigmoid(-S_g)``)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size!r}")
    if use_ema_ref and v_old is None:
        raise ValueError("use_ema_ref takes v_old as the DPO reference: pass v_old")
    clipping = v_old is not None and (clip_dsm or clip_kl)
    if clipping and clip_range is None:
        raise ValueError("the clip (v_old given with clip_dsm or clip_kl) needs clip_range")
    advantages = advantages.to(v.dtype).clamp(-adv_clip_max, adv_clip_max)
    v_ref = v_ref.detach()
    v_old = None if v_old is None else v_old.detach()
    dsm = latent_mse(u, v)
    with torch.no_grad():
        dsm_ref = latent_mse(u, v_old if use_ema_ref else v_ref)
    stats: dict[str, Tensor] = {}
    should_clip = None
    if clipping:
        with torch.no_grad():
            ratio = torch.exp(latent_mse(u, v_old) - dsm)
            should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
        if clip_dsm:
            dsm = torch.where(should_clip, dsm.detach(), dsm)
        stats["should_clip"] = should_clip
    _, group = torch.unique(group_ids, return_inverse=True)
    group = group.to(dsm.device)
    per_sample = advantages * beta_dpo * (dsm.detach() - dsm_ref) / group_size
    sums = torch.zeros(int(group.max()) + 1, dtype=per_sample.dtype, device=per_sample.device)
    sums = sums.scatter_add(0, group, per_sample)
    weights = torch.sigmoid(sums)[group]
    policy = (weights.detach() * advantages * dsm).mean()
    loss = policy
    kl_loss = torch.zeros((), dtype=policy.dtype, device=policy.device)
    if kl_beta > 0:
        kl = latent_mse(v, v_ref)
        if clip_kl and should_clip is not None:
            kl = torch.where(should_clip, kl.detach(), kl)
        kl_loss = kl.mean()
        loss = loss + kl_beta * kl_loss
    stats.update(dsm=dsm.detach(), dsm_ref=dsm_ref, group_sums=sums, sample_weights=weights,
                 dgpo_loss=policy.detach(), kl_loss=kl_loss.detach(), dpo_loss=-F.logsigmoid(-sums).mean())
    return loss, stats


def dgpo_decay(steps: int, *, rate: float = 0.001, maximum: float = 0.3) -> float:
    """The released ``old`` decay after an optimizer step with ``steps - 1`` steps before it: ``min(maximum,
    rate (steps - 1))`` (``d = 0`` at the first step; flowalign calls it with the steps taken so far)."""
    return min(maximum, rate * max(int(steps) - 1, 0))


def dgpo_timestep_indices(generator: torch.Generator, count: int, trunc_steps: int) -> Tensor:
    """``count`` grid indices drawn without replacement from ``{0, ..., trunc_steps}`` (the released
    ``random.sample``), in draw order."""
    if not 1 <= count <= trunc_steps + 1:
        raise ValueError(f"cannot draw {count} distinct indices from {{0, ..., {trunc_steps}}}")
    return torch.randperm(trunc_steps + 1, generator=generator)[:count]


@dataclass
class DGPOConfig(ForwardObjectiveConfig):
    beta_dpo: float = option(100.0, "beta_dpo of the group DPO (released OCR 100; PickScore 10; EMA reference 2000)")
    kl_beta: float = option(0.02, "weight of the velocity KL to the base, mean ||v - v_ref||^2 (released OCR 0.02; "
                                  "PickScore and EMA reference 0.001); 0 = none")
    kl_cfg: float = option(1.0, "CFG scale of the reference velocity (the DPO reference and the KL's); 1 = none "
                                "(released default; its CFG-free frozen-reference recipe 4.5). > 1 needs "
                                "sampling.guidance_scale > 1 (the negative prompts)")
    clip_range: float = option(1e-2, "c of the PPO-style clip of ratio = exp(dsm_old - dsm) (released OCR 1e-2; base "
                                     "5e-2; CFG-free 1e-5)")
    clip_dsm: bool = option(True, "a clipped sample's dsm carries no gradient (released)")
    clip_kl: bool = option(False, "a clipped sample's KL carries no gradient (released default off)")
    use_ema_ref: bool = option(False, "the DPO reference is the lagging copy v_old instead of the base")
    switch_ema_ref: int | None = option(
        200, "roll out with the lagging copy once more than this many optimizer steps are taken (released OCR 200, "
             "GenEval 500); null = always with the trained weights")
    noise: Literal["per_timestep", "per_iteration", "independent"] = option(
        "per_timestep", "the training noise: per_timestep = one eps per group, redrawn at every trained level "
                        "(released use_shared_noise); per_iteration = one eps per group for all levels (Flow-Factory); "
                        "independent = one eps per sample and level (use_shared_noise false)")
    num_train_timesteps: int = option(4, "M: trained noise levels per sample, grid indices drawn without replacement "
                                         "(released 4)")
    trunc_steps: int = option(6, "the indices are drawn from {0, ..., trunc_steps} of the rollout grid (released 6; "
                                 "GenEval 4)")
    adv_clip_max: float = option(5.0, "advantages are clamped to +-this (released 5)")
    old_decay_rate: float = option(0.001, "v_old's decay grows by this per optimizer step (released 0.001)")
    old_decay_max: float = option(0.3, "the most v_old's decay reaches (released 0.3)")
    groups_per_unit: int = option(1, "whole groups (of data.group_size samples) per unit, one forward each")

    def validate(self) -> None:
        super().validate()
        finite("beta_dpo", self.beta_dpo, 0.0, strict=True)
        finite("kl_beta", self.kl_beta, 0.0)
        finite("kl_cfg", self.kl_cfg, 1.0)
        finite("clip_range", self.clip_range, 0.0, strict=True)
        check(not (self.use_ema_ref and not self.clip_dsm and not self.clip_kl), "use_ema_ref",
              "= true with clip_dsm = false and clip_kl = false: the released code never evaluates v_old then (its "
              "NameError); set clip_dsm=true (released) or clip_kl=true, or use_ema_ref=false")
        if self.switch_ema_ref is not None:
            check(isinstance(self.switch_ema_ref, int) and not isinstance(self.switch_ema_ref, bool)
                  and self.switch_ema_ref >= 0, "switch_ema_ref",
                  f"must be an integer >= 0 or null, got {self.switch_ema_ref!r}")
        check(self.noise in NOISE_MODES, "noise", f"must be one of {', '.join(NOISE_MODES)}, got {self.noise!r}")
        for key, low in (("num_train_timesteps", 1), ("trunc_steps", 0), ("groups_per_unit", 1)):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= low, key,
                  f"must be an integer >= {low}, got {value!r}")
        check(self.num_train_timesteps <= self.trunc_steps + 1, "num_train_timesteps",
              f"= {self.num_train_timesteps} distinct indices cannot be drawn from {{0, ..., {self.trunc_steps}}} "
              "(trunc_steps): lower it or raise trunc_steps")
        finite("adv_clip_max", self.adv_clip_max, 0.0, strict=True)
        finite("old_decay_rate", self.old_decay_rate, 0.0)
        finite("old_decay_max", self.old_decay_max, 0.0, high=1.0)


@register_objective("dgpo", config=DGPOConfig)
class DGPO(ForwardObjective):
    """DGPO: a group-level DPO on the rollout's final samples, with a PPO-style clip against a lagging copy (module
    docstring)."""

    config: DGPOConfig
    sampling_setting = "switch_ema_ref"
    unit_setting = "groups_per_unit"

    def __init__(self, config: DGPOConfig | None = None):
        super().__init__(config)
        self.optimizer_steps = 0  # as of the copy's last move: decides the sampling policy

    @property
    def clipping(self) -> bool:
        return self.config.clip_dsm or self.config.clip_kl

    @property
    def needs_reference(self) -> bool:
        cfg = self.config
        return cfg.kl_cfg <= 1 and (cfg.kl_beta > 0 or not cfg.use_ema_ref)

    def old_decay(self, steps: int) -> float:
        self.optimizer_steps = int(steps)
        return dgpo_decay(steps, rate=self.config.old_decay_rate, maximum=self.config.old_decay_max)

    def policy_copies(self) -> list[PolicyCopy]:
        cfg = self.config
        if not (self.clipping or cfg.use_ema_ref or cfg.switch_ema_ref is not None):
            return []
        return [PolicyCopy(OLD, self.old_decay, "DGPO's lagging copy v_old (the clip, the EMA reference)",
                           evaluated=self.clipping or cfg.use_ema_ref)]  # else only the rollout switch samples with it

    def sampling_policy(self) -> str | None:
        switch = self.config.switch_ema_ref
        return OLD if switch is not None and self.optimizer_steps > switch else None

    def prepare_update(self, context) -> dict[str, float]:
        """Whether this iteration's rollouts sampled with the lagging copy (the step count has not moved since)."""
        return {"dgpo/sampled_with_old": float(self.sampling_policy() is not None)}

    def state_dict(self) -> dict:
        return {"optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", 0))

    def slots(self, config) -> int:
        return self.config.num_train_timesteps

    def slots_setting(self) -> str:
        return "num_train_timesteps"

    def samples_per_unit(self, config) -> int:
        return self.config.groups_per_unit * config.data.group_size

    def check(self, config) -> None:
        super().check(config)
        cfg = self.config
        check(cfg.trunc_steps < config.sampling.num_steps, self.key("trunc_steps"),
              f"= {cfg.trunc_steps} is not a step of the {config.sampling.num_steps}-step rollout grid "
              "(sampling.num_steps): lower it")
        check(config.data.group_size >= 2, "data.group_size",
              f"= {config.data.group_size}: objectives.{self.name} compares the samples of a group, which needs >= 2")
        if cfg.switch_ema_ref is not None:
            check(not config.loss, self.key("switch_ema_ref"),
                  f"rolls out with the lagging copy after {cfg.switch_ema_ref} steps, but loss terms "
                  f"({', '.join(config.loss)}) train the rollout's transitions, whose log-probs must be the trained "
                  f"policy's: set {self.key('switch_ema_ref')}=null or turn the loss terms off (loss.grpo=null)")
        if cfg.kl_cfg > 1:
            check(config.sampling.guidance_scale > 1, self.key("kl_cfg"),
                  f"= {cfg.kl_cfg:g} evaluates the reference with CFG, which needs the negative prompts the rollout "
                  "encodes only with sampling.guidance_scale > 1: raise it, or set kl_cfg=1")

    # --- the units ----------------------------------------------------------------------------------------------
    def noise_of(self, context: ObjectiveContext, rollout, shape: tuple[int, ...]) -> Tensor:
        """The training noise ``[n, M, ...]`` of this process's samples (``noise``), keyed by group or sample."""
        cfg, count = self.config, self.config.num_train_timesteps
        rows, cache = [], {}
        for position in range(len(rollout)):
            if cfg.noise == "independent":
                g = forward_generator(context.seed, context.iteration, int(rollout.sample_ids[position]), "dgpo_sample")
                rows.append(torch.randn((count, *shape), generator=g, dtype=torch.float32))
                continue
            group = int(rollout.group_ids[position])
            if group not in cache:
                g = forward_generator(context.seed, context.iteration, group, "dgpo_group")
                draws = 1 if cfg.noise == "per_iteration" else count
                cache[group] = torch.randn((draws, *shape), generator=g, dtype=torch.float32).expand(count, *shape)
            rows.append(cache[group])
        return torch.stack(rows)

    @torch.no_grad()
    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        cfg, rollout = self.config, self.rollout_of(context)
        device = context.device if context.device is not None else rollout.x0.device
        group_size = context.config.data.group_size
        x0 = rollout.x0.float()
        steps_g = forward_generator(context.seed, iteration, 0, "dgpo_steps")
        indices = dgpo_timestep_indices(steps_g, cfg.num_train_timesteps, cfg.trunc_steps)
        noise = self.noise_of(context, rollout, tuple(x0.shape[1:]))
        chunks = self.chunks(len(rollout), cfg.groups_per_unit * group_size)
        for rows in chunks:
            ids = rollout.group_ids[list(rows)]
            _, counts = torch.unique(ids, return_counts=True)
            if not bool((counts == group_size).all()):
                raise ValueError(f"objectives.{self.name}: a unit of samples {rows.start}..{rows.stop - 1} does not "
                                 f"hold whole groups of data.group_size = {group_size} (every process must hold whole "
                                 "groups)")
        units = []
        for slot, index in enumerate(indices.tolist()):
            for rows in chunks:
                local = torch.tensor(list(rows))
                sigma = rollout.sigmas[index].float().expand(len(local)).clone().to(device)
                eps, clean = noise[local, slot].to(device), x0[local].to(device)
                unit = DataUnit(x=noised(clean, sigma, eps), sigma=sigma, cond=rollout.cond_of(local),
                                data={"target": eps - clean, "advantages": rollout.advantages[local].float().to(device),
                                      "group_ids": rollout.group_ids[local].to(device), "group_size": group_size,
                                      "slot": slot, "index": index})
                if cfg.kl_cfg > 1:
                    unit.data["v_ref"] = reference_with_cfg(context.model, unit, cfg.kl_cfg)
                units.append(unit)
        return units

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        v = policy.v.float()
        reference = unit.data.get("v_ref", policy.v_ref)
        v_old = policy.v_copies.get(OLD)
        v_old = None if v_old is None or not (self.clipping or cfg.use_ema_ref) else v_old.float()
        if reference is None:  # the EMA reference without KL: no base pass
            reference = v_old
        value, parts = dgpo_loss(v, unit.data["target"].float(), reference.float(), unit.data["advantages"],
                                 unit.data["group_ids"], beta_dpo=cfg.beta_dpo, group_size=unit.data["group_size"],
                                 v_old=v_old, clip_range=cfg.clip_range,
                                 clip_dsm=cfg.clip_dsm, clip_kl=cfg.clip_kl, use_ema_ref=cfg.use_ema_ref,
                                 kl_beta=cfg.kl_beta, adv_clip_max=cfg.adv_clip_max)
        loss = cfg.weight * value
        stats = {"loss": float(loss.detach()), "policy_loss": float(parts["dgpo_loss"]),
                 "dpo_loss": float(parts["dpo_loss"]), "dsm": float(parts["dsm"].mean()),
                 "dsm_ref": float(parts["dsm_ref"].mean()), "weight_mean": float(parts["sample_weights"].mean()),
                 "sigma": float(unit.sigma[0])}
        if cfg.kl_beta > 0:
            stats["kl_loss"] = float(parts["kl_loss"])
        if "should_clip" in parts:
            stats["clip_frac"] = float(parts["should_clip"].float().mean())
        return loss, stats
