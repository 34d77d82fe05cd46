"""Online Diffusion-DPO for flow models, as Flow-GRPO's "add dpo/sft" commit computes it (yifan123/flow_grpo
``scripts/train_sd3_dpo.py``, ``config/dpo.py``, ``flow_grpo/stat_tracking.py`` ``type='dpo'``), after Wallace et al.
2023, "Diffusion Model Alignment Using Direct Preference Optimization" (arXiv 2311.12908).

Each prompt's group of rollouts gives preference pairs: the best sample against the worst (``pairs: best_worst``,
released), or the i-th best against the i-th worst for ``i < K/2`` (``ranked``: every sample in at most one pair). For
each of ``D = int(N timestep_fraction)`` draws (``N`` rollout steps; released 39 of 40) every pair shares one noise
level and one noise: ``z ~ logit-normal(logit_mean, logit_std)``, ``s`` the entry ``floor(1000 z)`` of the 1000-step
training table at ``table_shift`` (SD3: 3), ``x_s = (1 - s) x0 + s eps`` for the winner ``w`` and the loser ``l``.
With ``e(v, x0) = ||v(x_s, s) - (eps - x0)||^2_m`` (conditional, no CFG):

    D_theta = e_theta(w) - e_theta(l),   D_ref = e_ref(w) - e_ref(l),
    loss    = -log sigmoid(-(beta / 2) (D_theta - D_ref)),        beta = 100 (released),

Wallace et al.'s loss with the velocity error in place of the noise error (``x0_hat - x0 = s (u - v)``: velocity MSE
is x0-space MSE weighted ``1/s^2``, which sets ``beta``'s scale). At ``theta = ref`` it is ``log 2``. The implicit
accuracy ``1[-(beta/2)(D_theta - D_ref) > 0]`` is logged.

The reference: ``ref_update_steps: null`` keeps the base model (the LoRA off: "DPO"); a number ``n`` makes it a policy
copy taken from the learner at the end of every iteration whose optimizer-step count is a multiple of ``n``
("OnlineDPO", released about 40). The rollouts sample with the reference (``sample_with_reference``, released), so they
lag the learner by up to ``n`` steps.

Ties. The released code pairs ``argmax`` against ``argmin`` (first occurrence) and trains a group whose rewards are
all equal as a preference of sample 1 over sample 0. flowalign skips ties by default (``ties: skip``: a tied or invalid
pair weighs 0 in its unit's mean; ``tie_frac`` is logged); ``ties: train`` is the released behaviour. Each group's
pairs are made within the group whatever the batching (the released reshape needs one batch per epoch), so every
process holds whole groups (``samples_per_unit``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from flowalign.components import REFERENCE_POLICY, PolicyCopy
from flowalign.objectives.base import DataUnit, ObjectiveContext, PolicyOutput, register_objective
from flowalign.objectives.forward import ForwardObjective, ForwardObjectiveConfig, forward_generator, latent_mse, noised
from flowalign.objectives.soar_math import training_table
from flowalign.settings import check, finite, option

__all__ = ["DPO", "DPOConfig", "dpo_loss", "dpo_pairs", "dpo_sigmas"]

REF = "ref"


def dpo_pairs(rewards: Tensor, valid: Tensor | None = None, *, pairs: str = "best_worst",
              ties: str = "skip") -> tuple[Tensor, Tensor, Tensor]:
    """The preference pairs of one group's rewards ``[K]``: ``(winners, losers, trained)`` indices into the group and
    a bool per pair. ``best_worst``: one pair, ``argmax`` against ``argmin`` (first occurrence, as released);
    ``ranked``: ``K // 2`` pairs, the i-th best against the i-th worst. Invalid samples are ranked below every valid
    one and never win. A pair is trained unless it is a tie (equal rewards, or an invalid member) with ``ties: skip``;
    with ``ties: train`` a best_worst group whose rewards are all equal pairs sample 1 over sample 0 (released)."""
    rewards = rewards.double()
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid & torch.isfinite(rewards)
    if len(rewards) < 2:
        raise ValueError(f"a group needs at least 2 samples to make a pair, got {len(rewards)}")
    if pairs == "best_worst":
        ranked = torch.where(valid, rewards, torch.full_like(rewards, -torch.inf))
        best = int(torch.argmax(ranked))
        worst = int(torch.argmin(torch.where(valid, rewards, torch.full_like(rewards, torch.inf))))
        if not valid.any():
            best, worst = 1, 0
        if best == worst:  # all valid rewards equal (or a single valid sample): the released tie-break
            best, worst = (1, 0) if ties == "train" else (best, (best + 1) % len(rewards))
        winners, losers = torch.tensor([best]), torch.tensor([worst])
    elif pairs == "ranked":
        order = sorted(range(len(rewards)), key=lambda i: (not bool(valid[i]), -float(rewards[i]) if valid[i] else 0, i))
        half = len(rewards) // 2
        winners, losers = torch.tensor(order[:half]), torch.tensor(order[::-1][:half])
    else:
        raise ValueError(f"pairs must be 'best_worst' or 'ranked', got {pairs!r}")
    strict = valid[winners] & valid[losers] & (rewards[winners] > rewards[losers])
    trained = torch.ones_like(strict) if ties == "train" else strict
    return winners, losers, trained


def dpo_loss(error_w: Tensor, error_l: Tensor, ref_w: Tensor, ref_l: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per pair ``-log sigmoid(-(beta / 2)((e_w - ref_w) - (e_l - ref_l)))`` and its argument (``inside``)."""
    inside = -0.5 * beta * ((error_w - ref_w) - (error_l - ref_l))
    return -F.logsigmoid(inside), inside


