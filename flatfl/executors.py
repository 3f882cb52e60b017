"""Where independent tasks run: in this process, in a local process pool, or as Ray tasks (docs/reproductions.md,
"Sweeps").

A task is ``fn(item)`` with a module-level ``fn`` and a picklable ``item``; tasks share nothing but the file system.
Every executor yields one :class:`Outcome` per item, in completion order, and never stops at a failed task: the
failure is recorded (one line for a :class:`~flatfl.errors.FlatflError`, the traceback for anything else) and the
other tasks go on. Seeding is the task's business (each run seeds itself from its config), so results do not depend
on the executor or on the order in which tasks finish.

* :class:`LocalExecutor` ``(workers=1)``: serial in this process, or a ``spawn`` pool of ``workers``
  (:func:`flatfl.utils.processes.worker_pool`, the pool the loss surface uses too). A worker killed mid-task
  breaks the pool; the tasks lost with it run again in a fresh pool, then one pool each, so that only a task that
  kills its worker every time fails (one line), and the others finish.
* :class:`RayExecutor` ``(address=None, num_cpus=None, cpus_per_task=1, gpus_per_task=0)``: one Ray task per item,
  on a local Ray instance (``ray.init(num_cpus=...)``) or on the cluster at ``address`` / ``$RAY_ADDRESS``
  (``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the others). Paths in the items must
  be visible to every node (a shared file system); relative paths are the caller's to make absolute. A task lost
  with its node is retried (``max_retries``); the runs resume from their last checkpoint.
* :func:`make_executor` ``(name, workers=1, address=None, gpus_per_task=0)``: by name, for the command line.
"""
from __future__ import annotations

import multiprocessing
import os
import traceback
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from .errors import ConfigError, FlatflError

POOL_POLL_SECONDS = 5.0  # how often a process pool's progress is checked (see LocalExecutor._pool_pass)

__all__ = ["Outcome", "LocalExecutor", "RayExecutor", "make_executor", "EXECUTORS", "default_threads"]

EXECUTORS = ("local", "ray")


@dataclass
class Outcome:
    """What became of item ``index``: its ``result``, or ``error`` (one line) and ``details`` (a traceback)."""

    index: int
    result: Any = None
    error: str | None = None
    details: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _failure(index: int, exc: BaseException) -> Outcome:
    if isinstance(exc, FlatflError):
        return Outcome(index, error=str(exc))
    details = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Outcome(index, error=f"{type(exc).__name__}: {exc}", details=details)


def default_threads(workers: int) -> int:
    """Torch threads per task when ``workers`` tasks share this machine.

    The rule of every compute command (:func:`flatfl.utils.threads.default_threads`): 1 on up to 2 cores, else the
    idle cores (cores minus the 1-minute load average) shared among the workers, at least 1: oversubscribed threads
    slow every task down many times over (docs/performance.md).
    """
    from .utils.threads import default_threads as idle_share

    return idle_share(workers)


