"""Local worker processes, one recipe for every pool flatfl starts (the sweep's executor, the loss surface's
points).

* :func:`start_method`: the multiprocessing start method asked for (checked), or the default one given.
* :func:`watch_parent`: run in a worker: it exits as soon as its parent is gone (killed included), so that no
  orphan keeps computing and writing.
* :func:`worker_pool`: a ``concurrent.futures`` process pool whose workers watch their parent, then run the
  caller's initializer; a failure or Ctrl-C in the parent cancels what has not started and returns at once
  (the workers get the same Ctrl-C and stop)."""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterator

from ..errors import ConfigError

__all__ = ["start_method", "watch_parent", "worker_pool"]


def start_method(requested: str | None, default: str = "spawn") -> str:
    """``requested`` when this platform has it (a ConfigError naming the available ones otherwise), else
    ``default`` (``fork`` falls back to ``spawn`` where there is no fork)."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    if requested is not None:
        if requested not in methods:
            raise ConfigError(f"start method {requested!r} is not available here; choose one of {', '.join(methods)}")
        return requested
    return default if default in methods else "spawn"


def watch_parent(parent_pid: int, interval: float = 0.5) -> None:
    """In a worker process: exit as soon as the parent is gone, killed included, so that no orphan keeps working
    and writing. Linux: the kernel sends SIGKILL (PR_SET_PDEATHSIG); elsewhere a daemon thread polls."""
    import threading
    import time

    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def poll():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(interval)

    threading.Thread(target=poll, name="flatfl-watch-parent", daemon=True).start()


def _start_worker(parent_pid: int, initializer, initargs) -> None:
    watch_parent(parent_pid)
    if initializer is not None:
        initializer(*initargs)


@contextlib.contextmanager
def worker_pool(workers: int, method: str = "spawn", initializer: Callable | None = None,
                initargs: tuple = ()) -> Iterator[ProcessPoolExecutor]:
    """A pool of ``workers`` processes started with ``method``; each watches this process, then runs
    ``initializer(*initargs)`` (with ``fork`` the arguments are inherited, not pickled)."""
    import multiprocessing

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context(method),
                               initializer=_start_worker, initargs=(os.getpid(), initializer, initargs))
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
