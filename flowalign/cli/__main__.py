"""``python -m flowalign.cli`` (what torchrun and ``accelerate launch -m`` run): the ``flowalign`` command."""

import sys

from flowalign.cli import main

sys.exit(main())
