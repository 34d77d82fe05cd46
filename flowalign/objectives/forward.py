"""What the forward-process objectives (DiffusionNFT, AWM, online DPO) share: re-noising the rollout's final samples.

These objectives train on the final latent ``x0`` of each rollout sample, its prompt and its reward, never on the
rollout's transitions, so any sampler serves (an ODE rollout included) and no log-prob is read. At training time each
sample is noised afresh with the forward process of the flow:

    x_s = (1 - s) x0 + s eps,     u = eps - x0 (the target velocity),     x0_hat = x_s - s v,

so ``x0_hat - x0 = s (u - v)``: an x0-space error is ``s`` times the velocity error. ``||a||^2_m`` below is the squared
error averaged over the latent dimensions, the reduction every reference uses and every coefficient is calibrated to.

Keys. Every draw comes from a generator keyed ``(seed, iteration, key, kind, Purpose.FORWARD)``, with ``key`` a global
sample, unit or group number and ``kind`` naming the objective and the draw (``KIND``), so the units are the same on
any process layout and two objectives on one run never share noise. A unit holds the samples of one *slot* (one
trained noise level of each sample, or one DPO draw) of consecutive samples; the units of a process are ordered
slot-major, so with ``optim.minibatches`` dividing the slots a minibatch is a share of the slots over all samples on
every layout, as a GRPO minibatch is a share of the trained steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowalign.components import ComponentConfig
from flowalign.objectives.base import Objective, RolloutSamples
from flowalign.seeding import Purpose, generator
from flowalign.settings import check, finite, option

__all__ = ["ForwardObjective", "ForwardObjectiveConfig", "KIND", "forward_generator", "latent_mse", "noised",
           "reference_with_cfg"]

# The second element of a draw's key: which objective draws it, and what for.
KIND = {"nft": 0, "awm_sample": 1, "awm_unit": 2, "dpo_group": 3, "dgpo_group": 4, "dgpo_sample": 5,
        "dgpo_steps": 6, "crd_sample": 7, "crd_unit": 8}


def forward_generator(seed: int, iteration: int, key: int, kind: str) -> torch.Generator:
    """The CPU generator of draw ``(seed, iteration, key, KIND[kind], Purpose.FORWARD)``."""
    return generator(seed, iteration, int(key), KIND[kind], int(Purpose.FORWARD))


def noised(x0: Tensor, sigma: Tensor, noise: Tensor) -> Tensor:
    """``(1 - s) x0 + s eps`` with one ``s`` per row."""
    s = sigma.view(-1, *([1] * (x0.ndim - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


def latent_mse(a: Tensor, b: Tensor) -> Tensor:
    """``||a - b||^2_m`` per row: the mean over every dimension but the first."""
    return (a - b).pow(2).flatten(1).mean(dim=1)


@torch.no_grad()
def reference_with_cfg(model, unit, guidance_scale: float) -> Tensor:
    """The base model's velocity (the LoRA off) at a unit, classifier-free guided at ``guidance_scale`` (DGPO's and
    CRD's ``kl_cfg``), computed when the unit is made: the base is frozen, so it is the velocity a training-time pass
    would give (without the run's autocast). The unit's conditioning must hold the negative prompts. Its evaluations
    (2 per row with true CFG) are added to ``unit.nfe``."""
    with model.reference():
        v_ref = model.velocity(unit.x, unit.sigma, unit.cond, guidance_scale).float()
    unit.nfe += len(unit) * (2 if model.uses_cfg(guidance_scale) else 1)
    return v_ref


@dataclass
class ForwardObjectiveConfig(ComponentConfig):
    """Settings every forward-process objective has."""

    weight: float = option(1.0, "weight of this objective's loss")

    def validate(self) -> None:
        finite("weight", self.weight, 0.0, strict=True)


def _positive_int(key: str, value, low: int = 1) -> None:
    check(isinstance(value, int) and not isinstance(value, bool) and value >= low, key,
          f"must be an integer >= {low}, got {value!r}")


class ForwardObjective(Objective):
    """An objective on the rollout's final samples (module docstring): ``slots(config)`` trained slots per sample,
    units of ``unit_size`` consecutive samples ordered slot-major."""

    trains_on_rollouts = True
    sampling_setting: str | None = None  # the setting that rolls out with another policy than the trained one

    def key(self, setting: str) -> str:
        return f"objectives.{self.name or type(self).__name__.lower()}.{setting}"

    def slots(self, config) -> int:
        """The trained slots per sample (noise levels, draws): one unit per slot and chunk of samples."""
        raise NotImplementedError

    def slots_setting(self) -> str:
        """The setting ``slots`` reads (named in errors)."""
        return "timestep_fraction"

    def check(self, config) -> None:
        slots = self.slots(config)
        check(slots >= 1, self.key(self.slots_setting()),
              f"gives {slots} trained noise levels per sample at sampling.num_steps = {config.sampling.num_steps}: "
              "raise it (or the rollout's steps)")
        check(slots % config.optim.minibatches == 0, "optim.minibatches",
              f"= {config.optim.minibatches} does not divide the {slots} trained slots per sample of "
              f"objectives.{self.name} ({self.key(self.slots_setting())}): a minibatch is a share of the slots over "
              "all samples, so that the updates do not depend on the number of processes")
        if self.sampling_policy() is not None and self.sampling_setting is not None:
            check(not config.loss, self.key(self.sampling_setting),
                  f"rolls out with the {self.sampling_policy()!r} policy, but loss terms ({', '.join(config.loss)}) "
                  "train the rollout's transitions, whose log-probs must be the trained policy's: set "
                  f"{self.key(self.sampling_setting)}=false or turn the loss terms off (loss.grpo=null)")

    def rollout_of(self, context) -> RolloutSamples:
        if context.rollout is None:
            raise RuntimeError(f"objectives.{self.name} trains on the iteration's rollouts, but its context holds none "
                               "(the trainer rolls out for an objective with trains_on_rollouts = True)")
        return context.rollout

    @staticmethod
    def chunks(count: int, size: int) -> list[range]:
        """Consecutive local rows ``[start, start + size)`` covering ``count`` samples."""
        if count % size:
            raise ValueError(f"{count} samples do not split into units of {size}")
        return [range(start, start + size) for start in range(0, count, size)]

    @staticmethod
    def default_unit_size(config, rollout: RolloutSamples) -> int:
        """The rollout's chunk: ``sampling.batch_size``, else all of this process's samples."""
        size = getattr(getattr(config, "sampling", None), "batch_size", None)
        return int(size) if size else len(rollout)
