"""flowalign: align flow-matching text-to-image models with reward models.

The names a user needs, imported on first use (PEP 562), so ``import flowalign`` loads neither torch nor diffusers:

    import flowalign

    config = flowalign.load_config(flowalign.TrainConfig, "configs/methods/flow_grpo.yaml", ["train.iterations=2"])
    flowalign.register_reward("my_reward", MyReward)     # a callable (images, prompts, metadata) -> scores
    flowalign.Trainer(config).train()
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__version__ = "0.1.0"

# exported name -> the module that defines it
_EXPORTS = {
    "TrainConfig": "flowalign.training.config",
    "load_config": "flowalign.config",
    "Trainer": "flowalign.training.trainer",
    "load_flow_model": "flowalign.models",
    "FlowModel": "flowalign.models",
    "Reward": "flowalign.rewards",
    "register_reward": "flowalign.rewards",
    "register_credit": "flowalign.credit",
    "register_loss": "flowalign.losses",
    "register_objective": "flowalign.objectives",
    "register_shape": "flowalign.rollout",
    "Registry": "flowalign.registry",
    "register_sampler": "flowalign.inference",
    "GuidedSampler": "flowalign.inference",
}

__all__ = list(_EXPORTS)

# old name -> the exported name that replaces it; each warns, and goes in the release after the one that renamed it
_DEPRECATED = {"GRPOTrainer": "Trainer"}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new = _DEPRECATED[name]
        warnings.warn(f"flowalign.{name} is now flowalign.{new}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return __getattr__(new)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flowalign' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
