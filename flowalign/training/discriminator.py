"""Deprecated: DRL's discriminator training moved to ``flowalign.prep.train_discriminator``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.prep.train_discriminator`` and warns; it goes in the next release.
"""

import warnings

from flowalign.prep.train_discriminator import *  # noqa: F401,F403

warnings.warn("flowalign.training.discriminator is deprecated: import flowalign.prep.train_discriminator instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
