"""Deprecated: ``add_train_discriminator`` moved to ``flowalign.cli.prep`` in 0.2 (docs/reference/moved.md).

This module only re-exports it and warns; it goes in the next release.
"""

import warnings

from .prep import add_train_discriminator

__all__ = ["add_train_discriminator"]

warnings.warn("flowalign.cli.discriminator is deprecated: import flowalign.cli.prep instead "
              "(the old path goes in the next release)", DeprecationWarning, stacklevel=2)
