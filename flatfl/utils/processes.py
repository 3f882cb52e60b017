"""Local worker processes, one recipe for every pool flatfl starts (the sweep's executor, the loss surface's
points).

* :func:`start_method`: the multiprocessing start method asked for (checked), or the default one given.
* :func:`watch_parent`: run in a worker: it exits as soon as its parent is gone (killed included), so that no
  orphan keeps computing and writing.
* :func:`worker_pool`: a ``concurrent.futures`` process pool whose workers watch their parent, ignore Ctrl-C and
  then run the caller's initializer; a failure or Ctrl-C in the parent cancels what has not started and stops
  every worker (SIGTERM, then SIGKILL) before it returns, so that the parent alone reports the interruption.
* :func:`interrupts_held`: SIGINT blocked in the calling thread meanwhile; a process started then inherits the
  block, so that a terminal's Ctrl-C (sent to the whole process group) never interrupts a worker's start-up."""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterator

from ..errors import ConfigError

__all__ = ["start_method", "watch_parent", "worker_pool", "interrupts_held", "stop_processes"]

#: seconds a worker is given to end after SIGTERM before it is killed (see :func:`stop_processes`)
STOP_GRACE_SECONDS = 3.0


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


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT blocked in this thread meanwhile (where the platform has ``pthread_sigmask``): a process forked or
    spawned now starts with SIGINT blocked, and a SIGINT that came meanwhile is delivered on leaving."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _ignore_interrupts() -> None:
    """In a worker: Ctrl-C is the parent's to handle (it stops the workers), then the block set by
    :func:`interrupts_held` is lifted (a SIGINT pending meanwhile is discarded with it)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _held_start(base):
    def start(self) -> None:
        with interrupts_held():
            base.start(self)

    return start


def _held_context(method: str):
    """The multiprocessing context of ``method`` whose processes start with SIGINT held (:func:`interrupts_held`).
    The process classes are module-level, since ``spawn`` and ``forkserver`` pickle the process object."""
    import multiprocessing

    held = _HELD_CONTEXTS.get(method)
    return held() if held is not None else multiprocessing.get_context(method)


def _make_held_contexts() -> dict:
    from multiprocessing import context

    out = {}
    for method, ctx_name, proc_name in (("spawn", "SpawnContext", "SpawnProcess"),
                                        ("fork", "ForkContext", "ForkProcess"),
                                        ("forkserver", "ForkServerContext", "ForkServerProcess")):
        ctx_cls, proc_cls = getattr(context, ctx_name, None), getattr(context, proc_name, None)
        if ctx_cls is None or proc_cls is None:
            continue
        held_proc = type(f"Held{proc_name}", (proc_cls,), {"start": _held_start(proc_cls),
                                                              "__module__": __name__})
        globals()[held_proc.__name__] = held_proc  # importable by name: spawn unpickles it in the child
        out[method] = type(f"Held{ctx_name}", (ctx_cls,), {"Process": held_proc, "__module__": __name__})
    return out


_HELD_CONTEXTS = _make_held_contexts()


def stop_processes(processes, grace: float = STOP_GRACE_SECONDS) -> None:
    """End ``processes`` (multiprocessing ``Process`` objects): SIGTERM, ``grace`` seconds to exit, then
    SIGKILL; returns once each is gone."""
    import time

    processes = [p for p in processes if p is not None]
    for p in processes:
        try:
            if p.is_alive():
                p.terminate()
        except (OSError, ValueError, AssertionError):  # already gone, or closed
            pass
    deadline = time.monotonic() + grace
    for p in processes:
        try:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        except (OSError, ValueError, AssertionError):
            pass


def _thread_lock_for_progress_bars() -> None:
    """In a worker: tqdm's bars lock with a thread lock, not the multiprocessing lock tqdm makes by default, a named
    semaphore that a worker stopped by SIGTERM could not release (the resource tracker would then warn of a
    "leaked semaphore" as the command ends). A worker's bars are its own, so a thread lock is enough."""
    import threading

    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _start_worker(parent_pid: int, initializer, initargs) -> None:
    _ignore_interrupts()
    watch_parent(parent_pid)
    _thread_lock_for_progress_bars()
    if initializer is not None:
        initializer(*initargs)


@contextlib.contextmanager
def worker_pool(workers: int, method: str = "spawn", initializer: Callable | None = None,
                initargs: tuple = ()) -> Iterator[ProcessPoolExecutor]:
    """A pool of ``workers`` processes started with ``method``; each ignores Ctrl-C, watches this process, then
    runs ``initializer(*initargs)`` (with ``fork`` the arguments are inherited, not pickled). Leaving the block by
    an exception (Ctrl-C included) cancels the tasks not started and stops every worker before it propagates."""
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=_held_context(method),
                               initializer=_start_worker, initargs=(os.getpid(), initializer, initargs))
    try:
        yield pool
    except BaseException:
        import signal
        import threading

        # the workers ignore SIGINT: they are stopped here, with a second Ctrl-C held back meanwhile
        processes = list((getattr(pool, "_processes", None) or {}).values())
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            pool.shutdown(wait=False, cancel_futures=True)
            stop_processes(processes)
        finally:
            if main:
                signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
        raise
    pool.shutdown(wait=True)
