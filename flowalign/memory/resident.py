"""A process's resident memory from ``/proc``, and the peak since a point in its life (Linux).

``VmHWM`` is the peak resident set size; writing ``5`` to ``/proc/<pid>/clear_refs`` resets it to the current RSS
(Linux 4.0+, ``proc(5)``), so ``reset_peak`` then ``resident(pid)["VmHWM"]`` measure the peak of what ran in
between, not of the process's whole life as ``getrusage``'s ``ru_maxrss`` does.

The kernel's counters behind both are exact to a grain. Before Linux 6.2 each thread batches its page faults and
folds them into the process's count every 64 faults: a thread's last 63 faults may be missing, 252 KiB in 4 KiB pages
but up to 126 MiB in 2 MiB transparent huge pages (which numpy and torch ask for on large buffers). From 6.2 the
counters are per-CPU with a batch of ``max(32, 2 * CPUs)`` pages. A figure here is a lower bound to that grain; a
check that needs it exact allocates in 4 KiB pages (``MADV_NOHUGEPAGE``), as ``tests/test_resident_memory.py`` does.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["resident", "reset_peak"]


def resident(pid: int | None = None) -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (its peak) of process ``pid`` (None: this one), in bytes."""
    status = Path(f"/proc/{pid or os.getpid()}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def reset_peak(pid: int | None = None) -> int:
    """Reset process ``pid``'s (None: this one's) peak RSS to its RSS now; returns that RSS in bytes."""
    Path(f"/proc/{pid or os.getpid()}/clear_refs").write_text("5")
    return resident(pid)["VmRSS"]
