"""What a person watching a run sees: the library's log records (loggers under ``flowalign``, INFO and above) as
plain lines on stdout, the same in a terminal, under ``flowalign`` and in a notebook.

The command line calls ``show_library_logs()`` before it runs a command. ``Trainer.train()`` calls
``show_library_logs(unless_configured=True)``: a process in which nobody configured logging (a notebook, a script)
then shows the same lines as the terminal, and one that did (``logging.basicConfig``, a handler of its own on the
``flowalign`` logger, pytest's capture) keeps its own configuration untouched.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["StdoutLines", "show_library_logs"]


class StdoutLines(logging.Handler):
    """Log records as bare message lines on the current ``sys.stdout`` (looked up per record, so a redirected or
    captured stdout, a notebook cell's included, is honoured): the library's progress lines, which it logs, print
    as they did when it printed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report through handleError, never raise
            self.handleError(record)


def show_library_logs(*, unless_configured: bool = False) -> None:
    """Show the ``flowalign`` loggers' INFO and above on stdout (once per process; a level already set is kept).

    ``unless_configured``: do nothing when logging already has somewhere to go (a handler on the ``flowalign`` logger
    or on the root logger), so that a program's own configuration is never doubled or overridden."""
    logger = logging.getLogger("flowalign")
    if unless_configured and (logger.handlers or logging.getLogger().handlers):
        return
    if not any(isinstance(handler, StdoutLines) for handler in logger.handlers):
        logger.addHandler(StdoutLines())
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