def dpo_sigmas(normal: Tensor, *, logit_mean: float = 0.0, logit_std: float = 1.0, shift: float = 3.0) -> Tensor:
    """The training-table noise levels of standard normals: entry ``floor(1000 sigmoid(m + s n))``."""
    sigmas, _ = training_table(shift)
    index = (torch.sigmoid(logit_mean + logit_std * normal.float()) * len(sigmas)).long().clamp(0, len(sigmas) - 1)
    return sigmas[index]


@dataclass
class DPOConfig(ForwardObjectiveConfig):
    beta: float = option(100.0, "beta_dpo of the logistic loss on velocity errors (released 100)")
    pairs: Literal["best_worst", "ranked"] = option(
        "best_worst", "pairs per group: best_worst = the best against the worst (released), ranked = the i-th best "
                      "against the i-th worst, K // 2 pairs")
    ties: Literal["skip", "train"] = option(
        "skip", "a pair of equal (or invalid) rewards: skip = weight 0 (logged as tie_frac), train = trained as a "
                "preference (released: a group of equal rewards pairs sample 1 over sample 0)")
    timestep_fraction: float = option(0.99, "draws per pair and iteration: int(sampling.num_steps * fraction) "
                                            "(released 39 of 40)")
    logit_mean: float = option(0.0, "mean of the logit-normal density of the noise level's table time")
    logit_std: float = option(1.0, "standard deviation of the logit-normal density")
    table_shift: float = option(3.0, "shift of the 1000-entry training table (SD3's scheduler: 3)")
    ref_update_steps: int | None = option(
        None, "null = the frozen base model as the reference (DPO); n = copy the learner into the reference at the end "
              "of every iteration whose optimizer-step count is a multiple of n (OnlineDPO, released about 40)")
    sample_with_reference: bool = option(True, "roll out with the reference (released); false = with the learner")
    groups_per_unit: int = option(1, "groups (of data.group_size samples) whose pairs make one unit")

    def validate(self) -> None:
        super().validate()
        finite("beta", self.beta, 0.0, strict=True)
        check(self.pairs in ("best_worst", "ranked"), "pairs", f"must be 'best_worst' or 'ranked', got {self.pairs!r}")
        check(self.ties in ("skip", "train"), "ties", f"must be 'skip' or 'train', got {self.ties!r}")
        finite("timestep_fraction", self.timestep_fraction, 0.0, strict=True, high=1.0)
        finite("logit_mean", self.logit_mean, -float("inf"))
        finite("logit_std", self.logit_std, 0.0, strict=True)
        finite("table_shift", self.table_shift, 0.0, strict=True)
        if self.ref_update_steps is not None:
            check(isinstance(self.ref_update_steps, int) and self.ref_update_steps >= 1, "ref_update_steps",
                  f"must be an integer >= 1 or null (the frozen base model), got {self.ref_update_steps!r}")
        check(isinstance(self.groups_per_unit, int) and self.groups_per_unit >= 1, "groups_per_unit",
              f"must be an integer >= 1, got {self.groups_per_unit!r}")


