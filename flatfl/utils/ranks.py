"""Several processes for one run or one analysis (docs/distributed.md): torchrun's environment, the process group,
and which rank speaks.

A command started by ``torchrun --nproc-per-node N -m flatfl ...`` (or torchrun's multi-node rendezvous) runs as N
processes, the *ranks*, which find each other through the variables torchrun sets (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Without them (or with ``WORLD_SIZE=1``) nothing here does
anything: one process, as always.

* :func:`launched` reads the environment (checked: whole numbers, ``0 <= RANK < WORLD_SIZE``) without starting
  anything; :func:`is_main` says whether this process is rank 0, the one that writes files and prints.
* :func:`join` starts the process group once the device is known: ``nccl`` for CUDA (each rank on the GPU
  ``cuda:LOCAL_RANK``), ``gloo`` otherwise; torch.distributed is the engine, flatfl opens no socket of its own.
* :func:`all_reduce_sum`, :func:`all_reduce_min`, :func:`all_gather_objects`, :func:`barrier`: the collectives the
  operators and the rounds use; each is the identity in one process. :func:`on_main` runs a step on rank 0 alone
  (a folder check) and raises its input error on every rank.
* :func:`peer_failure` recognises the error a collective raises when another rank died, so that the command line
  says it in one line; :func:`quiet_other_ranks` keeps the other ranks' output off the terminal (their errors
  still reach it, through :func:`error_stream`).
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from ..errors import ConfigError, FlatflError

__all__ = ["World", "launched", "is_main", "world", "join", "record", "all_reduce_sum", "all_reduce_min",
           "all_gather_objects", "broadcast_object", "on_main", "barrier", "leave", "peer_failure", "quiet_other_ranks",
           "error_stream", "RankStopped", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S"]

#: how long a collective waits for the other ranks before it fails (seconds; a rank that dies is noticed at once)
TIMEOUT_ENV = "FLATFL_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800


class RankStopped(FlatflError):
    """This rank was told to stop (SIGTERM: torchrun stops the others when one rank fails)."""


@dataclass(frozen=True)
class World:
    """The processes of this command: this one's ``rank`` among ``size`` (``local_rank`` on its machine) and the
    backend of the process group (None before :func:`join`, and in one process)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


_WORLD: World | None = None  # set by join()
_REAL_STDERR = None  # the terminal of a quieted rank, for its error line


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"the environment variable {name}={raw[:40]!r} is not a whole number (torchrun sets it; "
                          "unset it to run as one process)") from None
    if value < 0:
        raise ConfigError(f"the environment variable {name}={value} is negative")
    return value


def launched() -> World:
    """The world torchrun's variables describe (one process without them); starts nothing."""
    if _WORLD is not None:
        return _WORLD
    size = _env_int("WORLD_SIZE", 1)
    if size is None or size <= 1:
        return World()
    rank = _env_int("RANK", None)
    if rank is None:
        raise ConfigError(f"WORLD_SIZE={size} is set but RANK is not: start the ranks with torchrun "
                          "(torchrun --nproc-per-node N -m flatfl ...)")
    if rank >= size:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={size}")
    return World(rank=rank, size=size, local_rank=_env_int("LOCAL_RANK", 0) or 0)


def is_main() -> bool:
    """Whether this process writes files and prints: rank 0, or the only process."""
    try:
        return launched().main
    except ConfigError:
        return True


def world() -> World:
    """The world this process computes in: the ranks once :func:`join` has started the process group, else one
    process (nothing is split before the group exists)."""
    return _WORLD if _WORLD is not None else World()


