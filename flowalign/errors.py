"""Which failures are the user's: set-up errors, reported without a traceback, and everything else.

A command has two phases. *Set-up* reads the config, checks files and the run directory and loads the model; a
mistake there (a key out of range, a missing directory, a checkpoint that does not fit) is the user's to fix, so the
command line prints ``flowalign: error: ...`` and exits with status 2. Once the work has begun (iteration 200 of a
training run, say), a failure is a bug or a crash: it keeps its traceback and a non-2 exit status.

``SetupError`` is a ``ValueError``, so Python callers that catch ``ValueError`` keep working. ``setup_phase()`` marks
a block as set-up: the ``ValueError``, ``FileNotFoundError`` and ``NotADirectoryError`` raised inside it become
``SetupError`` (chained, so ``--debug``-style inspection still finds the original).

Two more kinds of failure have their own type:

* ``RunStopped``: a failure during the work that cannot pass by itself and that the user must fix (a reward server
  that answers 401 or 404 in the middle of a run, a diverging run whose loss, weights or samples are no longer
  finite). The newest checkpoint is whole (the trainer saves its last whole iteration, or keeps its last finite
  one), and the command line prints ``flowalign: stopped: <message>`` on one line and exits with status 1, without a traceback.
* ``RewardInputError``: a reward's way of saying that the *input* it was given is wrong (a GenEval reward without the
  ``tag`` in a sample's metadata), as opposed to a fault of its own. The reward server answers it with 422, which
  its client does not retry.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["RewardInputError", "RunStopped", "SetupError", "setup_phase"]


class SetupError(ValueError):
    """A mistake in the user's input found before the work starts (config, files, run directory, model)."""


class RunStopped(RuntimeError):
    """A failure during the work that ends the run cleanly (a reward server that refuses for good, a diverging run):
    the newest checkpoint is whole and resumable, one line is printed, exit status 1 (module docstring). The message
    is the whole line: what failed, where, and what to do."""

    exit_status = 1


class RewardInputError(ValueError):
    """A reward refuses its input (images, prompts or metadata), not a fault of the reward itself (module
    docstring). The message names the sample and the field; it must not name files of the machine that scores."""


@contextmanager
def setup_phase() -> Iterator[None]:
    """Within this block, ``ValueError`` / ``FileNotFoundError`` / ``NotADirectoryError`` are user errors."""
    try:
        yield
    except SetupError:
        raise
    except (ValueError, FileNotFoundError, NotADirectoryError) as error:
        raise SetupError(str(error)) from error
