"""Deprecated: group advantages moved to ``flowalign.advantages``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.advantages`` and warns; it goes in the next release.
"""

import warnings

from flowalign.advantages import *  # noqa: F401,F403

warnings.warn("flowalign.normalization is deprecated: import flowalign.advantages instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
