"""Which failures are the user's: set-up errors, reported without a traceback, and everything else.

A command has two phases. *Set-up* reads the config, checks files and the run directory and loads the model; a
mistake there (a key out of range, a missing directory, a checkpoint that does not fit) is the user's to fix, so the
command line prints ``flowalign: error: ...`` and exits with status 2. Once the work has begun (iteration 200 of a
training run, say), a failure is a bug or a crash: it keeps its traceback and a non-2 exit status.

``SetupError`` is a ``ValueError``, so Python callers that catch ``ValueError`` keep working. ``setup_phase()`` marks
a block as set-up: the ``ValueError``, ``FileNotFoundError`` and ``NotADirectoryError`` raised inside it become
``SetupError`` (chained, so ``--debug``-style inspection still finds the original).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["RunFailed", "SetupError", "setup_phase"]


class SetupError(ValueError):
    """A mistake in the user's input found before the work starts (config, files, run directory, model)."""


class RunFailed(RuntimeError):
    """The work began and stopped on a condition it detected and can state (a diverging run): the command line
    prints ``flowalign: error: ...`` without a traceback and exits with status 1 (no user error: not 2)."""


@contextmanager
def setup_phase() -> Iterator[None]:
    """Within this block, ``ValueError`` / ``FileNotFoundError`` / ``NotADirectoryError`` are user errors."""
    try:
        yield
    except SetupError:
        raise
    except (ValueError, FileNotFoundError, NotADirectoryError) as error:
        raise SetupError(str(error)) from error
