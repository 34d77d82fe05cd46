"""AWM, Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050), as its released training script computes it
(scxue/advantage_weighted_matching ``scripts/train_sd3_awm.py``: ``compute_log_prob_awm`` and the training loop;
``config/dgx_awm.py``).

The policy gradient of DDPO / Flow-GRPO with the per-step Gaussian likelihood replaced by the pretraining
flow-matching loss on clean samples, weighted per sample by its advantage. For a rollout sample with final latent
``x0`` and advantage ``A`` (``advantage.std: global``), clipped and rescaled ``a = clip(A, -5, 5) / 5 * advantage_max``:

1. ``T = train_sigmas`` noise levels, stratified over the rollout grid's indices: boundaries
   ``floor(linspace(1, floor(N timestep_fraction), T + 1))`` (``N`` rollout steps), one index drawn in each stratum per
   unit (shared by its samples: the released micro-batch), ``s = s_index``; ``s = 1`` and the last steps are never
   trained. Fresh ``eps`` per (sample, level); ``x_s = (1 - s) x0 + s eps``, ``u = eps - x0``.
2. ``l = ||v(x_s, s) - u||^2_m`` in float64 and the surrogate log-likelihood ``g`` (``weighting``): ``uniform`` ``-l``,
   ``t`` ``-s l``, ``t2`` ``-s^2 l``, ``huber`` ``-s (sqrt(l + 1e-10) - 1e-5)``, ``ghuber`` (released)
   ``-(s / p) ((l + 1e-10)^p - 1e-10^p)`` with ``p = ghuber_power`` (0.25).
3. The ratio ``rho = exp(g - sg(g))`` is exactly 1 (the released run takes the "old" value as the detached current one:
   all micro-batches of an epoch form one optimizer step), so the PPO-clipped term
   ``max(-a rho, -a clip(rho, 1 - clip_range, 1 + clip_range))`` is worth ``-a`` and its gradient is
   ``-a grad g``: ``a s l^(p - 1) grad l`` for ``ghuber``, advantage-weighted flow matching with large errors
   down-weighted.
4. ``loss = mean(policy) + kl_beta mean ||v - v_ref||^2_m + ema_kl_beta mean ||v - v_ema||^2_m`` (``elbo`` weighting
   divides a KL by ``2 std^2``, ``std = 0.7 sqrt(s / (1 - min(s, 0.99)))``), where ``v_ema`` is a policy copy moved
   after every iteration by ``theta_ema <- d theta_ema + (1 - d) theta``, ``d = min(ema_kl_decay_max, 0.001 k)`` (``k``
   optimizer steps): a near copy of the previous policy, a trust region.

Where flowalign departs: the released script adds the EMA-KL only when ``kl_beta > 0`` (``ema_kl_beta`` alone does
nothing there); here each term is on when its own beta is. Its rollouts use SA-Solver (14 steps, stochastic between
s = 0.3 and 0.9); flowalign has none, so any of its samplers stands in (an Euler ODE by default, an SDE window for
stochasticity). ``loss_type`` ``sum_first`` (the ratio of the t-mean) is not offered: on-policy its value and gradient
equal ``exp_first``'s. The rollouts use the trained weights (no sampling policy).
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

__all__ = ["AWM", "AWMConfig", "WEIGHTINGS", "awm_log_likelihood", "awm_policy_loss", "awm_strata", "elbo_std"]

WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
EMA = "kl_ema"


def awm_log_likelihood(l: Tensor, sigma: Tensor, weighting: str = "ghuber", power: float = 0.25) -> Tensor:
    """The surrogate log-likelihood ``g`` of a flow-matching error ``l`` at noise level ``sigma`` (module docstring),
    in float64."""
    l, s = l.double(), sigma.double().to(l.device)
    if weighting == "uniform":
        return -l
    if weighting == "t":
        return -l * s
    if weighting == "t2":
        return -l * s**2
    if weighting == "huber":
        return -(torch.sqrt(l + 1e-10) - 1e-5) * s
    if weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=torch.float64, device=l.device)
        return -(torch.pow(l + 1e-10, power) - torch.pow(floor, power)) * s / power
    raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")


def awm_policy_loss(g: Tensor, advantages: Tensor, clip_range: float = 1.0) -> tuple[Tensor, Tensor]:
    """``mean(max(-a rho, -a clip(rho, 1 - eps, 1 + eps)))`` with ``rho = exp(g - sg(g))`` (exactly 1); returns the
    loss and ``rho``."""
    ratio = torch.exp(g - g.detach())
    advantages = advantages.to(ratio.dtype)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio


def awm_strata(num_steps: int, fraction: float, count: int) -> tuple[Tensor, Tensor]:
    """``(lower, upper)`` grid indices of the ``count`` strata (the released ``discrete_wo_init``): an index is
    ``lower + floor(u (upper - lower))``, ``u ~ U[0, 1)``."""
    boundaries = torch.linspace(1, int(num_steps * fraction), steps=count + 1).long()
    return boundaries[:-1], boundaries[1:]


def elbo_std(sigma: Tensor) -> Tensor:
    """The released KL's ``std_t = 0.7 sqrt(s / (1 - min(s, 0.99)))``."""
    return torch.sqrt(sigma / (1 - torch.clamp(sigma, 0, 0.99))) * 0.7


