"""Euphonium (Zhong et al. 2026, arXiv 2602.04928): process-reward-gradient-guided rollouts and dual-reward advantages.

Rollout. From ``start_step`` to the end (every ``interval``-th step), the SDE mean of step ``i`` is shifted by
``c G`` (``flowalign.samplers.euphonium.euphonium_guidance``), ``G`` the gradient of a process reward ``PRM`` at the state
``x_i``; the stored log-prob is taken under the unguided mean (``log_prob_under: unguided``, the released code's
only "internalisation": the policy gradient pulls the unguided policy toward the guided samples) or the guided one.
The PRM is one of two sources (exactly one is set):

* ``process_reward``: ``PRM(x_i) = r(decode(x0_hat_i))``, a differentiable image reward (e.g. ``toy_geneval_soft``)
  of the decoded one-step estimate ``x0_hat = x - s v``, and ``G`` its gradient on ``x0_hat`` with ``v`` held fixed
  (no transformer backward, no NFE: one decode and one reward call per sample and scored state);
* ``registers``: ``PRM(x_i) = S(x_i, s_i)``, the latent reward registers' score (heads summed) at the noisy state,
  read off a forward of the reference transformer (LoRA off: the one the registers were trained on), and
  ``G = d S / d x_i`` through that forward (``LatentRegisters.guide``, as RGS takes it): per sample, one forward
  (``evals_per_sample`` NFEs, 2 with CFG) per scored state plus one backward (as many NFEs) per guided state,
  counted in the credit's NFEs.

The PRM of every state the credit needs is recorded during the rollout (``RolloutGuidance``:
``Batch.extras["euphonium"]``).

Credit (``euphonium_advantages``). ORA is the group-normalised terminal reward, PRA the per-(group, step)
group-normalised process reward of each guided transition ``i``:

    credit = next       p_i = PRM(x_{i+1})               (the state the action produced; the default)
    credit = increment  p_i = PRM(x_{i+1}) - PRM(x_i)
    credit = released   p_i = PRM(x_i)                   (the public code: the state *before* the action)

    A = (r - mean_g r) / (std_g r + eps),  0 for a group whose std is below 1e-6,   each clipped to [-clip, clip]

and a transition's advantage is ``w_o ORA + w_p PRA_i`` (``mode: both``), ``ORA`` (``none``) or ``w_p PRA_i``
(``only``). The released loss is ``w_o PPO(ORA) + w_p PPO(PRA_i)``, two clipped terms on one ratio; while the ratio
is inside the clip range (always on an iteration's first step) that is exactly ``PPO(w_o ORA + w_p PRA_i)``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.credit.base import BatchScores, Credit, CreditContext, CreditEstimator, register_credit
from flowalign.advantages import ZERO_STD
from flowalign.rollout import RolloutGuidance
from flowalign.settings import at_least, check, finite, option

__all__ = ["CREDIT_MODES", "EuphoniumConfig", "EuphoniumCredit", "ProcessRewardGuidance", "RegisterGuidance",
           "euphonium_advantages", "group_step_normalize"]

CREDIT_MODES = ("next", "increment", "released")
LOSS_MODES = ("both", "none", "only")


def group_step_normalize(values: Tensor, group_ids: Tensor, *, eps: float = 1e-4, std_unbiased: bool = True) -> Tensor:
    """``(v - mean_g) / (std_g + eps)`` per group and column of ``values`` (``[B]`` or ``[B, T]``), float64.

    NaN entries are left out of their group's mean and std and get 0; a group whose std is below 1e-6 (identical
    values, or fewer than two entries; ``flowalign.advantages.ZERO_STD``) gets exactly 0, so identical rewards
    never turn into advantages by rounding."""
    v = values.double()
    squeeze = v.ndim == 1
    v = v[:, None] if squeeze else v
    out = torch.zeros_like(v)
    group_ids = torch.as_tensor(group_ids, device=v.device)
    for g in group_ids.unique():
        members = group_ids == g
        block = v[members]
        valid = torch.isfinite(block)
        count = valid.sum(dim=0).double()
        filled = torch.where(valid, block, torch.zeros_like(block))
        mean = filled.sum(dim=0) / count.clamp_min(1)
        centered = torch.where(valid, block - mean, torch.zeros_like(block))
        dof = (count - 1) if std_unbiased else count
        std = (centered.pow(2).sum(dim=0) / dof.clamp_min(1)).sqrt()
        keep = valid & ((std >= ZERO_STD) & (dof > 0))[None]
        out[members] = torch.where(keep, centered / (std + eps), torch.zeros_like(block))
    return out[:, 0] if squeeze else out


def euphonium_advantages(
    outcome_rewards: Tensor,
    process_rewards: Tensor,
    group_ids: Tensor,
    guided: Tensor,
    *,
    credit: str = "next",
    mode: str = "both",
    outcome_weight: float = 1.0,
    process_weight: float = 1.0,
    eps: float = 1e-4,
    std_unbiased: bool = True,
    clip: float = 5.0,
) -> dict[str, Tensor]:
    """Euphonium's dual-reward advantages for one batch of whole groups (module docstring for the formulas).

    ``outcome_rewards`` ``[B]`` (NaN: invalid, advantage 0), ``process_rewards`` ``[B, T + 1]`` the PRM of the states
    ``x_0 .. x_T`` (NaN where not scored; only those the credit reads must be finite), ``group_ids`` ``[B]``,
    ``guided`` ``[T]`` whether transition ``i`` was guided (PRA is 0 elsewhere). Returns float32 ``outcome`` (ORA,
    ``[B]``), ``process`` (PRA, ``[B, T]``) and ``advantages`` ``[B, T]``. The public code's numbers are
    ``credit="released", eps=1e-8`` except for its degenerate groups (it divides rounding noise by 1e-8: eight
    rewards of 0.7 in float32 give +0.8085 each; here they give 0)."""
    if credit not in CREDIT_MODES:
        raise ValueError(f"unknown credit {credit!r}: expected one of {', '.join(CREDIT_MODES)}")
    if mode not in LOSS_MODES:
        raise ValueError(f"unknown mode {mode!r}: expected one of {', '.join(LOSS_MODES)}")
    if process_rewards.ndim != 2 or process_rewards.shape[0] != outcome_rewards.shape[0]:
        raise ValueError(f"process_rewards must be [B={outcome_rewards.shape[0]}, T + 1], got "
                         f"{tuple(process_rewards.shape)}")
    steps = process_rewards.shape[1] - 1
    guided = torch.as_tensor(guided, dtype=torch.bool)
    if guided.shape != (steps,):
        raise ValueError(f"guided must have one entry per transition ({steps}), got shape {tuple(guided.shape)}")
    p = process_rewards.double()
    step_reward = {"next": p[:, 1:], "released": p[:, :-1], "increment": p[:, 1:] - p[:, :-1]}[credit]
    used = step_reward[:, guided]
    if not torch.isfinite(used).all():
        raise ValueError(f"credit {credit!r} reads a process reward that was not scored (NaN) on a guided transition")
    step_reward = torch.where(guided[None], step_reward, torch.zeros_like(step_reward))
    ora = group_step_normalize(outcome_rewards, group_ids, eps=eps, std_unbiased=std_unbiased).clamp(-clip, clip)
    pra = group_step_normalize(step_reward, group_ids, eps=eps, std_unbiased=std_unbiased).clamp(-clip, clip)
    if mode == "none":
        advantages = ora[:, None].expand(-1, steps)
    elif mode == "only":
        advantages = process_weight * pra
    else:
        advantages = outcome_weight * ora[:, None] + process_weight * pra
    return {"outcome": ora.float(), "process": pra.float(), "advantages": advantages.float().contiguous()}


@dataclass
class EuphoniumConfig(ComponentConfig):
    process_reward: str | None = option(
        "toy_geneval_soft", "the process reward: a differentiable image reward of the decoded one-step estimate "
        "x0_hat (its gradient on x0_hat, v held fixed, guides the SDE mean); null with registers")
    registers: str | None = option(
        None, "the process reward instead of process_reward (set that to null): a register checkpoint (`flowalign "
        "prep registers`) trained on this model, scoring the noisy states; its gradient through a reference "
        "forward guides the SDE mean")
    reward_kwargs: dict[str, Any] = option({}, "keyword arguments for the process reward's constructor")
    scale: float = option(0.01, "guidance scale c; < 0 means c = noise_level^2 / (2 kl_beta)")
    kl_beta: float | None = option(None, "the KL coefficient of c = noise_level^2 / (2 kl_beta) when scale < 0")
    normalize: bool = option(False, "divide the gradient by its norm (+1e-8) before scaling")
    norm: Literal["sample", "batch"] = option(
        "sample", "the norm of normalize: per sample, or over the whole chunk (the public code's, layout-dependent)")
    scale_by_dt: bool = option(True, "multiply c by the step's sigma - sigma_next")
    start_step: int = option(12, "the first guided step (0-based); guidance runs from there to the end")
    interval: int = option(1, "guide every interval-th step from start_step")
    log_prob_under: Literal["unguided", "guided"] = option(
        "unguided", "the mean the stored (and recomputed) log-prob is taken under: unguided (the public code's "
        "internalisation) or guided")
    credit: Literal["next", "increment", "released"] = option(
        "next", "the process reward crediting transition i: next = PRM(x_{i+1}), increment = PRM(x_{i+1}) - PRM(x_i), "
        "released = PRM(x_i) (the public code's, the state before the action)")
    mode: Literal["both", "none", "only"] = option(
        "both", "advantages: both = outcome_weight ORA + process_weight PRA, none = ORA only, only = PRA only")
    outcome_weight: float = option(1.0, "w_o: weight of the outcome advantage in mode both")
    process_weight: float = option(1.0, "w_p: weight of the process advantage in modes both and only")
    eps: float = option(1e-4, "added to the group std (the public code's 1e-8 turns rounding noise into advantages)")
    std_unbiased: bool = option(True, "group std with Bessel's correction, as the public code (torch.std)")
    clip: float = option(5.0, "each advantage (ORA, PRA) is clipped to [-clip, clip]")

    def validate(self) -> None:
        from flowalign.rewards import REWARDS, require_differentiable_reward

        finite("scale", self.scale, -math.inf)
        check(self.scale >= 0 or (self.kl_beta is not None and self.kl_beta > 0), "kl_beta",
              f"must be > 0 when scale < 0 (c = noise_level^2 / (2 kl_beta)), got {self.kl_beta}")
        at_least("start_step", self.start_step, 0)
        at_least("interval", self.interval, 1)
        finite("outcome_weight", self.outcome_weight, 0.0)
        finite("process_weight", self.process_weight, 0.0)
        finite("eps", self.eps, 0.0, strict=True)
        finite("clip", self.clip, 0.0, strict=True)
        check((self.registers is None) != (self.process_reward is None), "registers",
              "or process_reward: give Euphonium exactly one process reward, a register checkpoint (registers, with "
              "process_reward: null) or a differentiable image reward of x0_hat (process_reward)")
        check(not self.reward_kwargs or self.process_reward is not None, "reward_kwargs",
              "are the constructor arguments of process_reward: set process_reward, or drop them")
        if self.process_reward is None:
            return
        close = REWARDS.closest(self.process_reward)
        check(self.process_reward in REWARDS, "process_reward", f"= {self.process_reward!r} is not a registered "
              f"reward; known: {', '.join(REWARDS.names())}" + (f"; did you mean {close!r}?" if close else ""))
        try:  # on the registered class: nothing is built, no weights load
            require_differentiable_reward(self.process_reward, "process_reward")
        except ValueError as error:
            check(False, "process_reward", f"{str(error).split(' ', 1)[1]}; Euphonium's guidance needs its gradient "
                  "(e.g. process_reward: toy_geneval_soft on the toy world)")


class ProcessRewardGuidance(RolloutGuidance):
    """Euphonium's guidance of a chain rollout: ``c G`` on the guided steps, the PRM of the states the credit reads,
    here from a differentiable image reward of the decoded ``x0_hat`` (``RegisterGuidance``: from registers).

    Records ``{"process": [B, T + 1] float64 (NaN where not scored), "decodes": n, "shift_norm": sum of ||c G||}``
    (``RegisterGuidance`` adds its forward and backward NFEs)."""

    name = "euphonium"

    def __init__(self, config: EuphoniumConfig, reward, model):
        self.config, self.reward, self.model = config, reward, model
        self.log_prob_under = config.log_prob_under

    def guided_steps(self, levels: Tensor) -> Tensor:
        """``[T]``: step ``i`` is guided when it is stochastic, ``i >= start_step`` and on the interval."""
        steps = torch.arange(len(levels))
        on = (steps >= self.config.start_step) & ((steps - self.config.start_step) % self.config.interval == 0)
        return on & (torch.as_tensor(levels) > 0)

    def scored_states(self, guided: Tensor) -> Tensor:
        """``[T + 1]``: the states whose PRM the credit reads (and the guided ones, whose gradient is taken)."""
        scored = torch.zeros(len(guided) + 1, dtype=torch.bool)
        scored[:-1] |= guided
        if self.config.credit in ("next", "increment"):
            scored[1:] |= guided
        return scored

    def score(self, x0: Tensor, metadata: list[dict], gradient: bool) -> tuple[Tensor, Tensor | None]:
        """``(PRM [B], d PRM / d x0 or None)`` of the decoded ``x0``."""
        from flowalign.rewards import differentiable_score

        prompts = [m.get("prompt", "") for m in metadata]
        with torch.enable_grad() if gradient else torch.no_grad():
            x0 = x0.detach().float().requires_grad_(gradient)
            scores = differentiable_score(self.reward, self.model.decode(x0), prompts, metadata)
            grad = torch.autograd.grad(scores.sum(), x0)[0] if gradient else None
        return scores.detach().double().cpu(), grad

    def new_record(self, process: Tensor) -> dict:
        return {"process": process, "decodes": 0, "shift_norm": 0.0}

    @contextmanager
    def scorer(self, context, metadata: list[dict], cond, record: dict):
        """``score(x, v, sigma, gradient) -> (PRM [B], d PRM / d x or None)`` of the states of one chunk (``v`` None
        for the clean final state). Here on ``x0_hat = x - s v`` with ``v`` fixed, so ``d / d x = d / d x0_hat``."""
        from flowalign.samplers import predict_x0

        def score(x: Tensor, v: Tensor | None, sigma: Tensor, gradient: bool) -> tuple[Tensor, Tensor | None]:
            record["decodes"] += x.shape[0]
            return self.score(x if v is None else predict_x0(x, v, sigma), metadata, gradient)

        yield score

    @contextmanager
    def guide(self, context, metadata: list[dict], cond):
        from flowalign.samplers import euphonium_guidance

        cfg, levels = self.config, context.levels
        guided = self.guided_steps(levels)
        scored = self.scored_states(guided)
        steps = len(levels)
        process = torch.full((len(metadata), steps + 1), math.nan, dtype=torch.float64)
        record = self.new_record(process)

        with self.scorer(context, metadata, cond, record) as score:
            def shift(x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, step: int) -> Tensor | None:
                if not scored[step]:
                    return None
                prm, grad = score(x, v, sigma, bool(guided[step]))
                process[:, step] = prm
                if grad is None:
                    return None
                mean_shift = euphonium_guidance(grad, sigma, sigma_next, noise_level=float(levels[step]),
                                                scale=cfg.scale, normalize=cfg.normalize, scale_by_dt=cfg.scale_by_dt,
                                                kl_beta=cfg.kl_beta, norm=cfg.norm)
                record["shift_norm"] += float(mean_shift.flatten(1).norm(dim=1).sum())
                return mean_shift

            def finish(final: Tensor) -> dict:
                if scored[steps]:  # x_T is clean: its x0_hat is itself
                    process[:, steps], _ = score(final, None, context.sigmas[steps], False)
                return record

            yield shift, finish


class RegisterGuidance(ProcessRewardGuidance):
    """Euphonium's guidance with latent reward registers as the PRM: ``S(x_i, s_i)`` (heads summed) and its gradient
    ``d S / d x_i`` through one forward of the reference transformer (LoRA off) with ``x_i`` requiring grad, the pass
    ``LatentRegisters.guide`` gives RGS. Records the forward (``nfe``) and backward (``backward_nfe``) NFEs too."""

    def __init__(self, config: EuphoniumConfig, registers, model):
        super().__init__(config, None, model)
        self.registers = registers

    def new_record(self, process: Tensor) -> dict:
        return {**super().new_record(process), "nfe": 0, "backward_nfe": 0}

    @contextmanager
    def scorer(self, context, metadata: list[dict], cond, record: dict):
        model, registers = self.model, self.registers
        guide = registers.guide(context.per_row_velocity(cond))
        evals = guide.evals_per_sample
        reference = model.reference if model.has_reference else nullcontext

        def score(x: Tensor, v: Tensor | None, sigma: Tensor, gradient: bool) -> tuple[Tensor, Tensor | None]:
            rows = torch.arange(x.shape[0], device=x.device)
            with reference(), torch.enable_grad() if gradient else torch.no_grad():
                # only around this pass (the rollout's own passes stay unread), on the module that runs it
                registers.attach(model.active_transformer)
                try:
                    x_in = x.detach().requires_grad_(gradient)
                    _, scores = guide(x_in, sigma, rows)
                    prm = scores.float().sum(dim=1)
                    grad = torch.autograd.grad(prm.sum(), x_in)[0] if gradient else None
                finally:
                    registers.detach()
            record["nfe"] += x.shape[0] * evals
            record["backward_nfe"] += x.shape[0] * evals if gradient else 0  # through both CFG halves
            return prm.detach().double().cpu(), grad

        yield score


@register_credit("euphonium", config=EuphoniumConfig)
class EuphoniumCredit(CreditEstimator):
    """Euphonium: rollouts guided by a process reward's gradient, outcome plus per-step process advantages."""

    shapes = ("group",)
    whole_prompts = True  # both advantages are normalised within groups of one chunk

    def __init__(self, config=None):
        super().__init__(config)
        self.guidance = None

    def check(self, config) -> None:
        self.check_shape(config)
        check(self.config.start_step < config.sampling.num_steps, "credit.start_step",
              f"= {self.config.start_step} is past the last step ({config.sampling.num_steps - 1}, sampling.num_steps "
              "- 1): no step would be guided")

    def start_up(self) -> None:
        from flowalign.credit.register_grpo import check_register_file
        from flowalign.rewards import build_differentiable_reward

        if self.config.registers is not None:
            check_register_file(self.config.registers, "credit.registers")
            return
        self.reward = build_differentiable_reward(self.config.process_reward, "credit.process_reward",
                                                  **self.config.reward_kwargs)

    def set_up(self, parts) -> None:
        from flowalign.credit.register_grpo import load_for

        if self.config.registers is None:
            self.guidance = ProcessRewardGuidance(self.config, self.reward, parts.model)
            return
        registers = load_for(self.config.registers, parts.model)  # refused when made for another transformer config
        registers.requires_grad_(False)  # the PRM is fixed: only d S / d x is taken
        self.guidance = RegisterGuidance(self.config, registers, parts.model)

    def rollout_hooks(self) -> list:
        return [] if self.guidance is None else [self.guidance]

    def assign(self, batch, scores: BatchScores, context: CreditContext) -> Credit:
        cfg, t = self.config, batch.rollout.transitions
        record = batch.extras[ProcessRewardGuidance.name]
        steps = context.config.sampling.num_steps
        levels = torch.zeros(steps)
        levels[t.step[t.stochastic].unique().cpu()] = 1.0
        guided = self.guidance.guided_steps(levels)
        outcome = torch.where(scores.valid, scores.combined.double(), torch.full_like(scores.combined.double(), math.nan))
        group_ids = batch.sample_ids // context.config.data.group_size
        out = euphonium_advantages(outcome, record["process"], group_ids, guided, credit=cfg.credit, mode=cfg.mode,
                                   outcome_weight=cfg.outcome_weight, process_weight=cfg.process_weight, eps=cfg.eps,
                                   std_unbiased=cfg.std_unbiased, clip=cfg.clip)
        # a chain's sample_id is its row in the chunk
        advantages = out["advantages"][t.sample_id.cpu(), t.step.cpu()].to(t.step.device)
        process = record["process"]
        finite = torch.isfinite(process)
        stats = {
            "credit/ora_abs_mean": float(out["outcome"].abs().mean()),
            "credit/pra_abs_mean": float(out["process"][:, guided].abs().mean()) if guided.any() else 0.0,
            "credit/process_reward_mean": float(process[finite].mean()) if finite.any() else 0.0,
            "credit/guided_steps": float(guided.sum()),
            "guidance/decodes": float(record["decodes"]),
            "guidance/shift_norm_mean": record["shift_norm"] / max(1, int(guided.sum()) * len(batch.sample_ids)),
        }
        nfe = 0
        if "nfe" in record:  # the registers' forwards at the scored states and backwards at the guided ones
            nfe = record["nfe"] + record["backward_nfe"]
            stats.update({"guidance/nfe": float(record["nfe"]), "guidance/backward_nfe": float(record["backward_nfe"])})
        return Credit(advantages, nfe=nfe, stats=stats)
