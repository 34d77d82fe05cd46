"""GARDO's gated KL: a KL to the reference policy on only the samples whose proxy reward is least trustworthy.

He et al. 2025, "GARDO: Reinforcing Diffusion Models without Reward Hacking" (arXiv 2512.24138); the reference code is
``scripts/train_sd3_grpo_gardo.py`` of tinnerhrhe/GARDO (the same in yifan123/flow_grpo): ``RiskCompensator`` and the
``reward_std`` gate. Over the whole gathered batch of an iteration (every prompt, every process):

1. Rank every valid sample under the main (proxy) reward and under each auxiliary reward, in descending order (rank
   1 = best; ties keep the sample order, a stable sort), and take the uncertainty

       u_i = rank_main(i) - mean_a rank_a(i)                              (orientation: reference, the code's)
       u_i = mean_a rank_a(i) - rank_main(i)                              (orientation: flipped)

   With the code's orientation a large ``u`` is a sample the proxy ranks *worse* than the auxiliaries do; whether
   the paper means the opposite is not confirmed (a "high proxy, low auxiliaries" hacking sample has a negative
   code-``u`` and is never gated), so ``flipped`` gates the samples the proxy ranks above the auxiliaries.
2. ``P = {u_i >= 0}`` (never empty: the ``u`` sum to 0) and ``m = mean_P(u)``. The controller holds the fraction
   ``q``: ``fraction`` at the first update; afterwards ``q <- (1 + adapt) q`` if ``m`` exceeds the largest of the
   last ``history`` ``m``'s, ``q <- (1 - adapt) q`` if it is below their smallest; ``q`` is clipped to
   ``[fraction_min, fraction_max]`` and ``m`` appended to the history.
3. ``tau`` is the ``(100 - 100 q)``-th percentile of ``u`` over ``P`` (linear interpolation, numpy's default) and the
   gated set is ``G = {u_i > tau}``.
4. The term, per micro-batch: ``beta mean_{n in G} ||mu_theta - mu_ref||^2_m / (2 s_n^2)``, 0 when no transition of
   the micro-batch is gated. ``mu_ref`` comes from the run's reference policy (``reference: {name: adaptive}`` for
   GARDO's periodically reset one). ``s`` is ``std_t``, the SDE's diffusion coefficient without the step's
   ``sqrt(-dt)`` (``kl_std: std_t``, the reference code's; for ``cps``, whose std has no ``sqrt(-dt)``, the
   transition std), or the transition std itself (``kl_std: transition``): the two readings of ``loss.grpo.kl_std``.

The controller's ``q`` and history are checkpointed. The gate is computed from the gathered rewards, so it is the same
on every process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from flowalign.components import ComponentConfig, IterationContext
from flowalign.kernels.loss_reference import kl_std_scale, latent_mean_kl
from flowalign.kernels.sde_reference import sde_mean_std
from flowalign.losses.base import LossTerm, MicroBatch, PolicyOutput, register_loss
from flowalign.settings import at_least, check, finite, option

__all__ = ["GatedKL", "GatedKLConfig", "RiskController", "descending_ranks", "gate_fraction", "kl_scale",
           "uncertainty"]

ORIENTATIONS = ("reference", "flipped")


def descending_ranks(values: Tensor) -> Tensor:
    """Rank 1 for the largest value, ``n`` for the smallest; ties in index order (a stable sort). ``[n]`` float64."""
    order = torch.sort(values.double(), descending=True, stable=True).indices
    ranks = torch.empty(values.shape[0], dtype=torch.float64)
    ranks[order] = torch.arange(1, values.shape[0] + 1, dtype=torch.float64)
    return ranks


def uncertainty(main: Tensor, auxiliaries: Tensor, orientation: str = "reference") -> Tensor:
    """GARDO's ``u`` (module docstring, step 1) of ``main [n]`` against ``auxiliaries [A, n]``; float64 ``[n]``."""
    if orientation not in ORIENTATIONS:
        raise ValueError(f"unknown orientation {orientation!r}: expected one of {', '.join(ORIENTATIONS)}")
    if auxiliaries.ndim != 2 or auxiliaries.shape[1] != main.shape[0] or auxiliaries.shape[0] == 0:
        raise ValueError(f"auxiliaries must be [A >= 1, n = {main.shape[0]}], got {tuple(auxiliaries.shape)}")
    aux = torch.stack([descending_ranks(row) for row in auxiliaries]).mean(dim=0)
    u = descending_ranks(main) - aux
    return u if orientation == "reference" else -u


