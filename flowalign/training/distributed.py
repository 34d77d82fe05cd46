"""Deprecated: the launch checks and collectives moved to ``flowalign.training.collectives``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.training.collectives`` and warns; it goes in the next release.
"""

import warnings

from flowalign.training.collectives import *  # noqa: F401,F403

warnings.warn("flowalign.training.distributed is deprecated: import flowalign.training.collectives instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
