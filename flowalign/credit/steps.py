"""Which of a rollout's stochastic steps are trained (``step_selection``) and how each step's loss is weighted
(``step_weighting``).

Selections: ``all`` (every stochastic step) and ``random_subset`` (DanceGRPO, Xue et al. 2025: ``count`` of them drawn
per iteration, keyed by the iteration, the same subset for every sample and process). Weightings: ``uniform`` (1 on
the trained steps, 0 elsewhere) and ``noise_aware`` (TempFlow-GRPO, He et al. 2025: ``w_t = c std_t sqrt(-dt)``, the
SDE's own std without a tree's split-noise scale, mean 1 over the trained transitions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowalign.components import Component, ComponentConfig
from flowalign.credit.base import trained_mask
from flowalign.registry import Registry
from flowalign.seeding import Purpose, numpy_rng
from flowalign.settings import at_least, check, option

__all__ = ["STEP_SELECTIONS", "STEP_WEIGHTINGS", "StepSelection", "StepWeighting", "noise_aware_weights"]

STEP_SELECTIONS: Registry = Registry("step selection")
STEP_WEIGHTINGS: Registry = Registry("step weighting")


def noise_aware_weights(std: Tensor, stochastic_mask: Tensor | None = None) -> Tensor:
    """TempFlow-GRPO's noise-aware step weights ``w_t = c * std_t sqrt(-dt)`` (He et al. 2025, "TempFlow-GRPO").

    ``std`` is the transition std ``std_t sqrt(-dt)`` the rollout stores in ``Transitions.std``. ``c`` makes the mean
    weight over the trained transitions (``stochastic_mask``, all of them by default) exactly 1, so the loss keeps
    its scale; untrained transitions get weight 0. Returns ``[N]`` fp32, detached.
    """
    std = std.detach().float()
    if std.ndim != 1 or std.numel() == 0:
        raise ValueError(f"std must be a non-empty 1-D tensor [N], got shape {tuple(std.shape)}")
    if stochastic_mask is None:
        mask = torch.ones_like(std, dtype=torch.bool)
    else:
        mask = torch.as_tensor(stochastic_mask, device=std.device)
        if mask.shape != std.shape or mask.dtype != torch.bool:
            raise ValueError(f"stochastic_mask must be a bool tensor of shape {tuple(std.shape)}, got {mask.dtype} "
                             f"{tuple(mask.shape)}")
    trained = std[mask]
    if not torch.isfinite(trained).all() or (trained < 0).any():
        raise ValueError("transition stds of trained transitions must be finite and >= 0")
    if trained.numel() == 0 or not trained.sum() > 0:
        raise ValueError("noise-aware weights need at least one trained transition with std > 0")
    c = 1.0 / trained.mean()
    return torch.where(mask, c * std, torch.zeros_like(std))


class StepSelection(Component):
    """Picks the trained steps of an iteration among the rollout's stochastic steps."""

    def count(self, stochastic: int) -> int:
        """How many steps it trains when a rollout has ``stochastic`` stochastic steps."""
        return stochastic

    def count_source(self) -> str | None:
        """The setting ``count`` reads (named in batch-arithmetic errors), or None when it trains them all."""
        return None

    def select(self, stochastic: list[int], seed: int, iteration: int) -> list[int]:
        return stochastic


class StepWeighting(Component):
    """Weights each transition of a batch: 0 off the trained steps."""

    def weights(self, transitions, steps: list[int]) -> Tensor:
        raise NotImplementedError


@STEP_SELECTIONS.register("all", config=ComponentConfig)
class AllSteps(StepSelection):
    """every stochastic step."""


@dataclass
class RandomSubsetConfig(ComponentConfig):
    count: int = option(5, "stochastic steps trained per iteration, drawn anew each iteration")

    def validate(self) -> None:
        at_least("count", self.count, 1)


@STEP_SELECTIONS.register("random_subset", config=RandomSubsetConfig)
class RandomSubset(StepSelection):
    """a random subset of the stochastic steps each iteration, the same for every sample (DanceGRPO)."""

    def check(self, config) -> None:
        check(config.rollout.name != "probe", "step_selection.name",
              "= 'random_subset' does not apply to rollout.name = 'probe' (every probe step is trained)")
        stochastic = config.sampling.stochastic_steps()
        check(self.config.count <= stochastic, "step_selection.count",
              f"must be in 1..{stochastic} (the number of stochastic steps), got {self.config.count}")

    def count(self, stochastic: int) -> int:
        return self.config.count

    def count_source(self) -> str:
        return "step_selection.count"

    def select(self, stochastic: list[int], seed: int, iteration: int) -> list[int]:
        if self.config.count >= len(stochastic):
            return stochastic
        rng = numpy_rng(seed, iteration, Purpose.STEP_SUBSET)
        return sorted(int(s) for s in rng.choice(stochastic, size=self.config.count, replace=False))


@STEP_WEIGHTINGS.register("uniform", config=ComponentConfig)
class UniformWeighting(StepWeighting):
    """1 on the trained steps."""

    def weights(self, transitions, steps: list[int]) -> Tensor:
        return trained_mask(transitions, steps).float()


@STEP_WEIGHTINGS.register("noise_aware", config=ComponentConfig)
class NoiseAwareWeighting(StepWeighting):
    """each step's loss scaled by its noise, std_t sqrt(-dt), mean 1 (TempFlow-GRPO)."""

    def weights(self, transitions, steps: list[int]) -> Tensor:
        t = transitions
        return noise_aware_weights(t.std / t.noise_scale, trained_mask(t, steps))