class RiskController:
    """GARDO's ``RiskCompensator``: the gated fraction ``q`` (module docstring, step 2)."""

    def __init__(self, fraction: float = 0.1, low: float = 0.02, high: float = 0.2, adapt: float = 0.1,
                 history: int = 20):
        self.initial, self.low, self.high, self.adapt, self.size = fraction, low, high, adapt, history
        self.fraction, self.history = fraction, []

    def update(self, m: float) -> float:
        if not self.history:
            self.fraction = self.initial
        elif m > max(self.history):
            self.fraction *= 1 + self.adapt
        elif m < min(self.history):
            self.fraction *= 1 - self.adapt
        self.fraction = min(max(self.fraction, self.low), self.high)
        self.history = (self.history + [float(m)])[-self.size:]
        return self.fraction


def gate_fraction(u: Tensor, controller: RiskController) -> tuple[Tensor, float, float]:
    """``(gate [n] bool, tau, q)`` of the uncertainties ``u`` (module docstring, steps 2 and 3); updates the
    controller."""
    positive = u[u >= 0].double()
    q = controller.update(float(positive.mean()))
    tau = float(torch.quantile(positive, 1.0 - q)) if positive.numel() else math.inf
    return u > tau, tau, q


def kl_scale(std: Tensor, sigma: Tensor, sigma_next: Tensor, kind: str, mode: str) -> Tensor:
    """The ``s`` of the KL's ``2 s^2`` per transition (module docstring, step 4): ``loss.grpo``'s rule
    (``flowalign.kernels.loss_reference.kl_std_scale``)."""
    return kl_std_scale(std, sigma, sigma_next, kind, mode)


@dataclass
class GatedKLConfig(ComponentConfig):
    beta: float = option(0.07, "weight of the gated KL (GARDO: 0.07 GenEval, 0.04 OCR, 0.01 FLUX)")
    main: str | None = option(None, "the proxy reward ranked against the auxiliaries (a name in reward.rewards); null = "
                              "the first reward with a nonzero weight")
    auxiliaries: list[str] = option([], "auxiliary rewards (names in reward.rewards, weight 0 to keep them out of the "
                                    "advantage) whose ranks the proxy's is compared with")
    orientation: Literal["reference", "flipped"] = option(
        "reference", "u = rank_main - mean rank_aux, ranks descending (the reference code), or its negative (gate the "
        "samples the proxy ranks above the auxiliaries)")
    fraction: float = option(0.1, "the gated fraction q at the first update")
    fraction_min: float = option(0.02, "the smallest q")
    fraction_max: float = option(0.2, "the largest q")
    adapt: float = option(0.1, "q grows by (1 + adapt) or shrinks by (1 - adapt) when mean_P(u) leaves its history's "
                          "range")
    history: int = option(20, "how many past mean_P(u) the controller compares with")
    kl_std: Literal["std_t", "transition"] = option(
        "std_t", "the KL's std: the SDE's std_t without sqrt(-dt) (the reference code) or the transition std")

    def validate(self) -> None:
        finite("beta", self.beta, 0.0)
        check(len(self.auxiliaries) > 0, "auxiliaries",
              "must name at least one auxiliary reward of reward.rewards (GARDO: aesthetic and imagereward; on the "
              "toy world toy_geneval and jpeg_compressibility, each with weight 0)")
        check(len(set(self.auxiliaries)) == len(self.auxiliaries), "auxiliaries", f"has repeats: {self.auxiliaries}")
        finite("fraction_min", self.fraction_min, 0.0, strict=True, high=1.0)
        finite("fraction_max", self.fraction_max, self.fraction_min, high=1.0)
        finite("fraction", self.fraction, self.fraction_min, high=self.fraction_max)
        finite("adapt", self.adapt, 0.0, high=0.999)
        at_least("history", self.history, 1)

    def main_reward(self, rewards) -> str | None:
        if self.main is not None:
            return self.main
        return next((spec.name for spec in rewards if spec.weight != 0), None)


