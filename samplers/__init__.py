"""SDE/ODE steps with exact log-probs, noise-level schedules and rollouts (installed as ``flowalign.samplers``).

Samplers work on tensors and plain callables only: they never import models or reward functions.
"""

from .rollout import Rollout, Transitions, count_nfe, rollout
from .schedules import ConstantNoise, NoiseSchedule, PerStepNoise, SDEWindow, noise_schedule
from .probe import ProbeRollout, probe_nfe, probe_rollout
from .tree import TreeRollout, TreeSchedule, tree_rollout
from .guided import GuidedResult, best_of_n
from .fk import fk_steering
from .dts import diffusion_tree_search
from .rgs import reward_guided_sampling
from .euphonium import euphonium_guidance, euphonium_sampling
from .satisdive import satisdive_sampling
from ..kernels.sde_kinds import SDEKind, register_sde_kind, registered_sde_kinds, sde_kind
from .sde import (
    REDUCTIONS,
    SDE_KINDS,
    StepOutput,
    LOG_PROB_MEANS,
    check_sigmas,
    gaussian_log_prob,
    ode_step,
    predict_x0,
    sde_mean_std,
    sde_step,
)

__all__ = [
    "LOG_PROB_MEANS",
    "REDUCTIONS",
    "SDE_KINDS",
    "ConstantNoise",
    "GuidedResult",
    "NoiseSchedule",
    "PerStepNoise",
    "ProbeRollout",
    "Rollout",
    "SDEKind",
    "SDEWindow",
    "StepOutput",
    "Transitions",
    "TreeRollout",
    "TreeSchedule",
    "best_of_n",
    "check_sigmas",
    "count_nfe",
    "diffusion_tree_search",
    "euphonium_guidance",
    "euphonium_sampling",
    "fk_steering",
    "gaussian_log_prob",
    "noise_schedule",
    "ode_step",
    "predict_x0",
    "probe_nfe",
    "register_sde_kind",
    "registered_sde_kinds",
    "probe_rollout",
    "reward_guided_sampling",
    "rollout",
    "satisdive_sampling",
    "sde_kind",
    "sde_mean_std",
    "sde_step",
    "tree_rollout",
]
