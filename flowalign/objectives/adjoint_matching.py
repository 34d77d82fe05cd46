"""Adjoint matching, DRL's stage 2 (Beltran-Velez et al. 2026, arXiv 2606.19162, Alg. 2; Domingo-Enrich et al. 2025):
fine-tune toward ``p_base exp(lambda r)`` for a differentiable reward ``r`` (DRL: the discriminator's logit) by
regressing the policy's control onto the lean adjoint of the memoryless SDE. The math is
``flowalign.objectives.adjoint_matching_math`` and the sampler ``flowalign.samplers.memoryless``; no public code exists, so this follows the paper's equations
(``../shared/METHODS.md`` §3).

Each data unit is ``B`` trajectories, every draw from the generator keyed ``(seed, iteration, unit, OBJECTIVE)`` in
this order (so any process layout makes the same units): the prompts (uniform over the training prompts), the
initial noise, the ``K - 1`` noise draws of the memoryless SDE, the stratified steps. Then, stop-gradient:

1. ``X_0 .. X_K`` from the memoryless SDE with the **current policy**'s conditional velocity (no CFG) on the uniform
   grid ``s_k = 1 - k / K`` (local-linear or Euler steps, offsets ``delta = eps = 1 / K``; the last step one
   deterministic denoising call).
2. ``a_K = -lambda grad_x r(X_K)``: the reward of the decoded ``X_K`` (a latent reward reads ``X_K`` itself).
3. The lean adjoints ``a_k`` backwards with the **base** velocity's vector-Jacobian products (LoRA off).
4. A stratified 40% of the steps, half below ``t = 0.6`` and half at or above it (the same steps for the unit's
   trajectories).

The unit's rows are the states ``X_k`` at the trained steps (sample-major), which the trainer evaluates with the
policy and the reference (LoRA off). The loss of a sample is the mean over its trained steps of
``1/2 ||(2 / sigma_k)(v_theta - v_base) - sigma_k a_k||^2`` (summed over the latent's dimensions); a unit's loss is
``weight * sum_b keep_b l_b / B``: the samples above the outlier threshold ``tau`` count as zero.

**Outlier clipping, one iteration behind.** The paper updates ``tau`` with each batch's 0.9-quantile and masks that
batch. Here each unit's quantile is taken at its first loss of the iteration, and after the update ``tau`` moves
through every unit's quantile in unit order (gathered over the processes), so the threshold an iteration masks with
is the one after the previous iteration's units: it is the same for any process layout and any
``optim.minibatches``, and it is the checkpointed state (the first iteration masks nothing).

Forward passes per sample, in ``DataUnit.nfe``: ``K`` policy forwards for the trajectory and ``K - 1`` base forwards
for the vector-Jacobian products (each with its backward pass, not counted), plus the trainer's 2 per trained row
(policy and reference). The paper's buffer (trajectories reused for 5 epochs) is ``optim.inner_epochs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.errors import SetupError
from flowalign.models.base import as_image_size
from flowalign.objectives.adjoint_matching_math import OutlierClip, adjoint_matching_loss, lean_adjoints, stratified_steps
from flowalign.objectives.base import DataUnit, Objective, ObjectiveContext, PolicyOutput, register_objective, unit_keys
from flowalign.samplers.memoryless import INTEGRATORS, sample_memoryless
from flowalign.seeding import Purpose
from flowalign.settings import check, finite, option

__all__ = ["AdjointMatching", "AdjointMatchingConfig"]

OBJECTIVE = int(Purpose.OBJECTIVE)


@dataclass
class AdjointMatchingConfig(ComponentConfig):
    reward: str = option("discriminator", "the differentiable reward r whose tilt p_base exp(lambda r) is the target "
                                          "(DRL: the discriminator's logit)")
    reward_kwargs: dict[str, Any] = option({"path": "outputs/discriminator/discriminator.safetensors"},
                                           "keyword arguments for the reward's constructor")
    reward_scale: float = option(10.0, "lambda: the terminal adjoint is -lambda grad r (the paper's 10; 1 is the "
                                       "value at which the tilt is the data distribution)")
    num_steps: int | None = option(None, "K, the memoryless SDE's uniform steps; null = sampling.num_steps")
    integrator: Literal["local_linear", "euler"] = option(
        "local_linear", "the SDE's step: local_linear (the paper's Eq. 35) or euler (Euler-Maruyama with offsets)")
    delta: float | None = option(None, "the time offset u = 1 - sigma + delta; null = one step, 1 / K")
    eps: float | None = option(None, "the noise offset of the diffusion coefficient; null = one step, 1 / K")
    step_fraction: float = option(0.4, "the share of the K steps trained per trajectory (stratified)")
    step_split: float = option(0.6, "the paper time t = 1 - sigma splitting the stratified steps in halves")
    clip: bool = option(True, "mask per-sample losses above the adaptive outlier threshold tau")
    clip_quantile: float = option(0.9, "alpha: the quantile tau follows")
    clip_decay: float = option(0.9, "rho: the threshold's EMA decay")
    clip_cap: float = option(5.0, "c: a quantile counts at most c tau (spikes)")
    weight: float = option(1.0, "weight of this objective's loss")
    batch_size: int = option(4, "trajectories per data unit")
    units_per_iteration: int = option(1, "data units per iteration, split over the processes (a multiple of their "
                                         "number)")
    image_size: int | None = option(None, "latent size in pixels; null = sampling.image_size, else the model's default")

    def validate(self) -> None:
        check(isinstance(self.reward, str) and bool(self.reward), "reward",
              "must name a registered differentiable reward (DRL: discriminator)")
        finite("reward_scale", self.reward_scale, 0.0, strict=True)
        for key in ("batch_size", "units_per_iteration"):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                  f"must be an integer >= 1, got {value!r}")
        check(self.num_steps is None or (isinstance(self.num_steps, int) and self.num_steps >= 2), "num_steps",
              f"must be an integer >= 2 or null, got {self.num_steps!r}")
        check(self.integrator in INTEGRATORS, "integrator",
              f"must be one of {', '.join(INTEGRATORS)}, got {self.integrator!r}")
        for key in ("delta", "eps"):
            if getattr(self, key) is not None:
                finite(key, getattr(self, key), 0.0, strict=key == "delta")
        check(0.0 < self.step_fraction <= 1.0, "step_fraction", f"must be in (0, 1], got {self.step_fraction!r}")
        check(0.0 < self.step_split < 1.0, "step_split", f"must be in (0, 1), got {self.step_split!r}")
        check(0.0 < self.clip_quantile < 1.0, "clip_quantile", f"must be in (0, 1), got {self.clip_quantile!r}")
        check(0.0 <= self.clip_decay < 1.0, "clip_decay", f"must be in [0, 1), got {self.clip_decay!r}")
        finite("clip_cap", self.clip_cap, 1.0)
        finite("weight", self.weight, 0.0, strict=True)
        check(self.image_size is None or (isinstance(self.image_size, int) and self.image_size >= 1), "image_size",
              f"must be a positive integer or null, got {self.image_size!r}")


@register_objective("adjoint_matching", config=AdjointMatchingConfig)
class AdjointMatching(Objective):
    """Adjoint matching on the memoryless SDE toward ``p_base exp(lambda r)`` (module docstring)."""

    config: AdjointMatchingConfig
    needs_reference = True  # v_base at the trained states

    def __init__(self, config=None):
        super().__init__(config)
        self.clip = OutlierClip(self.config.clip_quantile, self.config.clip_decay, self.config.clip_cap)
        self.quantiles: dict[int, float] = {}  # this iteration's first quantile of each of this process's units
        self.accelerator = None  # set_up: the gather of the quantiles
        self.steps, self.run_image_size = self.config.num_steps, None  # set_up: K and sampling.image_size

    @property
    def key(self) -> str:
        return f"objectives.{self.name or 'adjoint_matching'}"

    def check(self, config) -> None:
        check(self.config.num_steps is not None or config.sampling.num_steps >= 2, "sampling.num_steps",
              f"= {config.sampling.num_steps}: adjoint matching needs K >= 2 steps; set {self.key}.num_steps")

    def start_up(self) -> None:
        from flowalign.rewards import require_differentiable_reward

        try:  # refused on its class, before anything is built
            require_differentiable_reward(self.config.reward, f"{self.key}.reward")
        except ValueError as error:
            raise SetupError(f"{error}; adjoint matching needs the reward's gradient (e.g. discriminator, "
                             "toy_geneval_soft, shell_lcc)") from None

    def check_reward(self, *, model: str | None = None, image_size=None) -> None:
        """A fitted reward (a discriminator, a manifold) was made for this model and image size (its ``check_run``)."""
        from flowalign.rewards import check_reward_run

        try:
            check_reward_run(self.config.reward, self.config.reward_kwargs, key=f"{self.key}.reward_kwargs",
                             model=model, image_size=image_size)
        except (FileNotFoundError, ValueError) as error:
            raise SetupError(str(error)) from error

    def check_model(self, model_path: str | None) -> None:
        self.check_reward(model=model_path)

    def set_up(self, parts) -> None:
        from flowalign.data.prompts import load_prompts
        from flowalign.rewards import bind_reward_model, build_differentiable_reward

        config = parts.config
        self.steps = config.sampling.num_steps if self.config.num_steps is None else self.config.num_steps
        self.run_image_size = config.sampling.image_size
        self.check_reward(image_size=self.config.image_size or self.run_image_size)  # known once the run is set up
        self.reward_model = build_differentiable_reward(self.config.reward, f"{self.key}.reward",
                                                        **self.config.reward_kwargs)
        bind_reward_model(self.reward_model, parts.model)
        self.accelerator = parts.accelerator
        self.prompts = list(load_prompts(config.data.train_prompts))

    # --- the units ----------------------------------------------------------------------------------------------------
    def grid(self) -> tuple[Tensor, float, float]:
        """The uniform grid ``sigma_k = 1 - k / K`` and the offsets ``(delta, eps)``."""
        sigmas = torch.linspace(1.0, 0.0, self.steps + 1)
        step = 1.0 / self.steps
        cfg = self.config
        return sigmas, (step if cfg.delta is None else cfg.delta), (step if cfg.eps is None else cfg.eps)

    def image_size(self, context: ObjectiveContext) -> tuple[int, int]:
        size = self.config.image_size if self.config.image_size is not None else self.run_image_size
        return as_image_size(size, context.model.default_image_size)

    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        return [self.unit(iteration, u, context) for u in unit_keys(self.config.units_per_iteration, context)]

    @torch.no_grad()
    def unit(self, iteration: int, index: int, context: ObjectiveContext) -> DataUnit:
        """Unit ``index``: ``B`` trajectories with their lean adjoints at the stratified steps (module docstring)."""
        from flowalign.rewards import score_latents

        cfg, model = self.config, context.model
        device = context.device if context.device is not None else model.device
        draws = context.generator(index, OBJECTIVE)
        rows = torch.randint(len(self.prompts), (cfg.batch_size,), generator=draws)
        entries = [self.prompts[int(r)] for r in rows]
        prompts = [entry["prompt"] for entry in entries]
        metadata = [dict(entry) for entry in entries]  # a prompt's entry is its metadata
        noise = model.prepare_noise(cfg.batch_size, self.image_size(context), generator=draws, dtype=torch.float32)
        cond = model.encode(prompts)
        sigmas, delta, eps = self.grid()

        def velocity(x: Tensor, sigma: Tensor) -> Tensor:
            return model.velocity(x, sigma.to(device), cond, 1.0).float()

        states = sample_memoryless(velocity, noise.to(device), sigmas, generator=draws, delta=delta, eps=eps,
                                   integrator=cfg.integrator)
        steps = stratified_steps(self.steps, fraction=cfg.step_fraction, split=cfg.step_split, generator=draws)
        with torch.enable_grad():
            final = states[-1].detach().float().requires_grad_(True)
            scores = score_latents(self.reward_model, final, model.decode, prompts, metadata, differentiable=True)
            (gradient,) = torch.autograd.grad(scores.sum(), final)
        with model.reference():
            adjoints = lean_adjoints(states, sigmas, -cfg.reward_scale * gradient, velocity, delta=delta, eps=eps,
                                     integrator=cfg.integrator)
        picked = steps.tolist()
        x = torch.stack([states[k] for k in picked], dim=1).flatten(0, 1)  # sample-major rows
        adjoint = torch.stack([adjoints[k] for k in picked], dim=1).flatten(0, 1)
        samples = torch.arange(cfg.batch_size).repeat_interleave(len(picked))
        return DataUnit(
            x=x.float(), sigma=sigmas[steps].repeat(cfg.batch_size).to(device), cond=cond.index(samples.to(device)),
            data={"adjoint": adjoint.float(), "samples": cfg.batch_size, "index": index, "steps": steps,
                  "reward": scores.detach().float().cpu(), "prompt_rows": rows, "delta": delta, "eps": eps},
            nfe=cfg.batch_size * (2 * self.steps - 1))

    # --- the loss -----------------------------------------------------------------------------------------------------
    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        data, samples = unit.data, unit.data["samples"]
        if policy.v_ref is None:
            raise ValueError("adjoint_matching: the unit was evaluated without the reference velocity")
        per_row = adjoint_matching_loss(policy.v, policy.v_ref, data["adjoint"], unit.sigma, delta=data["delta"],
                                        eps=data["eps"])
        per_sample = per_row.view(samples, -1).mean(dim=1)
        self.quantiles.setdefault(int(data["index"]), self.clip.quantile(per_sample))
        keep = (per_sample.detach() <= self.clip.tau if self.config.clip and self.clip.tau is not None
                else torch.ones_like(per_sample, dtype=torch.bool))
        loss = self.config.weight * (per_sample * keep).sum() / samples
        control = (policy.v.detach().float() - policy.v_ref.float()).pow(2).flatten(1).sum(1).mean()
        return loss, {"loss": float(loss.detach()), "am_loss": float(per_sample.detach().mean()),
                      "kept": float(keep.float().mean()), "reward": float(data["reward"].mean()),
                      "adjoint_norm": float(data["adjoint"].flatten(1).norm(dim=1).mean()),
                      "control_sq": float(control)}

    # --- the threshold, after the update ------------------------------------------------------------------------------
    def after_update(self, context, metrics: dict[str, float]) -> dict[str, float]:
        """Move ``tau`` through every unit's quantile of this iteration, in unit order over the processes."""
        pairs = torch.tensor(sorted(self.quantiles.items()), dtype=torch.float64).view(-1, 2)  # (unit key, quantile)
        self.quantiles = {}
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            pairs = self.accelerator.gather(pairs.to(self.accelerator.device)).cpu()
        for _, quantile in sorted(pairs.tolist()):
            self.clip.update(quantile)
        return {"adjoint_matching/tau": float("nan") if self.clip.tau is None else self.clip.tau}

    def state_dict(self) -> dict[str, Any]:
        return {"tau": self.clip.tau}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tau = state.get("tau")
        self.clip.tau = None if tau is None or (isinstance(tau, float) and math.isnan(tau)) else float(tau)