@register_objective("dpo", config=DPOConfig)
class DPO(ForwardObjective):
    """Online Diffusion-DPO on each group's best and worst samples (module docstring)."""

    config: DPOConfig
    sampling_setting = "sample_with_reference"
    unit_setting = "groups_per_unit"

    @property
    def online(self) -> bool:
        return self.config.ref_update_steps is not None

    @property
    def needs_reference(self) -> bool:
        return not self.online

    def policy_copies(self) -> list[PolicyCopy]:
        if not self.online:
            return []
        every = self.config.ref_update_steps
        return [PolicyCopy(REF, lambda k: 0.0 if k > 0 and k % every == 0 else 1.0, "online DPO's reference")]

    def sampling_policy(self) -> str | None:
        if not self.config.sample_with_reference:
            return None
        return REF if self.online else REFERENCE_POLICY

    def slots(self, config) -> int:
        return int(config.sampling.num_steps * self.config.timestep_fraction)

    def pairs_per_group(self, group_size: int) -> int:
        return 1 if self.config.pairs == "best_worst" else group_size // 2

    def samples_per_unit(self, config) -> int:
        return self.config.groups_per_unit * config.data.group_size

    def check(self, config) -> None:
        super().check(config)
        check(config.data.group_size >= 2, "data.group_size",
              f"= {config.data.group_size}: objectives.{self.name} pairs samples within a group, which needs >= 2")
        if self.online:
            per_iteration = config.optim.minibatches * config.optim.inner_epochs
            check(self.config.ref_update_steps % per_iteration == 0, self.key("ref_update_steps"),
                  f"= {self.config.ref_update_steps} is not a multiple of the {per_iteration} optimizer steps of an "
                  "iteration (optim.minibatches * optim.inner_epochs): the reference is copied at the end of an "
                  "iteration, so the count must land on its multiples")

    # --- the units ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def units(self, iteration: int, context: ObjectiveContext) -> list[DataUnit]:
        cfg, rollout = self.config, self.rollout_of(context)
        device = context.device if context.device is not None else rollout.x0.device
        group_size = context.config.data.group_size
        x0, draws = rollout.x0.float(), self.slots(context.config)
        per_group = self.pairs_per_group(group_size)
        groups = []  # per local group: (winners, losers, trained) as local rows, and its keyed draws
        for start in range(0, len(rollout), group_size):
            rows = torch.arange(start, start + group_size)
            group = int(rollout.group_ids[start])
            if not bool((rollout.group_ids[rows] == group).all()):
                raise ValueError(f"objectives.{self.name}: the samples of group {group} are not together on this "
                                 "process (every process must hold whole groups)")
            winners, losers, trained = dpo_pairs(rollout.rewards[rows], rollout.valid[rows], pairs=cfg.pairs,
                                                 ties=cfg.ties)
            g = forward_generator(context.seed, iteration, group, "dpo_group")
            normal = torch.randn((draws, per_group), generator=g, dtype=torch.float32)
            noise = torch.randn((draws, per_group, *x0.shape[1:]), generator=g, dtype=torch.float32)
            sigma = dpo_sigmas(normal, logit_mean=cfg.logit_mean, logit_std=cfg.logit_std, shift=cfg.table_shift)
            groups.append((rows[winners], rows[losers], trained, sigma, noise))
        units = []
        for draw in range(draws):
            for first in range(0, len(groups), cfg.groups_per_unit):
                chunk = groups[first:first + cfg.groups_per_unit]
                w = torch.cat([c[0] for c in chunk])
                l = torch.cat([c[1] for c in chunk])
                trained = torch.cat([c[2] for c in chunk]).float().to(device)
                sigma = torch.cat([c[3][draw] for c in chunk]).to(device)
                eps = torch.cat([c[4][draw] for c in chunk]).to(device)
                clean = torch.cat([x0[w], x0[l]]).to(device)
                eps2, sigma2 = torch.cat([eps, eps]), torch.cat([sigma, sigma])
                units.append(DataUnit(x=noised(clean, sigma2, eps2), sigma=sigma2, cond=rollout.cond_of(torch.cat([w, l])),
                                      data={"target": eps2 - clean, "trained": trained, "slot": draw}))
        return units

    def loss(self, unit: DataUnit, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        cfg = self.config
        reference = policy.v_copies[REF] if self.online else policy.v_ref
        target = unit.data["target"].float()
        error = latent_mse(policy.v.float(), target)
        with torch.no_grad():
            ref_error = latent_mse(reference.float(), target)
        pairs = len(error) // 2
        per_pair, inside = dpo_loss(error[:pairs], error[pairs:], ref_error[:pairs], ref_error[pairs:], cfg.beta)
        trained = unit.data["trained"]
        value = (trained * per_pair).sum() / pairs
        loss = cfg.weight * value
        count = float(trained.sum())
        correct = float(((inside.detach() > 0).float() * trained).sum())
        stats = {"loss": float(loss.detach()), "dpo_loss": float(value.detach()),
                 "implicit_acc": correct / count if count else 0.0, "tie_frac": 1.0 - count / pairs,
                 "winner_error": float(error[:pairs].detach().mean()), "loser_error": float(error[pairs:].detach().mean()),
                 "inside": float(inside.detach().mean())}
        return loss, stats