@dataclass
class AWMConfig(ForwardObjectiveConfig):
    train_sigmas: int = option(6, "noise levels trained per sample, one per stratum of the rollout grid (released 6)")
    timestep_fraction: float = option(0.9, "the strata span grid indices 1 .. floor(sampling.num_steps * fraction) "
                                           "(released 0.9)")
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = option(
        "ghuber", "surrogate log-likelihood of the flow-matching error l: uniform -l, t -s l, t2 -s^2 l, huber, ghuber "
                  "(released: generalised Huber, -(s/p)((l + 1e-10)^p - 1e-10^p))")
    ghuber_power: float = option(0.25, "p of the ghuber weighting (released 0.25)")
    clip_range: float = option(1.0, "PPO clip range of the ratio (released 1; the ratio is exactly 1)")
    adv_clip_max: float = option(5.0, "advantages are clipped to +-this, then divided by it")
    advantage_max: float = option(1.0, "and multiplied by this (released advantage_max 1: |a| <= 1)")
    kl_beta: float = option(1e-3, "weight of the velocity KL to the reference (released GenEval 0.001, OCR 0.003, "
                                  "PickScore 1e-4); 0 = none")
    kl_weighting: Literal["uniform", "elbo"] = option("uniform", "KL weighting: uniform or elbo (/ 2 std_t^2)")
    ema_kl_beta: float = option(1.0, "weight of the velocity KL to the lagging copy theta_ema, the trust region "
                                     "(released 1); 0 = none, no copy kept")
    ema_kl_weighting: Literal["uniform", "elbo"] = option("uniform", "the EMA-KL's weighting: uniform or elbo")
    ema_kl_decay: Literal["linear", "constant"] = option(
        "linear", "theta_ema's decay: linear = min(ema_kl_decay_max, 0.001 k) after k optimizer steps (released), "
                  "constant = ema_kl_decay_max")
    ema_kl_decay_max: float = option(0.3, "the most theta_ema's decay reaches (released 0.3)")
    batch_size: int = option(4, "samples per unit: each unit is one noise level of this many samples, which share "
                                "its grid index (released micro-batch: 3 samples)")

    def validate(self) -> None:
        super().validate()
        for key in ("train_sigmas", "batch_size"):
            value = getattr(self, key)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                  f"must be an integer >= 1, got {value!r}")
        finite("timestep_fraction", self.timestep_fraction, 0.0, strict=True)
        check(self.timestep_fraction < 1.0, "timestep_fraction",
              f"must be < 1 (the strata end before the last step), got {self.timestep_fraction:g}")
        check(self.weighting in WEIGHTINGS, "weighting", f"must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        finite("ghuber_power", self.ghuber_power, 0.0, strict=True)
        finite("clip_range", self.clip_range, 0.0, strict=True)
        finite("adv_clip_max", self.adv_clip_max, 0.0, strict=True)
        finite("advantage_max", self.advantage_max, 0.0, strict=True)
        finite("kl_beta", self.kl_beta, 0.0)
        finite("ema_kl_beta", self.ema_kl_beta, 0.0)
        for key in ("kl_weighting", "ema_kl_weighting"):
            check(getattr(self, key) in ("uniform", "elbo"), key,
                  f"must be 'uniform' or 'elbo', got {getattr(self, key)!r}")
        check(self.ema_kl_decay in ("linear", "constant"), "ema_kl_decay",
              f"must be 'linear' or 'constant', got {self.ema_kl_decay!r}")
        finite("ema_kl_decay_max", self.ema_kl_decay_max, 0.0, high=1.0)


@register_objective("awm", config=AWMConfig)
class AWM(ForwardObjective):
    """AWM: advantage-weighted flow matching on the rollout's final samples (module docstring)."""

    config: AWMConfig

    @property
    def needs_reference(self) -> bool:
        return self.config.kl_beta > 0

    def policy_copies(self) -> list[PolicyCopy]:
        cfg = self.config
        if cfg.ema_kl_beta <= 0:
            return []
        if cfg.ema_kl_decay == "constant":
            return [PolicyCopy(EMA, lambda k: cfg.ema_kl_decay_max, "AWM's trust-region EMA theta_ema")]
        return [PolicyCopy(EMA, lambda k: min(cfg.ema_kl_decay_max, 0.001 * k), "AWM's trust-region EMA theta_ema")]

    def slots(self, config) -> int:
        return self.config.train_sigmas

    def slots_setting(self) -> str:
        return "train_sigmas"

    def samples_per_unit(self, config) -> int:
        return self.config.batch_size

    def check(self, config) -> None:
        super().check(config)
        top = int(config.sampling.num_steps * self.config.timestep_fraction)
        check(top >= 1, self.key("timestep_fraction"),
              f"= {self.config.timestep_fraction:g} leaves no stratum at sampling.num_steps = "
              f"{config.sampling.num_steps}: floor(num_steps * fraction) must be >= 1")

    # --- the units ----------------------------------------------------------------------------------------------
    def advantages(self, rollout) -> Tensor:
        cfg = self.config
        return rollout.advantages.float().clamp(-cfg.adv_clip_max, cfg.adv_clip_max) / cfg.adv_clip_max \
            * cfg.advantage_max

    @torch.no_grad()
    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        cfg, rollout = self.config, self.rollout_of(context)
        device = context.device if context.device is not None else rollout.x0.device
        x0, count = rollout.x0.float(), cfg.train_sigmas
        lower, upper = awm_strata(context.config.sampling.num_steps, cfg.timestep_fraction, count)
        noise = torch.stack([torch.randn((count, *x0.shape[1:]), dtype=torch.float32,
                                         generator=forward_generator(context.seed, iteration, int(j), "awm_sample"))
                             for j in rollout.sample_ids])  # [n, T, ...]
        advantages = self.advantages(rollout).cpu()
        chunks = self.chunks(len(rollout), cfg.batch_size)
        indices = []  # per chunk: its T grid indices, keyed by its global unit number
        for rows in chunks:
            g = forward_generator(context.seed, iteration, int(rollout.sample_ids[rows[0]]) // cfg.batch_size,
                                  "awm_unit")
            indices.append(lower + (torch.rand(count, generator=g) * (upper - lower)).long())
        units = []
        for slot in range(count):
            for rows, index in zip(chunks, indices):
                local = torch.tensor(list(rows))
                sigma = rollout.sigmas[index[slot]].float().expand(len(local)).clone().to(device)
                eps, clean = noise[local, slot].to(device), x0[local].to(device)
                units.append(DataUnit(x=noised(clean, sigma, eps), sigma=sigma, cond=rollout.cond_of(local),
                                      data={"target": eps - clean, "advantages": advantages[local].to(device),
                                            "slot": slot, "index": int(index[slot])}))
        return units

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        v = policy.v.double()
        l = latent_mse(v, unit.data["target"].double())
        g = awm_log_likelihood(l, unit.sigma, cfg.weighting, cfg.ghuber_power)
        policy_loss, ratio = awm_policy_loss(g, unit.data["advantages"], cfg.clip_range)
        loss = policy_loss
        stats = {"policy_loss": float(policy_loss.detach()), "fm_loss": float(l.detach().mean()),
                 "ratio_mean": float(ratio.detach().mean()), "sigma_mean": float(unit.sigma.mean())}
        std = elbo_std(unit.sigma.double())
        for name, beta, weighting, other in (("kl", cfg.kl_beta, cfg.kl_weighting, policy.v_ref),
                                             ("ema_kl", cfg.ema_kl_beta, cfg.ema_kl_weighting,
                                              policy.v_copies.get(EMA))):
            if beta <= 0:
                continue
            term = latent_mse(v, other.double())
            if weighting == "elbo":
                term = term / (2 * std**2)
            term = term.mean()
            loss = loss + beta * term
            stats[name] = float(term.detach())
        loss = cfg.weight * loss
        stats["loss"] = float(loss.detach())
        return loss, stats