class LocalExecutor:
    """Serial (``workers=1``) or a process pool of ``workers`` (``spawn``: safe with torch's threads)."""

    name = "local"

    def __init__(self, workers: int = 1):
        if not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
        self.workers = workers

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Outcome]:
        items = list(items)
        if self.workers == 1 or len(items) <= 1:
            for i, item in enumerate(items):
                try:
                    yield Outcome(i, result=fn(item))
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001 - one failed task must not stop the others
                    yield _failure(i, e)
            return
        # A worker that dies (kill -9, the out-of-memory killer) breaks the whole pool: every task it had not
        # finished is lost, not failed. Lost tasks run again in a fresh pool; tasks lost twice run one pool each,
        # so that a task that kills its worker every time fails alone and the others finish.
        pending, isolated = list(range(len(items))), False
        lost_before: set[int] = set()
        while pending:
            groups = [[i] for i in pending] if isolated else [pending]
            lost: list[int] = []
            for group in groups:
                for outcome in self._pool_pass(fn, items, group, lost):
                    yield outcome
            if isolated:
                for i in lost:
                    yield Outcome(i, error=f"its worker process died (killed, or out of memory) twice; run again "
                                           "to retry it")
                return
            pending = sorted(lost)
            isolated = bool(lost_before & set(lost))
            lost_before |= set(lost)

    def _pool_pass(self, fn, items, indices: list[int], lost: list[int]) -> Iterator[Outcome]:
        """Run ``items[indices]`` in one pool; the indices lost with a dying worker are appended to ``lost``."""
        from concurrent.futures.process import BrokenProcessPool

        from .utils.processes import worker_pool

        with worker_pool(min(self.workers, len(indices)), "spawn") as pool:
            futures = {pool.submit(fn, items[i]): i for i in indices}
            remaining, idle = set(futures), 0
            try:
                while remaining:
                    done, remaining = wait(remaining, timeout=POOL_POLL_SECONDS, return_when=FIRST_COMPLETED)
                    for fut in done:
                        i = futures[fut]
                        try:
                            yield Outcome(i, result=fut.result())
                        except BrokenProcessPool:
                            lost.append(i)
                        except BaseException as e:  # noqa: BLE001
                            yield _failure(i, e)
                    # A worker killed at the wrong moment can take the pool's manager down without failing the
                    # futures it held (they would then be waited for forever): with no worker process left and
                    # nothing finishing for two polls, what is left is lost with the pool.
                    idle = 0 if done or multiprocessing.active_children() else idle + 1
                    if idle >= 2:
                        lost.extend(futures[f] for f in remaining)
                        pool.shutdown(wait=False, cancel_futures=True)
                        break
            except KeyboardInterrupt:
                for fut in futures:
                    fut.cancel()
                raise


class RayExecutor:
    """One Ray task per item. Attaches to ``address`` (or ``$RAY_ADDRESS``) when given, else starts a local Ray
    with ``num_cpus`` CPUs; a Ray already initialised in this process is used as it is."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, cpus_per_task: float = 1,
                 gpus_per_task: float = 0, max_retries: int = 3):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("the Ray executor needs Ray: pip install 'flatfl[ray]' (or pip install ray)") from None
        if cpus_per_task <= 0 or gpus_per_task < 0:
            raise ConfigError("Ray resources per task must be positive CPUs and non-negative GPUs")
        self.address = address or os.environ.get("RAY_ADDRESS") or None
        self.num_cpus = num_cpus
        self.cpus_per_task = cpus_per_task
        self.gpus_per_task = gpus_per_task
        self.max_retries = max_retries

    def _init(self):
        import ray

        if ray.is_initialized():
            return ray
        try:
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.num_cpus, log_to_driver=False, include_dashboard=False)
        except ConnectionError as e:
            raise ConfigError(f"cannot reach the Ray cluster at {self.address}: {str(e).splitlines()[0]}") from None
        return ray

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Outcome]:
        items = list(items)
        if not items:
            return
        ray = self._init()
        remote = ray.remote(num_cpus=self.cpus_per_task, num_gpus=self.gpus_per_task,
                            max_retries=self.max_retries)(fn)
        pending = {remote.remote(item): i for i, item in enumerate(items)}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    i = pending.pop(ref)
                    try:
                        yield Outcome(i, result=ray.get(ref))
                    except BaseException as e:  # noqa: BLE001
                        cause = getattr(e, "cause", None)  # RayTaskError wraps the task's own exception
                        yield _failure(i, cause if isinstance(cause, BaseException) else e)
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise


def make_executor(name: str, workers: int | None = None, address: str | None = None, gpus_per_task: float = 0):
    """The executor called ``name`` ('local' or 'ray'); ``workers`` is the pool size (local) or the CPUs of a
    local Ray instance (ray, when no cluster address is given); None means the number of CPU cores."""
    if workers is None:
        workers = os.cpu_count() or 1
    if name == "local":
        if address:
            raise ConfigError("--ray-address only applies to --executor ray")
        return LocalExecutor(workers)
    if name == "ray":
        if not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
        return RayExecutor(address=address, num_cpus=None if (address or os.environ.get("RAY_ADDRESS")) else workers,
                           gpus_per_task=gpus_per_task)
    raise ConfigError(f"unknown executor {name!r}: choose one of {', '.join(EXECUTORS)}")
