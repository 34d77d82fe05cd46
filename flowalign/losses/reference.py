"""The reference policy of a run: what ``PolicyOutput.v_ref`` is evaluated with (the KL terms' anchor).

A run has one reference policy, a registered component named in the ``reference`` section:

* ``base`` (the default): the base model, the transformer with its LoRA adapter disabled (``model.reference()``), or
  the frozen copy of a full fine-tune.
* ``adaptive``: GARDO's adaptive reference (He et al. 2025, "GARDO: Reinforcing Diffusion Models without Reward
  Hacking", arXiv 2512.24138; code ``scripts/train_sd3_grpo_gardo.py`` of tinnerhrhe/GARDO and yifan123/flow_grpo,
  where it is the ``old`` LoRA adapter). A snapshot ``theta_ref`` of the trainable weights, equal to the policy at the
  start, reset to the current policy ``theta_ref <- theta`` at the start of an iteration's update when

      iteration - last_reset >= reset_every          (periodic; the reference's ``epoch - prev_epoch > reset_freq``
                                                      with reset_freq 15 is reset_every 16), or
      the previous iteration's mean of ``kl_metric`` > kl_threshold   (GARDO's kappa, 3e-4 in its configs).

  Its reference pass swaps the snapshot into the trainable weights (no gradient) and restores the live weights
  bitwise, as the EMA's evaluation does. The snapshot and the reset bookkeeping are checkpointed, so a resumed run
  continues bitwise.

The rollout's base-model tail (``sampling.base_tail_steps``) and the evaluation's "before" always use the base model.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from flowalign.components import Component, ComponentConfig, IterationContext
from flowalign.registry import Registry
from flowalign.settings import check, option

__all__ = ["REFERENCES", "AdaptiveReference", "AdaptiveReferenceConfig", "BaseReference", "ReferencePolicy",
           "register_reference"]

REFERENCES: Registry = Registry("reference policy")
register_reference = REFERENCES.register
"""Register a reference policy: ``@register_reference("name", config=Settings)`` on its class."""


class ReferencePolicy(Component):
    """What ``PolicyOutput.v_ref`` is evaluated with: ``active(model)`` is a context in which the model's forward
    passes are the reference's (module docstring)."""

    @contextmanager
    def active(self, model) -> Iterator[None]:
        with model.reference():
            yield


@register_reference("base", config=ComponentConfig)
class BaseReference(ReferencePolicy):
    """the base model: the LoRA adapter disabled (or a full fine-tune's frozen copy)."""


@dataclass
class AdaptiveReferenceConfig(ComponentConfig):
    reset_every: int = option(16, "reset the reference to the current policy once this many iterations have passed "
                              "since the last reset (GARDO's reset_freq = 15 resets after more than 15 epochs: 16)")
    kl_threshold: float | None = option(
        None, "also reset at the next iteration when this iteration's mean of kl_metric (over its micro-batches and "
        "processes) exceeds it (GARDO's kappa: 3e-4); null = periodic resets only")
    kl_metric: str = option("gated_kl", "the logged loss statistic kl_threshold reads (gated_kl: the gated KL term's; "
                            "kl: loss.grpo's KL)")

    def validate(self) -> None:
        check(isinstance(self.reset_every, int) and not isinstance(self.reset_every, bool) and self.reset_every >= 1,
              "reset_every", f"must be an integer >= 1 (iterations between resets of the reference to the current "
              f"policy), got {self.reset_every!r}")
        if self.kl_threshold is not None:
            check(math.isfinite(self.kl_threshold) and self.kl_threshold >= 0, "kl_threshold",
                  f"must be a finite number >= 0 or null, got {self.kl_threshold!r}")
        check(bool(self.kl_metric), "kl_metric", "must name a logged loss statistic")


@register_reference("adaptive", config=AdaptiveReferenceConfig)
class AdaptiveReference(ReferencePolicy):
    """GARDO's adaptive reference: a snapshot of the trainable weights, reset to the policy periodically or when the
    logged KL passes a threshold (module docstring)."""

    def __init__(self, config: AdaptiveReferenceConfig | None = None):
        super().__init__(config)
        self.params: dict[str, torch.Tensor] = {}
        self.snapshot: dict[str, torch.Tensor] = {}
        self.last_reset, self.pending = 0, False

    def check(self, config) -> None:
        parts = config.components()
        readers = [name for name, term in parts.losses.items() if term.wants_reference()]
        readers += [name for name, objective in parts.objectives.items() if objective.needs_reference]
        check(bool(readers), "reference.name",
              "= 'adaptive' but no loss term or objective reads the reference velocity (a KL): add one "
              "(loss.gated_kl, or loss.grpo.beta > 0), or keep reference.name = base")
        check(config.distributed.engine != "fsdp2", "reference.name",
              "= 'adaptive' keeps an unsharded snapshot of the trainable weights: use distributed.engine: ddp")

    def set_up(self, parts) -> None:
        self.params = dict(parts.trainable_state())
        self.snapshot = {name: p.detach().clone() for name, p in self.params.items()}

    @torch.no_grad()
    def reset(self, iteration: int) -> None:
        """``theta_ref <- theta``."""
        for name, param in self.params.items():
            self.snapshot[name].copy_(param.detach())
        self.last_reset, self.pending = iteration, False

    def prepare_update(self, context: IterationContext) -> dict[str, float]:
        due = context.iteration - self.last_reset >= self.config.reset_every
        reset = self.pending or due
        if reset:
            self.reset(context.iteration)
        return {"reference/reset": float(reset), "reference/age": float(context.iteration - self.last_reset)}

    def after_update(self, context: IterationContext, metrics: dict[str, float]) -> dict[str, float]:
        cfg = self.config
        if cfg.kl_threshold is None or metrics.get("skipped", 0.0):
            return {}
        if cfg.kl_metric not in metrics:
            raise RuntimeError(f"reference.kl_metric = {cfg.kl_metric!r} is not a logged statistic of this run (it "
                               f"logs {', '.join(sorted(k for k in metrics if '/' not in k))}): name one, or set "
                               "reference.kl_threshold: null")
        value = context.mean_over_processes(float(metrics[cfg.kl_metric]))
        self.pending = value > cfg.kl_threshold
        return {"reference/kl": value}

    @contextmanager
    def active(self, model) -> Iterator[None]:
        """The snapshot in the trainable weights; the live weights come back bitwise on exit."""
        with torch.no_grad():
            saved = {name: param.detach().clone() for name, param in self.params.items()}
            for name, param in self.params.items():
                param.data.copy_(self.snapshot[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for name, param in self.params.items():
                    param.data.copy_(saved[name])

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {f"snapshot/{name}": tensor for name, tensor in self.snapshot.items()}
        state.update(last_reset=self.last_reset, pending=self.pending)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = {key.removeprefix("snapshot/") for key in state if key.startswith("snapshot/")}
        if names != set(self.snapshot):
            missing, unexpected = sorted(set(self.snapshot) - names), sorted(names - set(self.snapshot))
            raise ValueError(f"the adaptive reference's checkpointed snapshot does not match the trainable weights: "
                             f"missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name in self.snapshot:
                self.snapshot[name].copy_(state[f"snapshot/{name}"])
        self.last_reset, self.pending = int(state["last_reset"]), bool(state["pending"])
