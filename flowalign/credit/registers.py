"""Deprecated: the credit estimator from latent reward registers moved to ``flowalign.credit.register_grpo``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.credit.register_grpo`` and warns; it goes in the next release.
"""

import warnings

from flowalign.credit.register_grpo import *  # noqa: F401,F403

warnings.warn("flowalign.credit.registers is deprecated: import flowalign.credit.register_grpo instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
