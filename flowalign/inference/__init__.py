"""Inference: guided samplers as registered components, and ``flowalign sample`` (``flowalign.inference.sample``).

The protocol, the registry and the settings the samplers share are ``flowalign.inference.base`` (``GuidedSampler``,
``GuidedProblem``, ``SAMPLERS``, ``register_sampler``); each built-in sampler is one module beside it, registered when
this package is imported: ``none`` and ``bon`` (best-of-N, ``best_of_n``), ``fk`` (Feynman-Kac steering, Singhal et
al. 2025), ``dts`` (DTS / DTS*, Jain et al. 2025), ``rgs`` (reward-gradient guidance), ``euphonium`` (Zhong et al.
2026) and ``satisdive``. In a config ``sampler: {name: fk, lam: 10}`` (``sampler.lam=10``, or the option ``--lam
10``); a sampler of one's own is one ``@register_sampler("mine", config=MySettings)`` class (``base``'s docstring).
"""

from flowalign.inference.base import (
    NEEDS,
    RGS_GRADIENTS,
    SAMPLERS,
    GradientSettings,
    GradientSource,
    GuidedProblem,
    GuidedSampler,
    NoSettings,
    SDESettings,
    check_process_reward,
    register_sampler,
)
# The built-in samplers, in the order they are listed (importing a module registers its sampler).
from flowalign.inference.best_of_n import BestOfN, OneSample
from flowalign.inference.fk import FKSettings, FKSteering
from flowalign.inference.dts import DiffusionTreeSearch, DTSSettings
from flowalign.inference.rgs import RewardGradient, RGSSettings, gradient_guide
from flowalign.inference.euphonium import EuphoniumGuided, EuphoniumSettings
from flowalign.inference.satisdive import SatisDive, SatisDiveSettings

__all__ = ["NEEDS", "RGS_GRADIENTS", "SAMPLERS", "BestOfN", "DTSSettings", "DiffusionTreeSearch", "EuphoniumGuided",
           "EuphoniumSettings", "FKSettings", "FKSteering", "GradientSettings", "GradientSource", "GuidedProblem",
           "GuidedSampler", "NoSettings", "OneSample", "RGSSettings", "RewardGradient", "SDESettings", "SatisDive",
           "SatisDiveSettings", "check_process_reward", "gradient_guide", "register_sampler"]
