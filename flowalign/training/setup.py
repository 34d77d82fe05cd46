"""Deprecated: this module is ``flowalign.training.builder`` now (``setup`` is a name Python's packaging
reserves). This path re-exports its names, warns, and goes in the next release."""

import warnings

from flowalign.training.builder import (  # noqa: F401
    build_rewards,
    check_prompts_fit_model,
    check_prompts_fit_rewards,
    enable_xformers,
    load_flow_model,
    load_policy,
)

__all__ = ["build_rewards", "check_prompts_fit_model", "check_prompts_fit_rewards", "enable_xformers", "load_policy"]

warnings.warn("flowalign.training.setup is now flowalign.training.builder; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)
