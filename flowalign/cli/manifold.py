"""Deprecated: ``add_fit_manifold`` moved to ``flowalign.cli.prep`` in 0.2 (docs/reference/moved.md).

This module only re-exports it and warns; it goes in the next release.
"""

import warnings

from .prep import add_fit_manifold

__all__ = ["add_fit_manifold"]

warnings.warn("flowalign.cli.manifold is deprecated: import flowalign.cli.prep instead "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
