"""Deprecated: the tool that trains latent reward registers moved to ``flowalign.prep.train_registers``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.prep.train_registers`` and warns; it goes in the next release.
"""

import warnings

from flowalign.prep.train_registers import *  # noqa: F401,F403

warnings.warn("flowalign.training.registers is deprecated: import flowalign.prep.train_registers instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