@register_loss("gated_kl", config=GatedKLConfig)
class GatedKL(LossTerm):
    """GARDO's gated KL: beta times the KL to the reference on the samples whose proxy reward is least trusted."""

    needs_reference = True

    def __init__(self, config: GatedKLConfig | None = None):
        super().__init__(config)
        cfg = self.config
        self.controller = RiskController(cfg.fraction, cfg.fraction_min, cfg.fraction_max, cfg.adapt, cfg.history)
        self.gate: Tensor | None = None

    def check(self, config) -> None:
        cfg, names = self.config, [spec.name for spec in config.reward.rewards]
        main = cfg.main_reward(config.reward.rewards)
        check(main is not None and main in names, "loss.gated_kl.main",
              f"= {main!r} is not one of reward.rewards ({', '.join(names)})")
        missing = [a for a in cfg.auxiliaries if a not in names]
        check(not missing, "loss.gated_kl.auxiliaries",
              f"{missing} are not in reward.rewards ({', '.join(names)}): add them there (weight 0 keeps them out of "
              "the advantage)")
        check(main not in cfg.auxiliaries, "loss.gated_kl.auxiliaries", f"holds the main reward {main!r}")

    def set_up(self, parts) -> None:
        self.main = self.config.main_reward(parts.config.reward.rewards)

    def prepare_update(self, context: IterationContext) -> dict[str, float]:
        scores = context.scores
        if scores is None:
            return {}
        names = list(scores.names)
        wanted = [self.main, *self.config.auxiliaries]
        missing = [n for n in wanted if n not in names]
        if missing:
            raise RuntimeError(f"loss.gated_kl ranks {missing}, which this run does not score (its rewards: "
                               f"{', '.join(names)})")
        valid = scores.valid_all.bool()
        raw = scores.raw_all.double()
        self.gate = torch.zeros(raw.shape[1], dtype=torch.bool)
        if not valid.any():
            return {"gated_kl/fraction": self.controller.fraction, "gated_kl/tau": math.nan, "gated_kl/gated_frac": 0.0}
        u = torch.full((raw.shape[1],), -math.inf, dtype=torch.float64)
        u[valid] = uncertainty(raw[names.index(self.main)][valid],
                               raw[[names.index(a) for a in self.config.auxiliaries]][:, valid],
                               self.config.orientation)
        gate, tau, q = gate_fraction(u[valid], self.controller)
        self.gate[valid] = gate
        return {"gated_kl/fraction": q, "gated_kl/tau": tau, "gated_kl/gated_frac": float(self.gate.double().mean())}

    def loss(self, micro: MicroBatch, policy: PolicyOutput) -> tuple[Tensor, dict[str, float]]:
        st = micro.transitions
        if self.gate is None:
            raise RuntimeError("loss.gated_kl: no gate for this iteration (prepare_update did not run)")
        ids = micro.batch.sample_ids.to(st.sample_id.device)[st.sample_id].cpu()
        gated = self.gate[ids].to(policy.v.device)
        count = int(gated.sum())
        if count == 0:
            zero = policy.v.float().sum() * 0.0
            return zero, {"gated_kl": 0.0, "gated_kl/transitions": 0.0}
        mean, _ = sde_mean_std(st.x_t, policy.v, st.sigma, st.sigma_next, kind=st.kind, noise_level=st.noise_level)
        ref, _ = sde_mean_std(st.x_t, policy.v_ref.detach(), st.sigma, st.sigma_next, kind=st.kind,
                              noise_level=st.noise_level)
        scale = kl_scale(st.std, st.sigma, st.sigma_next, st.kind, self.config.kl_std).to(mean.device)
        rows = latent_mean_kl(mean[gated], ref[gated], scale[gated])
        value = rows.mean()
        return self.config.beta * value, {"gated_kl": float(value.detach()), "gated_kl/transitions": float(count)}

    def state_dict(self) -> dict[str, Any]:
        return {"fraction": self.controller.fraction, "history": list(self.controller.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.fraction = float(state["fraction"])
        self.controller.history = [float(m) for m in state["history"]]
