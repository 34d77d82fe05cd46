"""How a run stops before its last iteration, with the checkpoint of its last whole iteration saved.

* On SIGINT or SIGTERM (``stop_on_signals``): the handler only records the request (``trainer.stop_requested``, and
  ``trainer.stop_signal``, from which the command line exits ``128 + signum``); the loop finishes the iteration, the
  processes agree to stop, and it saves and leaves.
* On a ``RunStopped`` raised inside an iteration (a reward server that refuses for good): ``stopped_with_checkpoint``
  saves the last whole iteration (the failed one changed no weight) and says which one and how to resume.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

from flowalign.errors import RunStopped

__all__ = ["STOP_SIGNALS", "stop_on_signals", "stopped_with_checkpoint"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals(trainer) -> Iterator[None]:
    """A block in which SIGINT and SIGTERM ask ``trainer`` to stop after the current iteration; the previous handlers
    come back afterwards."""

    def request_stop(signum, frame) -> None:
        trainer.stop_requested, trainer.stop_signal = True, signum

    previous = {s: signal.signal(s, request_stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stopped_with_checkpoint(trainer, stopped: RunStopped) -> RunStopped:
    """For a ``RunStopped`` inside an iteration: save the checkpoint of the last whole iteration (unless it is on disk
    already) and return the error to raise, whose message adds which one was saved and how to resume."""
    path = trainer.out_dir / f"checkpoint-{trainer.iteration:06d}"
    if not path.is_dir():
        trainer.checkpointer.save()
    return RunStopped(f"{stopped}; the run stopped in iteration {trainer.iteration} with {path.name} saved: resume "
                      "with train.resume=latest once that is fixed")
