"""DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process",
arXiv 2509.16117), as its released training script computes it (NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``,
``config/nft.py``).

Rollouts come from a lagging "old" policy ``theta_old`` with any sampler (no log-prob is read). Each reward becomes an
optimality probability in [0, 1] from the group advantage ``A`` (``advantage.std: global`` is the released
normaliser, ``A = (R - mean_group R) / (std_batch R + 1e-4)``):

    r = clamp(1/2 + (1/2) clip(A, -A_max, A_max) / A_max, 0, 1)            (optimality: advantage; A_max = 5)

that is the paper's ``r = 1/2 + 1/2 clip((R - E[R|c]) / Z_c, -1, 1)`` with ``Z_c = A_max std``. Each final sample is
re-noised at ``T = int(N * timestep_fraction)`` of the rollout grid's ``N`` noise levels (a random permutation per
sample, its first ``T``; fresh noise per level): ``x_s = (1 - s) x0 + s eps``. With the velocities of the trained
policy ``v``, of ``theta_old`` (``v_old``, no gradient) and of the reference (``v_ref``), the implicit positive and
negative policies are

    v+ = beta v + (1 - beta) v_old,        v- = (1 + beta) v_old - beta v,

so ``v+ - v_old = beta (v - v_old) = v_old - v-``: the negative policy mirrors the positive one about ``v_old``. Their
x0-space errors ``e+- = x_s - s v+- - x0`` are weighted adaptively, ``L+- = ||e+-||^2_m / sg(max(mean|e+-|, 1e-5))``,
and

    loss = (A_max / beta) mean_b [ r L+ + (1 - r) L- ] + kl_beta mean_b ||v - v_ref||^2_m.

At ``v = v_old`` both errors are ``e = s (u - v_old)`` with the same weight ``w``, and the gradient of the first term
per element is ``2 A_max s^2 (2 r - 1) (v - u) / (w D)`` (``D`` latent elements): ``beta`` cancels, ``r = 1/2`` gives
none, ``r > 1/2`` a flow-matching pull toward ``u = eps - x0``, ``r < 1/2`` a push away.

After every iteration ``theta_old <- eta theta_old + (1 - eta) theta`` with ``eta = 0`` for ``k < delay`` and
``min(rate (k - delay), max)`` after (``k`` the optimizer steps so far): the released ``decay_type 1`` is
``(delay, rate, max) = (0, 0.001, 0.5)`` (the default), ``decay_type 2`` (OCR) ``(75, 0.0075, 0.999)``, ``decay_type
0`` ``rate = 0`` (``theta_old = theta`` at the start of every iteration).

Options beyond the released defaults: ``adv_mode`` (the released ``positive_only``, ``negative_only``, ``one_only``,
``binary``); ``optimality: reward`` takes ``r = R`` itself for rewards already in [0, 1] (checked before any model
loads); ``timesteps: uniform`` draws ``s ~ U(0, 1)`` instead of the grid's levels (whether the paper trains on the grid
is not confirmed); ``adaptive_weighting: false`` drops the x0-space weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from flowalign.components import PolicyCopy
from flowalign.objectives.base import DataUnit, ObjectiveContext, PolicyOutput, register_objective
from flowalign.objectives.forward import ForwardObjective, ForwardObjectiveConfig, forward_generator, latent_mse, noised
from flowalign.settings import check, finite, option

__all__ = ["ADV_MODES", "DiffusionNFT", "DiffusionNFTConfig", "nft_decay", "nft_loss", "optimality"]

ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
OLD = "old"


def optimality(advantages: Tensor, *, adv_clip_max: float = 5.0, mode: str = "all") -> Tensor:
    """``r = clamp(1/2 + (1/2) a / A_max, 0, 1)`` with ``a = clip(A, -A_max, A_max)`` transformed by ``mode``
    (the released ``adv_mode``): ``positive_only`` keeps ``a >= 0``, ``negative_only`` ``a <= 0``, ``one_only`` is
    ``1[a > 0]`` and ``binary`` ``sign(a)``."""
    if mode not in ADV_MODES:
        raise ValueError(f"mode must be one of {', '.join(ADV_MODES)}, got {mode!r}")
    a = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    if mode == "positive_only":
        a = a.clamp(0, adv_clip_max)
    elif mode == "negative_only":
        a = a.clamp(-adv_clip_max, 0)
    elif mode == "one_only":
        a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    elif mode == "binary":
        a = torch.sign(a)
    return ((a / adv_clip_max) / 2.0 + 0.5).clamp(0, 1)


def nft_decay(steps: int, *, delay: int = 0, rate: float = 0.001, maximum: float = 0.5) -> float:
    """The released ``return_decay``: 0 before ``delay`` optimizer steps, then ``min(rate (k - delay), maximum)``."""
    return 0.0 if steps < delay else min((steps - delay) * rate, maximum)


def nft_loss(v: Tensor, v_old: Tensor, x: Tensor, x0: Tensor, sigma: Tensor, r: Tensor, *, beta: float,
             adv_clip_max: float = 5.0, adaptive: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's policy loss per sample ``[B]`` (module docstring) and its parts: ``(A_max / beta) (r L+ +
    (1 - r) L-)``. ``v`` carries the gradient; ``v_old`` is detached here."""
    v_old = v_old.detach()
    s = sigma.view(-1, *([1] * (x.ndim - 1))).to(v.dtype)
    positive = beta * v + (1 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v
    losses = {}
    for name, prediction in (("positive", positive), ("negative", negative)):
        error = x - s * prediction - x0
        if adaptive:
            with torch.no_grad():
                weight = error.double().abs().flatten(1).mean(dim=1).clamp_min(1e-5)
        else:
            weight = torch.ones(len(error), dtype=torch.float64, device=error.device)
        losses[name] = (error.pow(2).flatten(1).double() / weight[:, None]).mean(dim=1)
    r = r.to(losses["positive"].dtype)
    per_sample = (r * losses["positive"] / beta + (1.0 - r) * losses["negative"] / beta) * adv_clip_max
    return per_sample, losses


@dataclass
class DiffusionNFTConfig(ForwardObjectiveConfig):
    beta: float = option(1.0, "mix of the implicit policies, v+ = beta v + (1 - beta) v_old (released: 1.0; OCR and "
                              "multi-reward 0.1): the trust region, not the step size")
    kl_beta: float = option(1e-4, "weight of the velocity KL to the reference, mean ||v - v_ref||^2 (released "
                                  "train.beta 1e-4; 0 = none, no reference pass)")
    adv_clip_max: float = option(5.0, "A_max: advantages are clipped to +-A_max and r = 1/2 + A / (2 A_max)")
    adv_mode: Literal["all", "positive_only", "negative_only", "one_only", "binary"] = option(
        "all", "the released adv_mode: all, positive_only / negative_only (clip the other sign to 0), one_only "
               "(1[A > 0]), binary (sign A)")
    optimality: Literal["advantage", "reward"] = option(
        "advantage", "r from the group advantage (the released normaliser), or r = the combined reward itself, for "
                     "rewards in [0, 1] (checked against the rewards' declared ranges)")
    timestep_fraction: float = option(0.99, "trained noise levels per sample: int(sampling.num_steps * fraction) of "
                                            "the rollout grid's (released 0.99: 9 of 10)")
    timesteps: Literal["grid", "uniform"] = option(
        "grid", "grid = a random permutation of the rollout's noise levels per sample (released), uniform = s ~ U(0, 1)")
    adaptive_weighting: bool = option(True, "divide each x0-space error by its detached mean absolute value (released)")
    batch_size: int | None = option(None, "samples per unit (one forward per trained level); null = the rollout's "
                                          "chunk, sampling.batch_size or all of a process's samples")
    sample_with_old: bool = option(True, "roll out with theta_old (released); false = with the trained weights")
    old_decay_rate: float = option(0.001, "theta_old's decay grows by this per optimizer step (released decay_type 1: "
                                          "0.001; decay_type 2: 0.0075; 0 = theta_old is theta at every iteration)")
    old_decay_max: float = option(0.5, "the most theta_old's decay reaches (decay_type 1: 0.5; decay_type 2: 0.999)")
    old_decay_delay: int = option(0, "optimizer steps with decay 0 before it grows (decay_type 2: 75)")

    def validate(self) -> None:
        super().validate()
        finite("beta", self.beta, 0.0, strict=True)
        finite("kl_beta", self.kl_beta, 0.0)
        finite("adv_clip_max", self.adv_clip_max, 0.0, strict=True)
        check(self.adv_mode in ADV_MODES, "adv_mode", f"must be one of {', '.join(ADV_MODES)}, got {self.adv_mode!r}")
        check(self.optimality in ("advantage", "reward"), "optimality",
              f"must be 'advantage' or 'reward', got {self.optimality!r}")
        finite("timestep_fraction", self.timestep_fraction, 0.0, strict=True, high=1.0)
        check(self.timesteps in ("grid", "uniform"), "timesteps", f"must be 'grid' or 'uniform', got {self.timesteps!r}")
        if self.batch_size is not None:
            check(isinstance(self.batch_size, int) and self.batch_size >= 1, "batch_size",
                  f"must be an integer >= 1 or null, got {self.batch_size!r}")
        finite("old_decay_rate", self.old_decay_rate, 0.0)
        finite("old_decay_max", self.old_decay_max, 0.0, high=1.0)
        check(isinstance(self.old_decay_delay, int) and self.old_decay_delay >= 0, "old_decay_delay",
              f"must be an integer >= 0, got {self.old_decay_delay!r}")


@register_objective("diffusion_nft", config=DiffusionNFTConfig)
class DiffusionNFT(ForwardObjective):
    """DiffusionNFT: flow matching on the rollout's final samples toward an implicit positive policy weighted by the
    optimality probability r, and away through an implicit negative one weighted by 1 - r (module docstring)."""

    config: DiffusionNFTConfig
    sampling_setting = "sample_with_old"

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_beta > 0

    def policy_copies(self) -> list[PolicyCopy]:
        cfg = self.config
        return [PolicyCopy(OLD, lambda k: nft_decay(k, delay=cfg.old_decay_delay, rate=cfg.old_decay_rate,
                                                    maximum=cfg.old_decay_max),
                           "DiffusionNFT's old policy theta_old")]

    def sampling_policy(self) -> str | None:
        return OLD if self.config.sample_with_old else None

    def slots(self, config) -> int:
        return int(config.sampling.num_steps * self.config.timestep_fraction)

    def samples_per_unit(self, config) -> int | None:
        return self.config.batch_size

    def check(self, config) -> None:
        super().check(config)
        if self.config.optimality == "reward":
            check_rewards_in_unit_interval(config, self.key("optimality"))

    # --- the units ----------------------------------------------------------------------------------------------
    def draws(self, context: ObjectiveContext, sample_id: int, grid: Tensor, shape: tuple[int, ...]):
        """Sample ``sample_id``'s ``T`` noise levels and noise ``[T, ...]`` (keyed by the sample)."""
        g = forward_generator(context.seed, context.iteration, sample_id, "nft")
        count = self.slots(context.config)
        if self.config.timesteps == "grid":
            sigma = grid[torch.randperm(len(grid), generator=g)[:count]]
        else:
            sigma = torch.rand(count, generator=g, dtype=torch.float32)
        return sigma.float(), torch.randn((count, *shape), generator=g, dtype=torch.float32)

    def r(self, rollout) -> Tensor:
        cfg = self.config
        if cfg.optimality == "reward":
            rewards = rollout.rewards.float()
            return torch.where(rollout.valid & torch.isfinite(rewards), rewards.clamp(0, 1), torch.full_like(rewards, 0.5))
        return optimality(rollout.advantages, adv_clip_max=cfg.adv_clip_max, mode=cfg.adv_mode)

    @torch.no_grad()
    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        rollout = self.rollout_of(context)
        device = context.device if context.device is not None else rollout.x0.device
        x0 = rollout.x0.float()
        grid = rollout.sigmas[:-1].float()
        draws = [self.draws(context, int(j), grid, tuple(x0.shape[1:])) for j in rollout.sample_ids]
        sigmas = torch.stack([d[0] for d in draws])  # [n, T]
        noise = torch.stack([d[1] for d in draws])  # [n, T, ...]
        r = self.r(rollout).cpu()
        size = self.config.batch_size or self.default_unit_size(context.config, rollout)
        units = []
        for slot in range(sigmas.shape[1]):
            for rows in self.chunks(len(rollout), size):
                index = torch.tensor(list(rows))
                sigma, eps, clean = sigmas[index, slot].to(device), noise[index, slot].to(device), x0[index].to(device)
                units.append(DataUnit(x=noised(clean, sigma, eps), sigma=sigma, cond=rollout.cond_of(index),
                                      data={"x0": clean, "r": r[index].to(device), "slot": slot}))
        return units

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        v, v_old = policy.v.float(), policy.v_copies[OLD].float()
        per_sample, parts = nft_loss(v, v_old, unit.x.float(), unit.data["x0"], unit.sigma, unit.data["r"],
                                     beta=cfg.beta, adv_clip_max=cfg.adv_clip_max, adaptive=cfg.adaptive_weighting)
        policy_loss = per_sample.mean()
        loss = policy_loss
        stats = {"policy_loss": float(policy_loss.detach()), "positive_loss": float(parts["positive"].detach().mean()),
                 "negative_loss": float(parts["negative"].detach().mean()), "r_mean": float(unit.data["r"].mean()),
                 "old_deviate": float(latent_mse(v.detach(), v_old).mean())}
        if cfg.kl_beta > 0:
            kl = latent_mse(v, policy.v_ref.float()).mean()
            loss = loss + cfg.kl_beta * kl
            stats["kl"] = float(kl.detach())
        loss = cfg.weight * loss
        stats["loss"] = float(loss.detach())
        return loss, stats


def check_rewards_in_unit_interval(config, key: str) -> None:
    """Every reward declares scores in [0, 1], with weights >= 0 summing to at most 1, combined before any
    normalisation: the combined reward is then a probability (``ConfigError`` naming ``key`` otherwise)."""
    from flowalign.rewards import score_range

    fix = (f"set {key}=advantage (r from the group-normalised advantage, the released normaliser), or use rewards "
           "that declare scores in [0, 1] (toy_geneval, geneval, brightness)")
    for i, spec in enumerate(config.reward.rewards):
        bounds = score_range(spec.name)
        check(bounds is not None and 0.0 <= bounds[0] and bounds[1] <= 1.0, key,
              f"= 'reward' reads the combined reward as a probability in [0, 1], but reward.rewards[{i}] = "
              f"{spec.name!r} declares no scores in [0, 1] (it is unbounded or its range is unknown) and nothing "
              f"normalises it: {fix}")
        check(spec.weight >= 0, key, f"= 'reward' needs reward weights >= 0, reward.rewards[{i}].weight = "
                                     f"{spec.weight:g}: {fix}")
    total = sum(spec.weight for spec in config.reward.rewards)
    check(total <= 1.0 + 1e-9, key, f"= 'reward' needs the reward weights to sum to at most 1 (the weighted sum "
                                    f"stays in [0, 1]), they sum to {total:g}: {fix}")
    check(config.reward.combine == "sum_then_normalize", key,
          f"= 'reward' reads the raw combined reward, but reward.combine = {config.reward.combine!r} normalises each "
          f"reward first: set reward.combine=sum_then_normalize, or {fix}")

