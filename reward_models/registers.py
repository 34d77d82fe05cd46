"""Deprecated: the latent reward registers moved to ``flowalign.reward_models.latent_registers``
in 0.2 (docs/reference/moved.md).

This module only re-exports ``flowalign.reward_models.latent_registers`` and warns; it goes in the next release.
"""

import warnings

from flowalign.reward_models.latent_registers import *  # noqa: F401,F403

warnings.warn("flowalign.reward_models.registers is deprecated: "
              "import flowalign.reward_models.latent_registers instead "
              "(the old path goes in the next release)",
              DeprecationWarning, stacklevel=2)
