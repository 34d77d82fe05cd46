"""Shell-LCC's released fine-tuning objective: the frozen data manifold's distance of a one-step clean estimate.

Reference: Zhang et al., ECCV 2026, arXiv 2606.30248; needylove/Shell-LCC ``scripts/train_T2V_model.py``. Each data
unit is ``B`` samples of **pure noise** ``x ~ N(0, I)`` labelled with noise levels ``sigma ~ U[sigma_min, sigma_max]``
(default ``[0.7, 1]``) and a training prompt each; with the policy's velocity ``v = v_theta(x, sigma, prompt)``:

    x0_hat = x - sigma v
    R      = mean of d(x0_hat) over every latent position and the unit      (reward_models.shell_lcc, eval mode)
    loss   = weight * (R  or  |R - tau|  +  relu(MSE(x0_hat, x0_hat_ref) - drift_margin))

``x0_hat_ref = x - sigma v_ref`` is the reference model's (LoRA off); the anti-drift term is off by default (the
released "paper setting", ``--no_drift``). The band ``|R - tau|`` is the released ``--reward_target``; ``tau`` null
takes the data's mean distance from the manifold's sidecar. The gradient runs through the frozen manifold into the
policy (one forward per unit, no rollout). Noise, sigmas and prompts are drawn from the generator keyed
``(seed, iteration, unit, OBJECTIVE)``, so every process layout makes the same units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.errors import SetupError
from flowalign.models.base import as_image_size
from flowalign.objectives.base import DataUnit, Objective, ObjectiveContext, PolicyOutput, register_objective, unit_keys
from flowalign.seeding import Purpose
from flowalign.settings import check, finite, option

__all__ = ["ShellLCCObjective", "ShellLCCObjectiveConfig"]

OBJECTIVE = int(Purpose.OBJECTIVE)


@dataclass
class ShellLCCObjectiveConfig(ComponentConfig):
    path: str = option("outputs/manifolds/shell_lcc.safetensors",
                       "the Shell-LCC manifold (`flowalign prep fit-manifold`) fitted on this model's VAE latents; "
                       "checked at start-up")
    variant: Literal["distance", "band"] = option(
        "distance", "distance = minimise R (the released default; it drives x0_hat toward the skeleton), band = "
                    "minimise |R - tau| (the released --reward_target)")
    tau: float | None = option(None, "the band's target distance; null = the data's mean distance (the manifold's "
                                     "sidecar), the released 14B run used 0.444")
    weight: float = option(1.0, "weight of this objective's loss")
    batch_size: int = option(4, "noise samples per data unit (the released effective batch is 8)")
    units_per_iteration: int = option(1, "data units per iteration, split over the processes (a multiple of their "
                                         "number)")
    sigma_min: float = option(0.7, "lowest noise level the pure noise is labelled with")
    sigma_max: float = option(1.0, "highest noise level the pure noise is labelled with")
    drift_margin: float | None = option(None, "anti-drift term relu(MSE(x0_hat, x0_hat_ref) - margin), the released "
                                              "0.05; null = off (the released paper setting)")
    image_size: int | None = option(None, "latent size in pixels; null = sampling.image_size, else the model's default")

    def validate(self) -> None:
        check(isinstance(self.path, str) and bool(self.path), "path", "must name a Shell-LCC manifold file")
        check(self.variant in ("distance", "band"), "variant", f"must be 'distance' or 'band', got {self.variant!r}")
        if self.tau is not None:
            finite("tau", self.tau, 0.0)
        finite("weight", self.weight, 0.0, strict=True)
        for key in ("batch_size", "units_per_iteration"):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                  f"must be an integer >= 1, got {value!r}")
        finite("sigma_min", self.sigma_min, 0.0, strict=True)
        finite("sigma_max", self.sigma_max, 0.0, strict=True)
        check(self.sigma_min <= self.sigma_max <= 1.0, "sigma_max",
              f"must lie in [sigma_min, 1], got sigma_min {self.sigma_min}, sigma_max {self.sigma_max}")
        if self.drift_margin is not None:
            finite("drift_margin", self.drift_margin, 0.0)


@register_objective("shell_lcc", config=ShellLCCObjectiveConfig)
class ShellLCCObjective(Objective):
    """Shell-LCC's released objective: the manifold distance of the one-step x0_hat of pure noise."""

    config: ShellLCCObjectiveConfig

    @property
    def needs_reference(self) -> bool:  # the anti-drift term reads x0_hat_ref
        return self.config.drift_margin is not None

    def start_up(self) -> None:
        from flowalign.reward_models.shell_lcc import load_manifold

        key = f"objectives.{self.name or 'shell_lcc'}.path"
        try:
            self.manifold, self.meta = load_manifold(self.config.path, key)
        except (FileNotFoundError, ValueError) as error:
            raise SetupError(str(error)) from error
        self.manifold.requires_grad_(False)
        self.tau = float(self.config.tau if self.config.tau is not None else self.meta.get("data_distance", 1.0))

    def check_model(self, model_path: str | None) -> None:
        from flowalign.reward_models.shell_lcc import check_fitted_for, vae_fingerprint

        if model_path is not None:
            try:
                check_fitted_for(self.meta, vae_fingerprint(model_path), self.config.path,
                                 f"objectives.{self.name or 'shell_lcc'}.path")
            except ValueError as error:
                raise SetupError(str(error)) from error

    def set_up(self, parts) -> None:
        from flowalign.data.prompts import load_prompts
        from flowalign.reward_models.shell_lcc import check_fitted_for, vae_fingerprint_of

        try:
            check_fitted_for(self.meta, vae_fingerprint_of(parts.model), self.config.path,
                             f"objectives.{self.name or 'shell_lcc'}.path")
        except ValueError as error:
            raise SetupError(str(error)) from error
        self.manifold.to(parts.model.device)
        self.prompts = [entry["prompt"] for entry in load_prompts(parts.config.data.train_prompts)]

    def image_size(self, context: ObjectiveContext) -> tuple[int, int]:
        size = self.config.image_size
        if size is None:
            size = getattr(getattr(context.config, "sampling", None), "image_size", None)
        return as_image_size(size, context.model.default_image_size)

    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        return [self.unit(iteration, u, context) for u in unit_keys(self.config.units_per_iteration, context)]

    @torch.no_grad()
    def unit(self, iteration: int, index: int, context: ObjectiveContext) -> DataUnit:
        """Unit ``index``: pure noise, its sigma labels and prompts, all from the generator keyed by the unit."""
        cfg, model = self.config, context.model
        draws = context.generator(index, OBJECTIVE)
        sigma = cfg.sigma_min + (cfg.sigma_max - cfg.sigma_min) * torch.rand(cfg.batch_size, generator=draws)
        rows = torch.randint(len(self.prompts), (cfg.batch_size,), generator=draws)
        noise = model.prepare_noise(cfg.batch_size, self.image_size(context), generator=draws, dtype=torch.float32)
        device = context.device if context.device is not None else model.device
        return DataUnit(x=noise.to(device), sigma=sigma.to(device),
                        cond=model.encode([self.prompts[int(r)] for r in rows]), data={"rows": rows})

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        s = unit.sigma.float().view(-1, *([1] * (unit.x.ndim - 1)))
        x0_hat = unit.x.float() - s * policy.v.float()
        distance = self.manifold.distance_reward(x0_hat)
        value = distance if self.config.variant == "distance" else (distance - self.tau).abs()
        stats = {"distance": float(distance.detach())}
        if self.config.drift_margin is not None:
            reference = unit.x.float() - s * policy.v_ref.float()
            drift = torch.relu((x0_hat - reference).pow(2).mean() - self.config.drift_margin)
            value = value + drift
            stats["drift"] = float(drift.detach())
        loss = self.config.weight * value
        stats["loss"] = float(loss.detach())
        return loss, stats
