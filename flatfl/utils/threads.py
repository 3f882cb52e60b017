"""How many torch threads a compute command uses (``--threads N``, config key ``threads``).

torch's own default is one intra-op thread per core. When another process already keeps a core busy, those threads
wait for each other at every parallel region and small models slow down many times over (``benchmarks/threads_contention.py``
measures it; docs/performance.md). The default here therefore counts only the cores that are idle now:

* machines with at most 2 cores: 1 thread;
* otherwise: the usable cores minus the busy ones, divided among ``workers`` processes, at least 1. Busy cores are
  the larger of the 1-minute load average and the cores in use over the last 50 ms (``/proc/stat``, Linux), rounded:
  the load average alone lags a competitor started seconds ago by a minute.

:func:`apply_threads` sets both torch's intra-op and, where torch still allows it (before the first parallel
region), its inter-op thread count.
"""
from __future__ import annotations

import os

from ..errors import ConfigError

__all__ = ["usable_cores", "default_threads", "check_threads", "apply_threads"]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS reports it, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _load_average() -> float:
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):  # not available (Windows): assume an idle machine
        return 0.0


def _busy_now(seconds: float = 0.05) -> float:
    """Cores busy over the next ``seconds`` (all processes), from /proc/stat; 0.0 where it cannot be read."""
    import time

    def snapshot():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total0, idle0 = snapshot()
        time.sleep(seconds)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        return 0.0
    if total1 <= total0:
        return 0.0
    ncpu = os.cpu_count() or 1
    return ncpu * (1.0 - (idle1 - idle0) / (total1 - total0))


def default_threads(workers: int = 1, *, cores: int | None = None, load: float | None = None) -> int:
    """Threads per process for ``workers`` processes started now: 1 on <= 2 cores, else the idle cores
    (cores minus the busy ones: the larger of the 1-minute load average and the cores busy right now, rounded)
    shared among the workers, at least 1. ``cores`` and ``load`` (busy cores) override the measurement."""
    cores = usable_cores() if cores is None else int(cores)
    if cores <= 2:
        return 1
    load = max(_load_average(), _busy_now()) if load is None else float(load)
    idle = min(cores, max(0, cores - int(load + 0.5)))
    return max(1, idle // max(1, int(workers)))


MAX_THREADS = 1024


def check_threads(value, what: str = "--threads") -> int | None:
    """``None`` (automatic) or an integer >= 1; anything else is a :class:`ConfigError` naming ``what``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    if value < 1:
        raise ConfigError(f"{what} must be a positive integer (>= 1), got {value}")
    if value > MAX_THREADS:
        raise ConfigError(f"{what} must be at most {MAX_THREADS}, got {value}")
    return value


def apply_threads(threads: int | None = None, what: str = "--threads") -> int:
    """Set torch's thread counts to ``threads`` (``None``: :func:`default_threads`); returns the count used."""
    import torch

    n = check_threads(threads, what)
    if n is None:  # under torchrun, the ranks on this machine share its idle cores
        local_ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
        n = default_threads(int(local_ranks) if local_ranks.isdigit() and int(local_ranks) > 0 else 1)
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(n)
    except RuntimeError:  # only allowed before torch's first inter-op parallel work in this process
        pass
    return n
