"""How many intra-op threads torch runs with: the CPUs this process may actually use, or ``train.threads``.

torch's default is one OpenMP thread per physical core of the machine, whatever share of it the process gets. Where
the process is confined to fewer CPUs (``taskset``, a container's ``cpuset``) or to a CPU quota (a container's
``--cpus``: cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us``), the extra threads wait for each other: OpenMP
threads spin at every barrier while their partner is descheduled. On this project's 2-core machines a toy run beside
one other busy process took 62-70 s an iteration with 2 threads and 10.4 s with 1.

``train.threads: null`` (auto) lowers torch's count to the CPUs free to the process:

    free = max(1, min(len(sched_getaffinity(0)), floor(quota / period)))

over every cgroup quota from the process's cgroup up to the root (the tightest holds), and never raises it (nor
touches a count the user chose with ``OMP_NUM_THREADS``). ``train.threads: N`` sets N. Neither sees other processes'
load on CPUs the process is allowed: on a machine shared without quotas, set ``train.threads: 1`` (or export
``OMP_NUM_THREADS=1``).

The count can change a run's floats (a reduction split over another number of threads adds in another order); what
1 and 2 threads did on this project's machine is in docs/guides/training.md ("Threads on a shared CPU").
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_cpu_max(text: str) -> float | None:
    """The CPUs a cgroup v2 ``cpu.max`` allows: ``"$MAX $PERIOD"`` is ``MAX / PERIOD`` CPUs, ``"max ..."`` no limit.

    Args:
        text: the file's content, e.g. ``"150000 100000"`` (1.5 CPUs) or ``"max 100000"``.

    Returns:
        The quota in CPUs, or None for no limit.

    Raises:
        ValueError: not two fields, or numbers that are not positive integers.
    """
    fields = text.split()
    if len(fields) != 2:
        raise ValueError(f"cpu.max holds {text!r}: expected '$MAX $PERIOD' (e.g. '150000 100000' or 'max 100000')")
    quota, period = fields
    if not period.isdigit() or int(period) <= 0:
        raise ValueError(f"cpu.max holds {text!r}: its period {period!r} is not a positive integer")
    if quota == "max":
        return None
    if not quota.isdigit() or int(quota) <= 0:
        raise ValueError(f"cpu.max holds {text!r}: its quota {quota!r} is neither 'max' nor a positive integer")
    return int(quota) / int(period)


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """The CPUs a cgroup v1 CFS quota allows: ``cpu.cfs_quota_us / cpu.cfs_period_us``; a quota of -1 is no limit.

    Args:
        quota: ``cpu.cfs_quota_us``'s content (``"-1"`` or microseconds).
        period: ``cpu.cfs_period_us``'s content (microseconds).

    Returns:
        The quota in CPUs, or None for no limit.

    Raises:
        ValueError: numbers that are not integers, or a non-positive period.
    """
    quota_us, period_us = int(quota.strip()), int(period.strip())
    if period_us <= 0:
        raise ValueError(f"cpu.cfs_period_us holds {period.strip()!r}: not a positive period")
    return None if quota_us < 0 else quota_us / period_us


def free_cpus(affinity: int, quotas: list[float]) -> int:
    """The threads that fit: the CPUs the process may run on, capped by the tightest quota (rounded down: a thread
    beyond a quota's whole CPUs is throttled), at least 1.

    Args:
        affinity: how many CPUs the process's affinity mask holds.
        quotas: the CPU quotas that apply (in CPUs; none: no quota).

    Returns:
        The thread count, at least 1.
    """
    count = affinity
    for quota in quotas:
        count = min(count, math.floor(quota))
    return max(1, count)


def cgroup_quotas(root: Path = CGROUP_ROOT, self_cgroup: Path = Path("/proc/self/cgroup")) -> list[float]:
    """The CPU quotas over this process: cgroup v2's ``cpu.max`` of its cgroup and each parent, else cgroup v1's
    CFS quota. Files that are absent or unreadable are skipped (no quota known is no quota).

    Args:
        root: where the cgroup filesystem is mounted.
        self_cgroup: the process's cgroup membership file.

    Returns:
        The quotas in CPUs (empty: none).
    """
    quotas: list[float] = []
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    unified = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), "/")
    folder = root / unified.lstrip("/")
    for path in [folder, *folder.parents]:
        if root not in (path, *path.parents):
            break
        try:
            quota = parse_cpu_max((path / "cpu.max").read_text())
        except (OSError, ValueError):
            continue
        if quota is not None:
            quotas.append(quota)
    if not quotas:
        for v1 in (root / "cpu", root / "cpu,cpuacct"):
            try:
                quota = parse_cfs_quota((v1 / "cpu.cfs_quota_us").read_text(), (v1 / "cpu.cfs_period_us").read_text())
            except (OSError, ValueError):
                continue
            if quota is not None:
                quotas.append(quota)
                break
    return quotas


def affinity_count() -> int:
    """How many CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where the platform lacks
    it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(configured: int | None, current: int, env: dict | None = None) -> tuple[int, str]:
    """The intra-op thread count and why.

    Args:
        configured: ``train.threads`` (None: auto).
        current: torch's count now.
        env: the environment (default ``os.environ``): a set ``OMP_NUM_THREADS`` is the user's choice under auto.

    Returns:
        ``(threads, reason)``.
    """
    if configured is not None:
        return configured, "train.threads"
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return current, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    affinity, quotas = affinity_count(), cgroup_quotas()
    free = free_cpus(affinity, quotas)
    reason = f"{affinity} CPUs in the affinity mask" + (f", a cgroup quota of {min(quotas):g} CPUs" if quotas else "")
    return min(current, free), reason


def set_threads(configured: int | None) -> int:
    """Set torch's intra-op thread count for a run (``choose_threads``) and log it.

    Args:
        configured: ``train.threads`` (None: auto).

    Returns:
        The count set.
    """
    import torch

    current = torch.get_num_threads()
    threads, reason = choose_threads(configured, current)
    if threads != current:
        torch.set_num_threads(threads)
    logger.info("torch intra-op threads: %d (%s; torch's count was %d)", threads, reason, current)
    return threads
