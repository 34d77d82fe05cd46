"""Deprecated: Shell-LCC's manifold fit moved to ``flowalign.prep.fit_manifold``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.prep.fit_manifold`` and warns; it goes in the next release.
"""

import warnings

from flowalign.prep.fit_manifold import *  # noqa: F401,F403

warnings.warn("flowalign.training.manifold is deprecated: import flowalign.prep.fit_manifold instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
