"""What a person watching a run sees: the library's log records (loggers under ``flowalign``, INFO and above) as
plain lines on stdout, the same in a terminal, under ``flowalign`` and in a notebook.

The command line calls ``show_library_logs()`` before it runs a command. ``Trainer.train()`` calls
``show_library_logs(unless_configured=True)``: a process in which nobody configured logging (a notebook, a script)
then shows the same lines as the terminal, and one that did (``logging.basicConfig``, a handler of its own on the
``flowalign`` logger, pytest's capture) keeps its own configuration untouched.

Without ``-v`` the command line also keeps the libraries' own noise out (``command_line_session``): diffusers' and
transformers' deprecation warnings, and their loading bars while a model loads (``loading_quietly``). A notebook or a
script asks for the same with ``quiet_libraries()``, for the rest of its process.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from contextlib import contextmanager

__all__ = ["StdoutLines", "callers_words", "command_line_session", "loading_quietly", "quiet_libraries",
           "show_library_logs"]


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


_quiet_loading = False  # inside a command-line session without -v (command_line_session)
_command_line = False  # inside a command-line session (callers_words)


@contextmanager
def command_line_session(*, verbose: bool = False):
    """A command of ``flowalign`` runs inside this: advice is worded for the command line (``callers_words``) and,
    without ``verbose`` (``-v``), diffusers' and transformers' deprecation warnings (``FutureWarning``) are not shown
    and a model loads without their progress bars (``loading_quietly``), so that flowalign's output is its own lines
    and bars. Everything is as it was afterwards (a test that runs ``main`` leaves the process unchanged)."""
    global _quiet_loading, _command_line
    before = _quiet_loading, _command_line
    with warnings.catch_warnings():
        if not verbose:
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"(diffusers|transformers)(\.|$)")
        _quiet_loading, _command_line = not verbose, True
        try:
            yield
        finally:
            _quiet_loading, _command_line = before


@contextmanager
def loading_quietly():
    """Load a model inside this: in a command-line session without ``-v``, diffusers' and transformers' progress
    bars are off while it loads (and as they were afterwards); otherwise nothing changes."""
    if not _quiet_loading:
        yield
        return
    switches = []
    for module in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            logging_module = importlib.import_module(module)
        except ImportError:
            continue
        switches.append((logging_module, logging_module.is_progress_bar_enabled()))
        logging_module.disable_progress_bar()
    try:
        yield
    finally:
        for logging_module, enabled in switches:
            if enabled:
                logging_module.enable_progress_bar()


def quiet_libraries() -> None:
    """For a notebook or a script, for the rest of the process: what the command line shows without ``-v``.

    diffusers' and transformers' deprecation warnings (``FutureWarning``) and their warnings below ERROR (such as
    "No LoRA keys associated to ...") are not shown, nor their loading and sampling bars, nor tqdm's note that a
    notebook lacks ipywidgets; flowalign's own lines and its training bar stay. Call it before the first model loads
    (tqdm's note comes when diffusers is first imported)."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(diffusers|transformers)(\.|$)")
    warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm.auto in a notebook without ipywidgets
    for module in ("diffusers.utils.logging", "transformers.utils.logging"):
        try:
            logging_module = importlib.import_module(module)
        except ImportError:
            continue
        logging_module.disable_progress_bar()
        logging_module.set_verbosity_error()


def callers_words(command_line: str, python: str) -> str:
    """Advice in the words of whoever runs flowalign: ``command_line`` inside a command-line session, else
    ``python`` (a script, or a notebook cell run again, which sets ``config.train...`` attributes and builds a new
    Trainer)."""
    return command_line if _command_line else python