def _timeout():
    import datetime

    seconds = _env_int(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    if not seconds:
        raise ConfigError(f"{TIMEOUT_ENV} must be a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def join(device):
    """Start the process group for ``device`` (a torch.device) when this command runs as several ranks, and return
    the device this rank computes on: ``cuda:LOCAL_RANK`` for CUDA (one GPU a rank), ``device`` otherwise. The same
    device in one process. Called again (a second analysis in the same process), it checks the device type agrees."""
    global _WORLD
    import torch

    w = launched()
    if not w.distributed:
        return device
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if w.local_rank >= count:
            raise ConfigError(f"rank {w.rank} is local rank {w.local_rank} but this machine has {count} GPU(s): "
                              f"start at most {count} ranks a machine (--nproc-per-node {count})")
        if device.index is not None and device.index != w.local_rank:
            raise ConfigError(f"--device {device} under torchrun: each rank computes on its own GPU (cuda:LOCAL_RANK); "
                              "give --device cuda")
        device = torch.device("cuda", w.local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    elif device.type == "cpu":
        backend = "gloo"
    else:
        raise ConfigError(f"--device {device.type} cannot run over several ranks: use cpu (gloo) or cuda (nccl)")
    import torch.distributed as dist

    if _WORLD is not None:
        if _WORLD.backend != backend:
            raise ConfigError(f"this process already computes over {_WORLD.backend}; a {device.type} analysis "
                              "cannot join it")
        return device
    if dist.is_initialized():  # started by the caller's own script (Python API)
        backend = dist.get_backend()
        if dist.get_world_size() != w.size or dist.get_rank() != w.rank:
            raise ConfigError("torch.distributed is initialized with another world than torchrun's variables say")
    else:
        options = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=_timeout(), **options)
    _WORLD = World(rank=w.rank, size=w.size, local_rank=w.local_rank, backend=backend)
    _stop_on_sigterm()
    return device


def record() -> dict:
    """What a result file says of where it was computed: world size and backend (they change no number)."""
    w = world()
    return {"world_size": w.size, "backend": w.backend}


def _stop_on_sigterm() -> None:
    """torchrun stops the other ranks with SIGTERM when one fails: end with one line, not a traceback."""
    def handler(signum, frame):
        raise RankStopped("stopped: another rank of this distributed run failed or was killed (torchrun sent "
                          "SIGTERM); nothing half-written was kept")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def _group_active() -> bool:
    return _WORLD is not None and _WORLD.distributed


def all_reduce_sum(tensor):
    """Sum ``tensor`` over the ranks, in place (and returned); the tensor itself in one process."""
    if _group_active():
        import torch.distributed as dist

        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's ``value`` (an integer)."""
    if not _group_active():
        return int(value)
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _collective_device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if _WORLD.backend == "nccl" else torch.device("cpu")


def all_gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable; tensors are best on the CPU), in rank order: ``[obj]`` in one process."""
    if not _group_active():
        return [obj]
    import torch.distributed as dist

    out = [None] * _WORLD.size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not _group_active():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn):
    """``fn()`` on rank 0 alone (a check of the output folder, a deletion), the others waiting for it; an input
    error it raises is raised on every rank, so that all end alike. ``fn()`` itself in one process."""
    if not _group_active():
        return fn()
    error, result = None, None
    if _WORLD.main:
        try:
            result = fn()
        except FlatflError as e:
            error = e
    shared = broadcast_object(error)
    if error is not None:
        raise error
    if shared is not None:
        raise shared
    return result


def barrier() -> None:
    """Wait until every rank is here (nothing in one process)."""
    if _group_active():
        import torch.distributed as dist

        if _WORLD.backend == "nccl":
            dist.barrier(device_ids=[_WORLD.local_rank])
        else:
            dist.barrier()


def leave() -> None:
    """The end of a command: every rank waits for the others (rank 0 has written its files), then the group ends."""
    global _WORLD
    if not _group_active():
        return
    import torch.distributed as dist

    barrier()
    dist.destroy_process_group()
    _WORLD = None


def peer_failure(e: BaseException) -> str | None:
    """One line for an error raised in a collective because another rank stopped (died, was killed, failed, or
    timed out); None for any other error, or in one process."""
    if not _group_active():
        return None
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    text = " ".join(str(e).split())
    signs = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL", "gloo", "Timed out",
             "timed out", "ProcessGroup")
    if not (isinstance(e, kinds) or (isinstance(e, RuntimeError) and any(s in text for s in signs))):
        return None
    return (f"rank {_WORLD.rank}: another rank of this distributed run stopped ({text[:120]}); nothing "
            "half-written was kept: run the same command again (train: with --resume)")


def quiet_other_ranks() -> None:
    """Under torchrun, ranks other than 0 print nothing (their progress and results are rank 0's); only their error
    line still reaches the terminal (:func:`error_stream`)."""
    global _REAL_STDERR
    if is_main() or _REAL_STDERR is not None:
        return
    _REAL_STDERR = sys.stderr
    devnull = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    sys.stdout = devnull
    sys.stderr = devnull


def error_stream():
    """Where this rank's error line goes: the terminal, also on a quieted rank."""
    return _REAL_STDERR if _REAL_STDERR is not None else sys.stderr
