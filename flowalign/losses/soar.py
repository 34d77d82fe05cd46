"""Deprecated: SOAR's math moved to ``flowalign.objectives.soar_math``, next to its objective (release 0.2). This module
re-exports it for one release and warns on import; it goes in the release after."""

import warnings

from flowalign.objectives.soar_math import (AuxPoints, ROLLOUT_KINDS, aux_model_sigma, aux_sigmas, clean_boundary,
                                            next_time, rollout_step, soar_aux_points, soar_loss, table_sigma,
                                            training_table)

__all__ = ["AuxPoints", "ROLLOUT_KINDS", "aux_model_sigma", "aux_sigmas", "clean_boundary", "next_time",
           "rollout_step", "soar_aux_points", "soar_loss", "table_sigma", "training_table"]

warnings.warn("flowalign.losses.soar moved to flowalign.objectives.soar_math; import it from there "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
