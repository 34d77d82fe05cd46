"""SOAR (Qin et al. 2026, arXiv 2604.12617): reward-free self-correction on real (image, caption) pairs, as the released
training script (Tencent-Hunyuan/HY-SOAR, ``soar/train_soar_sd3_5m.py``) computes it; the math is
``flowalign.objectives.soar_math``.

For each pair ``(z0, c)`` of a unit of ``B`` pairs, every draw keyed by ``(seed, iteration, unit, OBJECTIVE)`` in this
order (so any process layout makes the same units): ``t0 = sigmoid(m + s n)``, the noise ``z1``, the posterior draw
(``sample_posterior``), the uniforms of the auxiliary sigmas ``[paths, N, B]``, the SDE paths' noise:

1. ``s0 = table(t0)`` (the shifted 1000-entry training table), ``z_t0 = (1 - s0) z0 + s0 z1``; the base point
   ``(z_t0, s0)`` with target ``z1 - z0``.
2. One stop-gradient step with the current model: ``v_cfg = v_u + g (v_c - v_u)`` at ``z_t0``, ``t1 = max(t0 - 1/K,
   0)``, ``s1 = table(t1)``, ``z1' = z_t0 + v_cfg (s1 - s0)`` (plus ``rollout_paths - 1`` stochastic paths for the
   samples with ``t1 > 0``).
3. ``N`` auxiliary points per path re-noised toward the same ``z1`` at ``s' = s1 + u (1 - s1)``, target
   ``v_corr = (z' - z0) / s'``; the model sees the table's timestep for ``s'`` (``aux_timestep``).

A unit's rows are the ``B`` base points then the auxiliary points, evaluated by the trainer in one policy forward
(row by row the same as the released code's separate forwards). Its loss is the released normalisation over the
iteration's units, ``(sum l_base + lambda sum l_aux) / max(B_global + lambda N_aux_global, 1)``: the counts of every
unit follow from its keyed ``t0`` draws, so each process computes the global counts itself (what the released code's
all-reduce gives) and the mean over units the trainer takes (and DDP's over processes) is exactly that. With
``optim.minibatches > 1`` the normaliser stays the iteration's (exact for ODE-only runs, whose units all count the
same). The rollout step uses the weights at the start of the iteration's update: the current model when
``optim.minibatches = 1``.

Forward passes per sample: 2 for the CFG step (1 at guidance <= 1), counted in ``DataUnit.nfe``, plus the trainer's
``1 + N rollout_paths`` training forwards (at most; fewer SDE rows at the clean boundary).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from flowalign.objectives.base import DataUnit, ObjectiveContext, PolicyOutput, register_objective, unit_keys
from flowalign.objectives.flow_matching import DataObjectiveConfig, FlowMatching
from flowalign.objectives.soar_math import (
    ROLLOUT_KINDS,
    aux_model_sigma,
    aux_sigmas,
    clean_boundary,
    next_time,
    rollout_step,
    soar_aux_points,
    table_sigma,
    training_table,
)
from flowalign.seeding import Purpose
from flowalign.settings import check, finite, option

OBJECTIVE = int(Purpose.OBJECTIVE)
SDE_KINDS = tuple(kind for kind in ROLLOUT_KINDS if kind != "ode")

logger = logging.getLogger(__name__)

__all__ = ["Soar", "SoarConfig"]


@dataclass
class SoarConfig(DataObjectiveConfig):
    guidance_scale: float = option(4.5, "CFG scale of the stop-gradient rollout step (negative prompt ''); "
                                        "1 = the conditional velocity")
    lambda_aux: float = option(1.0, "weight of each auxiliary point against a base point")
    points: int = option(6, "auxiliary points per rollout path (the released trajectory_length)")
    rollout_paths: int = option(1, "rollout paths: 1 = the ODE step only; more add stochastic paths (sde_kind) for "
                                   "the samples off the clean boundary")
    sde_kind: Literal["flow_sde", "cps", "simple", "sde"] = option(
        "flow_sde", "the stochastic paths' step: flow_sde (Flow-GRPO's SDE), cps, simple (Euler-Maruyama) or sde "
                    "(x0_hat re-noised)")
    sde_noise_scale: float = option(0.5, "noise scale of the stochastic paths")
    sampling_steps: int = option(40, "K of the rollout step t1 = max(t0 - 1/K, 0) (the released num_sampling_steps)")
    logit_mean: float = option(0.0, "mean of the logit-normal density of t0")
    logit_std: float = option(1.0, "standard deviation of the logit-normal density of t0")
    table_shift: float = option(3.0, "shift of the 1000-entry training table t indexes (SD3's scheduler: 3)")
    aux_timestep: Literal["released", "continuous"] = option(
        "released", "the model's timestep at an auxiliary point: released = the table entry of the released code's "
                    "fp32 round trip (one entry early on 165 of 1000 indices at shift 3), continuous = 1000 s' (the "
                    "sigma its target uses)")

    def validate(self) -> None:
        super().validate()
        for key in ("points", "rollout_paths", "sampling_steps"):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                  f"must be an integer >= 1, got {value!r}")
        finite("guidance_scale", self.guidance_scale, 0.0)
        finite("lambda_aux", self.lambda_aux, 0.0)
        check(self.sde_kind in SDE_KINDS, "sde_kind", f"must be one of {', '.join(SDE_KINDS)}, got {self.sde_kind!r}")
        finite("sde_noise_scale", self.sde_noise_scale, 0.0)
        finite("logit_mean", self.logit_mean, -float("inf"))
        finite("logit_std", self.logit_std, 0.0, strict=True)
        finite("table_shift", self.table_shift, 0.0, strict=True)
        check(self.aux_timestep in ("released", "continuous"), "aux_timestep",
              f"must be 'released' or 'continuous', got {self.aux_timestep!r}")


@register_objective("soar", config=SoarConfig)
class Soar(FlowMatching):
    """SOAR (Qin et al. 2026), reward-free on real pairs: flow matching at t0, plus auxiliary points after one
    stop-gradient CFG step, re-noised toward the same noise and regressed onto the velocity back to the image."""

    config: SoarConfig

    def check(self, config) -> None:
        guidance = getattr(getattr(config, "sampling", None), "guidance_scale", 1.0)
        check(guidance <= 1.0, "sampling.guidance_scale",
              f"= {guidance:g}: SOAR regresses the conditional velocity (its training forwards run at guidance 1); "
              "set sampling.guidance_scale=1 and give the rollout step's guidance as objectives.soar.guidance_scale")

    # --- keyed draws --------------------------------------------------------------------------------------------------
    def times(self, generator: torch.Generator) -> Tensor:
        """``t0 = sigmoid(m + s n)`` for a unit: the first draw of its generator."""
        normal = torch.randn(self.config.batch_size, generator=generator, dtype=torch.float32)
        return torch.sigmoid(self.config.logit_mean + self.config.logit_std * normal)

    def unit_count(self, context: ObjectiveContext, index: int) -> float:
        """``B + lambda N_aux`` of unit ``index`` from its keyed ``t0`` alone (no image, no model)."""
        cfg = self.config
        active = int((~clean_boundary(self.times(context.generator(index, OBJECTIVE)), cfg.sampling_steps)).sum())
        aux = cfg.points * (cfg.batch_size + (cfg.rollout_paths - 1) * active)
        return cfg.batch_size + cfg.lambda_aux * aux

    # --- the objective ------------------------------------------------------------------------------------------------
    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        count = self.config.units_per_iteration
        keys = unit_keys(count, context)
        total = sum(self.unit_count(context, u) for u in range(count))  # every process's units: the global counts
        return [self.unit(iteration, u, context, scale=count / max(total, 1.0)) for u in keys]

    @torch.no_grad()
    def unit(self, iteration: int, index: int, context: ObjectiveContext, *, scale: float = 1.0) -> DataUnit:
        model, cfg = context.model, self.config
        device = context.device if context.device is not None else model.device
        dataset = self.dataset(context)
        rows = self.indices(context.seed, iteration, index, len(dataset))
        images, prompts = dataset.batch(rows)
        batch, size = len(rows), self.image_size(context)
        draws = context.generator(index, OBJECTIVE)
        t0 = self.times(draws)
        z1 = model.prepare_noise(batch, size, generator=draws, dtype=torch.float32).to(device)
        z0 = model.encode_images(images, sample=cfg.sample_posterior, generator=draws, dtype=torch.float32).to(device)
        uniforms = torch.rand(cfg.rollout_paths, cfg.points, batch, generator=draws, dtype=torch.float32)
        noise = (torch.randn((cfg.rollout_paths - 1, *z0.shape), generator=draws, dtype=torch.float32)
                 if cfg.rollout_paths > 1 else None)

        sigmas, _ = training_table(cfg.table_shift)
        s0 = table_sigma(t0, sigmas).to(device)
        s1 = table_sigma(next_time(t0, cfg.sampling_steps), sigmas).to(device)
        view = (-1, *([1] * (z0.ndim - 1)))
        z_t0 = (1 - s0.view(view)) * z0 + s0.view(view) * z1

        cfg_on = model.uses_cfg(cfg.guidance_scale)
        cond = model.encode(prompts, negative_prompts=[""] * batch if cfg_on else None)
        v_cfg = model.velocity(z_t0, s0, cond, cfg.guidance_scale).float()
        cond = replace(cond, negative_embeds=None, negative_pooled=None)

        paths = [(torch.arange(batch, device=device), rollout_step("ode", z_t0, v_cfg, s0, s1), uniforms[0])]
        active = (~clean_boundary(t0, cfg.sampling_steps)).nonzero().squeeze(1)
        for k in range(1, cfg.rollout_paths):
            if len(active) == 0:
                break
            a = active.to(device)
            z_t1 = rollout_step(cfg.sde_kind, z_t0[a], v_cfg[a], s0[a], s1[a], noise[k - 1][active].to(device),
                                noise_scale=cfg.sde_noise_scale, sigma_max=float(sigmas[1]))
            paths.append((a, z_t1, uniforms[k][:, active]))

        xs, sigma_rows, targets, samples = [z_t0], [s0], [z1 - z0], [torch.arange(batch, device=device)]
        for rows_of_path, z_t1, u in paths:
            sigma_aux = aux_sigmas(s1[rows_of_path], u.to(device))
            latents, v_corr = soar_aux_points(z0[rows_of_path], z1[rows_of_path], z_t1, s1[rows_of_path], sigma_aux)
            xs.append(latents.flatten(0, 1))
            targets.append(v_corr.flatten(0, 1))
            sigma_rows.append(aux_model_sigma(sigma_aux, sigmas.to(device), cfg.aux_timestep).flatten())
            samples.append(rows_of_path.repeat(cfg.points))
        sample_rows = torch.cat(samples)
        aux = len(sample_rows) - batch
        weights = torch.cat([torch.ones(batch, device=device), torch.full((aux,), cfg.lambda_aux, device=device)])
        return DataUnit(
            x=torch.cat(xs), sigma=torch.cat(sigma_rows), cond=cond.index(sample_rows),
            data={"target": torch.cat(targets), "weights": weights, "scale": scale, "base_rows": batch,
                  "rows": torch.tensor(rows, dtype=torch.long), "t0": t0, "sigma_t0": s0.cpu()},
            nfe=batch * (2 if cfg_on else 1))

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        """``weight * U (sum l_base + lambda sum l_aux) / max(C, 1)`` for the iteration's ``U`` units and global count
        ``C``; the trainer's mean over units (and processes) makes it the released normalisation."""
        target, weights, base = unit.data["target"], unit.data["weights"], unit.data["base_rows"]
        if tuple(policy.v.shape) != tuple(target.shape):
            raise ValueError(f"soar: the policy velocity has shape {tuple(policy.v.shape)}, the unit's target "
                             f"{tuple(target.shape)}")
        per_row = (policy.v.float() - target.float()).pow(2).flatten(1).mean(1)
        loss = self.config.weight * unit.data["scale"] * (weights * per_row).sum()
        aux = per_row[base:]
        stats = {"loss": float(loss.detach()), "base_mse": float(per_row[:base].detach().mean()),
                 "aux_mse": float(aux.detach().mean()) if len(aux) else 0.0,
                 "aux_points_per_sample": len(aux) / base, "sigma_mean": float(unit.data["sigma_t0"].mean())}
        return loss, stats
