"""Deprecated: adjoint matching's math moved to ``flowalign.objectives.adjoint_matching_math``, next to its objective,
and its memoryless SDE sampler to ``flowalign.samplers.memoryless`` (release 0.2). This module re-exports both for one
release and warns on import; it goes in the release after."""

import warnings

from flowalign.objectives.adjoint_matching_math import (OutlierClip, adjoint_matching_loss, lean_adjoint_step,
                                                        lean_adjoints, stratified_steps)
from flowalign.samplers.memoryless import (INTEGRATORS, Integrator, diffusion_coefficient, local_linear_coefficients,
                                           memoryless_step, sample_memoryless)

__all__ = ["INTEGRATORS", "Integrator", "OutlierClip", "adjoint_matching_loss", "diffusion_coefficient",
           "lean_adjoint_step", "lean_adjoints", "local_linear_coefficients", "memoryless_step", "sample_memoryless",
           "stratified_steps"]

warnings.warn("flowalign.losses.adjoint_matching moved: the objective's math to "
              "flowalign.objectives.adjoint_matching_math, the memoryless sampler to flowalign.samplers.memoryless; "
              "import them from there (the old path goes in the next release)", DeprecationWarning, stacklevel=2)
