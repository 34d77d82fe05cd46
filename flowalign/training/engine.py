"""Deprecated: the DDP and FSDP2 engines moved to ``flowalign.training.parallel_engines``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.training.parallel_engines`` and warns; it goes in the next release.
"""

import warnings

from flowalign.training.parallel_engines import *  # noqa: F401,F403

warnings.warn("flowalign.training.engine is deprecated: import flowalign.training.parallel_engines instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
