"""Deprecated: the built-in guided samplers moved to one module each under ``flowalign.inference`` (``best_of_n``,
``fk``, ``dts``, ``rgs``, ``euphonium``, ``satisdive``) and their shared settings to ``flowalign.inference.base``.
This shim re-exports the old names for one release (docs/reference/moved.md)."""

import warnings

from flowalign.inference.base import (
    RGS_GRADIENTS,
    GradientSettings,
    GradientSource,
    NoSettings,
    SDESettings,
    check_process_reward,
)
from flowalign.inference.best_of_n import BestOfN, OneSample
from flowalign.inference.dts import DiffusionTreeSearch, DTSSettings
from flowalign.inference.euphonium import EuphoniumGuided, EuphoniumSettings
from flowalign.inference.fk import FKSettings, FKSteering
from flowalign.inference.rgs import RewardGradient, RGSSettings, gradient_guide

warnings.warn("flowalign.inference.guided is deprecated: import the samplers from flowalign.inference (or their "
              "modules flowalign.inference.best_of_n, .fk, .dts, .rgs, .euphonium; shared settings in "
              "flowalign.inference.base); the shim goes in the next release", DeprecationWarning, stacklevel=2)

__all__ = ["BestOfN", "DTSSettings", "DiffusionTreeSearch", "EuphoniumGuided", "EuphoniumSettings", "FKSettings",
           "FKSteering", "GradientSettings", "GradientSource", "NoSettings", "OneSample", "RGSSettings",
           "RGS_GRADIENTS", "RewardGradient", "SDESettings", "check_process_reward", "gradient_guide"]
