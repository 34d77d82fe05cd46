"""Deprecated: DenseGRPO's noise calibration moved to ``flowalign.prep.calibrate``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.prep.calibrate`` and warns; it goes in the next release.
"""

import warnings

from flowalign.prep.calibrate import *  # noqa: F401,F403

warnings.warn("flowalign.training.calibrate is deprecated: import flowalign.prep.calibrate instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
