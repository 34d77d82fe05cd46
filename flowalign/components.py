"""What every registered part of a training run shares: its settings, its checks and its set-up.

A *component* (a rollout shape, a credit estimator, a step selection or weighting, a loss term, an objective) is a
class registered by name with its settings dataclass, a subclass of ``ComponentConfig``:

    @dataclass
    class TreeCreditConfig(ComponentConfig):
        fusion: Literal["mean", "prob_weighted"] = option("mean", "how a node's reward is fused from its leaves")

    @CREDIT.register("tree", config=TreeCreditConfig)
    class TreeCredit(Component):
        shapes = ("tree",)
        ...

In a config file the component's section names it and holds its settings (``credit: {name: tree, fusion: mean}``);
``flowalign.config`` builds the settings dataclass the registry names, checks every key against it (with a
did-you-mean), and runs its ``validate``. A layer that names another component starts that section afresh: the
settings earlier layers gave the old component are dropped.

A component lives through four moments, each a method with a default that does nothing:

* ``validate()`` (on its settings): its own ranges, naming its own keys (``fusion``); the loader puts the section in
  front (``credit.fusion``). No file is read.
* ``check(config)``: what spans sections (``config`` is the whole ``TrainConfig``), again without reading files.
* ``start_up()``: at start-up, before any model loads: the files its settings name exist; what needs no model (a
  reward) is built.
* ``check_model(model_path)``: right after ``start_up``, still before the model loads: the files made for one model
  (a fitted manifold, a discriminator) were made for the pipeline at ``model_path`` (None when the trainer was given
  a model object: ``set_up`` checks the loaded model then).
* ``set_up(parts)``: once the model is loaded (``parts`` is the trainer's ``Parts``: model, accelerator, rewards).

It also declares what the rest of the run needs to know of it, instead of the trainer asking by name:
``progress_dependent()`` (settings that read the run's progress, so ``train.iterations`` may not change on resume),
``resumable`` (its settings that change no math, so a resumed run may change them) and ``rollout_fields()`` (the
optional transition fields the rollout must store for it, ``flowalign.rollout``).

Every iteration, the trainer calls each component twice around the optimizer steps, with an ``IterationContext``:

* ``prepare_update(context)``: after the rewards and the credit, before the first optimizer step (a KL gate read
  from the iteration's gathered rewards, a reference reset). Whatever it computes from the whole gathered batch is
  the same on every process.
* ``after_update(context, metrics)``: after the last optimizer step, with the iteration's metrics so far (a reset
  triggered by the logged KL).

Both return stats to log (python floats; an empty dict by default). A component that keeps state across iterations
returns it from ``state_dict()`` (tensors and JSON values) and takes it back in ``load_state_dict``: checkpoints store
it, so a resumed run continues bitwise.

Policy copies. A component may ask the trainer to keep lagging copies of the trainable weights
(``policy_copies()``, each a ``PolicyCopy``): DiffusionNFT's "old" policy, AWM's trust-region EMA, online DPO's
reference. The trainer starts each as a copy of the trainable weights, moves it at the end of every iteration by
``theta_c <- eta theta_c + (1 - eta) theta`` with ``eta = decay(k)`` (``k`` the optimizer steps taken so far), saves it
in checkpoints, evaluates it at an objective's data units (``PolicyOutput.v_copies``) and, when a component names it
in ``sampling_policy()``, rolls out with it (``"reference"`` rolls out with the reference model instead).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

__all__ = ["Component", "ComponentConfig", "IterationContext", "PolicyCopy", "REFERENCE_POLICY"]

REFERENCE_POLICY = "reference"  # ``sampling_policy()``'s name for the reference model (the LoRA off, or the base copy)


@dataclasses.dataclass(frozen=True)
class PolicyCopy:
    """A lagging copy of the trainable weights the trainer keeps for a component (module docstring).

    ``decay(k)`` is the weight ``eta`` in [0, 1] the copy keeps at the end of an iteration, after ``k`` optimizer steps
    in all: ``theta_c <- eta theta_c + (1 - eta) theta``. ``eta = 0`` makes it the current weights, ``eta = 1``
    leaves it where it is (a copy that always keeps 1 is the initial weights: the base model for a LoRA).

    ``evaluated``: whether the component's loss reads the copy's velocity at its data units (``PolicyOutput.v_copies``);
    a copy only the rollouts sample with (``sampling_policy``) is not, and costs no forward in training."""

    name: str
    decay: Callable[[int], float]
    help: str = ""
    evaluated: bool = True

    def eta(self, steps: int) -> float:
        """``decay(steps)``, checked to lie in [0, 1]."""
        eta = float(self.decay(int(steps)))
        if not 0.0 <= eta <= 1.0:
            raise ValueError(f"policy copy {self.name!r}: decay({steps}) = {eta} is not in [0, 1]")
        return eta


@dataclasses.dataclass
class ComponentConfig:
    """The settings of one component; ``name`` is the registered name it was built under (set by the loader)."""

    name: str = ""

    def validate(self) -> None:
        """Own ranges; raise ``ConfigError`` naming the setting (``key="fusion"``)."""


@dataclasses.dataclass
class IterationContext:
    """What ``prepare_update`` and ``after_update`` see of an iteration: its number, the run's config, this process's
    rollout ``batches`` (empty in an objective-only run), the iteration's rewards ``scores``
    (``flowalign.training.scoring.Scores``: the gathered raw rewards of every process by name, this process's decoded
    images; None in an objective-only run), this process's place, and ``mean_over_processes(value)``, the mean of a
    float over the processes (collective: every process calls it alike)."""

    iteration: int
    config: Any
    batches: list
    scores: Any
    process_index: int = 0
    num_processes: int = 1
    mean_over_processes: Callable[[float], float] = float


class Component:
    """Base of the registered parts: the settings, and the lifecycle of the module docstring (all optional)."""

    config_class: ClassVar[type[ComponentConfig]] = ComponentConfig
    # Settings of this component a resumed run may change (they change no math).
    resumable: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: ComponentConfig | None = None):
        self.config = config if config is not None else self.config_class()

    @property
    def name(self) -> str:
        return self.config.name

    def check(self, config: Any) -> None:
        """Checks that span sections of the whole ``TrainConfig``; no file is read."""

    def start_up(self) -> None:
        """Start-up, before any model loads: check the files the settings name, build what needs no model."""

    def check_model(self, model_path: str | None) -> None:
        """Before the model loads: what the settings name fits the pipeline at ``model_path`` (None: unknown)."""

    def set_up(self, parts: Any) -> None:
        """Once the model is loaded: load what the component needs (register heads, a reward)."""

    def rollout_hooks(self) -> list:
        """The ``flowalign.rollout.RolloutHook``s that must read the rollout's passes for this component."""
        return []

    def progress_dependent(self) -> list[str]:
        """The settings in use that read the run's progress ``iteration / train.iterations``."""
        return []

    def rollout_fields(self) -> frozenset[str]:
        """The optional transition fields the rollout must store for this component (``flowalign.rollout``)."""
        return frozenset()

    def prepare_update(self, context: IterationContext) -> dict[str, float]:
        """Before the iteration's optimizer steps (module docstring); returns stats to log."""
        return {}

    def after_update(self, context: IterationContext, metrics: dict[str, float]) -> dict[str, float]:
        """After the iteration's optimizer steps, with its metrics (module docstring); returns stats to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State kept across iterations: tensors and JSON values by name (empty: none), checkpointed."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` returned (from a checkpoint)."""

    def policy_copies(self) -> list[PolicyCopy]:
        """The lagging copies of the trainable weights this component needs the trainer to keep (module
        docstring); their names are unique over the run's components."""
        return []

    def sampling_policy(self) -> str | None:
        """The policy the rollouts are sampled with: None (the trained weights, the default), ``"reference"`` (the
        reference model) or the name of one of the run's policy copies. At most one component may set it."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"
