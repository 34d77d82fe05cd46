"""RG-OPD: on-policy distillation of reward-guided sampling (RGS) into the policy.

On each trained step the policy's velocity at a source state ``x`` regresses onto the RGS target
``v_ref + delta / dt``, where ``delta`` is the RGS correction from a reward gradient at ``x``
(``flowalign.samplers.rgs.rgs_velocity_target``, with the RGS scale per sigma band ``bands``), everything on the
reference model (LoRA off) and detached:

    L = weight * sum_n w_n ||v_n - target_n||^2 / sum_n w_n        (mean over latent dims, w the step weights)

The gradient source is either latent reward registers (``registers``: the heads' gradients at ``x``) or a
differentiable reward (``reward``: its gradient on the decoded ``x0_hat = x - sigma v_ref``, or on ``x0_hat`` itself
for a latent reward such as ``shell_lcc``; ``v_ref`` held fixed, as RGS's ``--rgs-gradient x0``: no backward through
the transformer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.config import ConfigError
from flowalign.losses.base import LossTerm, MicroBatch, PolicyOutput, register_loss
from flowalign.settings import check, finite, option

__all__ = ["RGOPDConfig", "RGOPDLoss"]


@dataclass
class RGOPDConfig(ComponentConfig):
    weight: float = option(1.0, "weight of the regression onto the RGS targets")
    registers: str | None = option(
        None, "gradient source: a register checkpoint (`flowalign prep registers`) trained on this model")
    reward: str | None = option(
        None, "gradient source instead of registers: a differentiable image reward (e.g. toy_geneval_soft) of the "
        "reference model's decoded x0_hat, its gradient taken on x0_hat (no backward through the transformer)")
    reward_kwargs: dict[str, Any] = option({}, "keyword arguments for the reward's constructor (e.g. local weights: "
                                           "{checkpoint: DIR})")
    bands: list[list[float]] = option([[0.8, 0.3], [0.2, 0.05]],
                                      "the RGS scale per sigma band, [sigma, scale] pairs, highest sigma first")

    def validate(self) -> None:
        finite("weight", self.weight, 0.0, strict=True)
        check(not self.reward_kwargs or self.reward is not None, "reward_kwargs",
              "are the constructor arguments of reward: set reward, or drop them")
        check((self.registers is None) != (self.reward is None), "registers",
              "or reward: give RG-OPD exactly one gradient source, a register checkpoint (registers) or a "
              "differentiable image reward such as toy_geneval_soft (reward)")
        from flowalign.samplers.rgs import check_bands

        try:
            check_bands(self.bands)
        except ValueError as error:
            raise ConfigError(f"bands: {error}", key="bands") from None
        if self.reward is not None:
            from flowalign.rewards import REWARDS

            close = REWARDS.closest(self.reward)
            check(self.reward in REWARDS, "reward", f"= {self.reward!r} is not a registered reward; known: "
                  f"{', '.join(REWARDS.names())}" + (f"; did you mean {close!r}?" if close else ""))


@register_loss("rg_opd", config=RGOPDConfig)
class RGOPDLoss(LossTerm):
    """regress the policy's velocity onto reward-guided (RGS) targets on the reference model (RG-OPD)."""

    def wants_reference(self) -> bool:
        return self.config.reward is not None  # the reward's x0_hat uses v_ref; the registers compute their own

    def start_up(self) -> None:
        from flowalign.credit.register_grpo import check_register_file
        from flowalign.rewards import build_differentiable_reward

        if self.config.registers is not None:
            check_register_file(self.config.registers, "loss.rg_opd.registers")
        else:  # refused on its class before it is built when it has no gradient
            self.reward = build_differentiable_reward(self.config.reward, "loss.rg_opd.reward",
                                                      **self.config.reward_kwargs)

    def check_model(self, model_path: str | None) -> None:
        from flowalign.rewards import check_reward_run

        if self.config.reward is not None:  # a reward fitted for one model (a manifold, a discriminator) fits this one
            check_reward_run(self.config.reward, self.config.reward_kwargs, key="loss.rg_opd.reward_kwargs",
                             model=model_path)

    def set_up(self, parts) -> None:
        from flowalign.credit.register_grpo import load_for

        self.model, self.autocast = parts.model, parts.accelerator.autocast
        if getattr(self, "reward", None) is not None:
            from flowalign.rewards import bind_reward_model

            bind_reward_model(self.reward, parts.model)
        self.guidance_scale = parts.config.sampling.guidance_scale
        self.registers = load_for(self.config.registers, parts.model) if self.config.registers else None

    def loss(self, micro: MicroBatch, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        sigma, sigma_next = micro.sigma, micro.transitions.sigma_next[:1].expand(len(micro.sources))
        if self.registers is None:
            target = self.reward_target(micro.x, sigma, sigma_next, micro.cond, micro.metadata, policy.v_ref_sources)
        else:
            target = self.register_target(micro.x, sigma, sigma_next, micro.cond)
        opd = (policy.v.float() - target[micro.inverse]).pow(2).flatten(1).mean(dim=1)
        opd = (opd * micro.weights).sum() / micro.weights.sum().clamp_min(1e-8)
        return self.config.weight * opd, {"rg_opd": float(opd.detach())}

    def bands(self) -> list[tuple[float, ...]]:
        return [tuple(band) for band in self.config.bands]

    def register_target(self, x: Tensor, sigma: Tensor, sigma_next: Tensor, cond) -> Tensor:
        """Per-state targets ``v_ref + delta / dt`` with ``delta`` from the register heads' gradients at ``x``."""
        from flowalign.samplers.rgs import rgs_velocity_target

        model, registers = self.model, self.registers
        registers.attach(model.transformer)
        try:
            with torch.enable_grad(), model.reference(), self.autocast():
                x_in = x.detach().float().requires_grad_(True)
                v_ref, scores = registers.read(lambda x, s: model.velocity(x, s, cond, self.guidance_scale), x_in, sigma)
                heads = scores.shape[1]
                grads = [torch.autograd.grad(scores[:, h].sum(), x_in, retain_graph=h < heads - 1)[0]
                         for h in range(heads)]
        finally:
            registers.detach()
        return rgs_velocity_target(x_in.detach(), v_ref.detach(), grads, [1.0] * heads, sigma[0], sigma_next[0],
                                   self.bands()).detach()

    def reward_target(self, x: Tensor, sigma: Tensor, sigma_next: Tensor, cond, metadata: list[dict],
                      v_ref: Tensor | None) -> Tensor:
        """Per-state targets from the reward's gradient on the decoded ``x0_hat`` (``v_ref`` held fixed)."""
        from flowalign.rewards import score_latents
        from flowalign.samplers.rgs import rgs_velocity_target, x0_hat_gradient

        model = self.model
        if v_ref is None:
            with torch.no_grad(), model.reference(), self.autocast():
                v_ref = model.velocity(x, sigma, cond, self.guidance_scale)
        prompts = [m["prompt"] for m in metadata]

        def score(x0: Tensor, rows) -> Tensor:  # through the reward's differentiable entry point (latents or images)
            return score_latents(self.reward, x0, model.decode, prompts, metadata, differentiable=True)

        grad = x0_hat_gradient(score, x.float(), v_ref.float(), sigma[0], None)
        return rgs_velocity_target(x.float(), v_ref.float(), [grad], [1.0], sigma[0], sigma_next[0],
                                   self.bands()).detach()
