"""Deprecated: the files of a checkpoint moved to ``flowalign.training.checkpoint_files``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.training.checkpoint_files`` and warns; it goes in the next release.
"""

import warnings

from flowalign.training.checkpoint_files import *  # noqa: F401,F403

warnings.warn("flowalign.training.checkpoint is deprecated: import flowalign.training.checkpoint_files instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
