"""Named points inside a checkpoint save where the crash matrix kills (or fails) a process on purpose.

The rule: every step of the save protocol (``flowalign.training.checkpoint_files``, ``flowalign.training.checkpointer``)
calls ``kill_point(name, iteration, rank)`` once it is done; ``KILL_POINTS`` lists them in protocol order. When the
environment variable ``FLOWALIGN_FAULT`` is unset (always, outside the crash tests) a call is one dictionary look-up
and returns. Set, it reads ``<action>:<point>:<iteration>[:<rank>]`` (rank 0 by default):

* ``kill:renamed:2`` -- the main process SIGKILLs itself right after it renamed the temporary directory of
  checkpoint 2 into place (nothing after that step runs: no ``finally``, no flush, as in a power cut);
* ``fail:rng:2:1`` -- process 1 raises ``OSError(ENOSPC)`` once it has written its RNG file of checkpoint 2 (what
  a full disk does), to check that every process then ends with the error instead of waiting in a barrier.

``tests/test_crash_matrix.py`` and ``bench/crash_matrix.py`` drive it; docs/concepts/reliability.md lists the points.
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["FAULT_VARIABLE", "KILL_POINTS", "kill_point"]

FAULT_VARIABLE = "FLOWALIGN_FAULT"

# The steps of a save, in order; which process passes each is in docs/concepts/reliability.md.
KILL_POINTS = (
    "begin",  # the main process created the empty temporary directory .tmp-checkpoint-N
    "sharded",  # fsdp2: every process wrote its shards into sharded/ (torch.distributed.checkpoint)
    "exported",  # fsdp2: the diffusers-format weights were all-gathered onto the main process
    "trainable",  # ddp: trainable.safetensors written
    "ema",  # ddp: ema.safetensors written (EMA on)
    "copies",  # ddp: copies.safetensors written (policy copies kept)
    "optimizer",  # ddp: optimizer.pt written
    "rng",  # every process wrote its rng-<rank>.pt
    "state",  # state.json written
    "config",  # config.yaml written
    "components",  # components.safetensors written (a component keeps tensors)
    "model",  # lora/ or transformer/ written
    "written",  # every process agreed that all its writes succeeded (the barrier before the rename)
    "flushed",  # the main process fsynced every file of the temporary directory
    "renamed",  # the temporary directory is checkpoint-N (exchanged with an earlier save of N, if any)
    "replaced",  # re-saving N: the earlier save of N, set aside under .trash-checkpoint-N, deleted
    "prune-set-aside",  # an old checkpoint beyond train.keep_checkpoints renamed to .trash-checkpoint-M
    "pruned",  # the old checkpoints deleted
    "saved",  # every process agreed that the save finished (the last barrier)
)


def kill_point(name: str, iteration: int, rank: int = 0) -> None:
    """SIGKILL this process, or raise ``OSError(ENOSPC)``, when ``FLOWALIGN_FAULT`` names this point of this save
    on this process (module docstring); otherwise return at once."""
    spec = os.environ.get(FAULT_VARIABLE)
    if not spec:
        return
    if name not in KILL_POINTS:
        raise ValueError(f"kill point {name!r} is not in KILL_POINTS")
    action, point, at, *who = spec.split(":")
    if point != name or int(at) != int(iteration) or int(who[0] if who else 0) != int(rank):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "fail":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {FAULT_VARIABLE}={spec})")
    else:
        raise ValueError(f"{FAULT_VARIABLE}={spec!r}: the action must be kill or fail")
