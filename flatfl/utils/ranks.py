"""Several processes for one run or one analysis (docs/distributed.md): torchrun's environment, where the ranks
meet, what they agree on before they compute, the process group, and which rank speaks.

A command started by ``torchrun --nproc-per-node N -m flatfl ...`` (or torchrun's multi-node rendezvous, or ranks
started by hand) runs as N processes, the *ranks*, which find each other through the variables torchrun sets
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Without them (or with
``WORLD_SIZE=1``) nothing here does anything: one process, as always.

* :func:`launched` reads the environment (checked: whole numbers, ``0 <= RANK < WORLD_SIZE``, and
  ``FLATFL_DISTRIBUTED_TIMEOUT``, :func:`timeout_seconds`) without starting anything; :func:`is_main` says whether
  this process is rank 0, the one that writes files and prints.
* The ranks' **meeting point** is a ``torch.distributed`` key-value store at ``MASTER_ADDR:MASTER_PORT`` (rank 0's,
  or torchrun's own under torchrun), reached once; what cannot reach it is one line naming why (a variable missing,
  the port taken by another program, rank 0 or another rank not there within the timeout).
* :func:`meet` compares every rank's record of its command (the command, its settings, flatfl's and torch's
  versions, digests of the files it names) through the meeting point, before any of the command's work: a
  difference ends every rank with one line naming the setting and the rank. :func:`agree` compares what the ranks
  loaded (weights, data) the same way, over the process group.
* :func:`join` starts the process group once the device is known: ``nccl`` for CUDA (each rank on the GPU
  ``cuda:LOCAL_RANK``), ``gloo`` otherwise; torch.distributed is the engine, flatfl opens no socket of its own.
* :func:`all_reduce_sum`, :func:`all_reduce_min`, :func:`all_gather_objects`, :func:`barrier`: the collectives the
  operators and the rounds use; each is the identity in one process. :func:`on_main` runs a step on rank 0 alone
  (a folder check) and raises its input error on every rank.
* A rank that fails tells the others its line (:func:`tell_others`); a rank that then finds a collective broken
  (:func:`peer_failure`) or the failure posted (:class:`RankFailed`, :func:`told_failure`) leaves the saying to rank
  0, which prints the failing rank's own line, so that the user reads it once. :func:`end_with_error` is the last
  step of a rank that fails: rank 0 keeps the meeting point open a few seconds for the others to read it.
  :func:`quiet_other_ranks` keeps the other ranks' output off the terminal (their errors still reach it, through
  :func:`error_stream`, when they cannot tell rank 0).
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

from ..errors import ConfigError, FlatflError

__all__ = ["World", "launched", "is_main", "world", "timeout_seconds", "meet", "agree", "digest", "fingerprint",
           "FINGERPRINT_DIGITS", "join", "record",
           "all_reduce_sum", "all_reduce_min", "all_gather_objects", "broadcast_object", "on_main", "barrier", "leave",
           "peer_failure", "tell_others", "told_failure", "end_with_error", "quiet_other_ranks", "error_stream",
           "RankStopped", "RankFailed", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "MAX_TIMEOUT_S", "LINGER_S"]

#: how long a rank waits for the others (seconds): to meet, at an exchange; a rank that dies is noticed at once
#: once the ranks compute together
TIMEOUT_ENV = "FLATFL_DISTRIBUTED_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800
#: the longest wait that may be asked: 7 days
MAX_TIMEOUT_S = 7 * 24 * 3600
#: seconds rank 0, ending with an error, keeps the meeting point open for the other ranks to read it
LINGER_S = 5.0


class RankStopped(FlatflError):
    """This rank was told to stop (SIGTERM: torchrun stops the others when one rank fails), or rank 0, which holds
    the meeting point, is gone."""


class RankFailed(FlatflError):
    """A rank's own error as that rank said it: its ``rank``, ``line`` (without ``flatfl: error:``) and exit ``code``;
    raised on the ranks that learn of it (at a meeting, or from the meeting point after a broken collective)."""

    def __init__(self, rank: int, line: str, code: int = 2) -> None:
        self.rank, self.line, self.code = int(rank), str(line), int(code)
        said = self.line if self.line.startswith(f"rank {self.rank}:") else f"rank {self.rank}: {self.line}"
        super().__init__(said)


@dataclass(frozen=True)
class World:
    """The processes of this command: this one's ``rank`` among ``size`` (``local_rank`` on its machine) and the
    backend of the process group (None before :func:`join`, and in one process); which rank writes (:attr:`main`),
    the rules that split work over the ranks, each by its name (:meth:`share`, :meth:`dealt`, :meth:`owns`), and
    how results meet (:meth:`gather`). A world of one (``World()``) keeps everything and gathers its own."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def main(self) -> bool:
        """Whether this process writes the command's files and prints: rank 0, or the only process."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def share(self, items):
        """This rank's contiguous share of ``items`` (a sequence or an array): shares differ by at most one item,
        the first ranks' the larger (numpy's ``array_split``); a round's participants are split so."""
        q, r = divmod(len(items), self.size)
        start = self.rank * q + min(self.rank, r)
        return items[start:start + q + (1 if self.rank < r else 0)]

    def dealt(self, items):
        """Every ``size``-th of ``items`` from this rank's place, as cards are dealt (evaluation batches, a surface's
        grid points)."""
        return items[self.rank::self.size]

    def owns(self, k: int) -> bool:
        """Whether item ``k`` of a dealt sequence is this rank's (:meth:`dealt`)."""
        return k % self.size == self.rank

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (``[obj]`` in a world of one)."""
        return all_gather_objects(obj) if self.distributed else [obj]


_WORLD: World | None = None  # set by join()
_REAL_STDERR = None  # the terminal of a quieted rank, for its error line
_STORE = None  # the meeting point (a torch.distributed Store, keys under 'flatfl/'), once reached
_EXCHANGES = 0  # exchanges held through the meeting point so far: each has keys of its own
_MET: list[int] = []  # the ranks that came to the last exchange (rank 0 waits for them when it fails)


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


def timeout_seconds() -> float:
    """``FLATFL_DISTRIBUTED_TIMEOUT``: the seconds a rank waits for the others, a number from 1 to 7 days
    (:data:`MAX_TIMEOUT_S`), :data:`DEFAULT_TIMEOUT_S` when unset; anything else is one ConfigError line."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return float(DEFAULT_TIMEOUT_S)
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 1 <= value <= MAX_TIMEOUT_S):
        raise ConfigError(f"{TIMEOUT_ENV}={raw[:40]!r}: the seconds a rank waits for the others must be a number from "
                          f"1 to {MAX_TIMEOUT_S} (7 days); unset, {DEFAULT_TIMEOUT_S}")
    return value


def launched() -> World:
    """The world torchrun's variables describe (one process without them); starts nothing."""
    if _WORLD is not None:
        return _WORLD
    size = _env_int("WORLD_SIZE", 1)
    if size == 0:
        raise ConfigError("the environment variable WORLD_SIZE=0: a world has at least one process (unset it to run "
                          "as one process)")
    if size is None or size <= 1:
        rank = _env_int("RANK", 0) or 0
        if rank >= 1 and os.environ.get("WORLD_SIZE", "").strip():  # a world of one set: its process is rank 0
            raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={size}")
        return World()
    rank = _env_int("RANK", None)
    if rank is None:
        raise ConfigError(f"WORLD_SIZE={size} is set but RANK is not: start the ranks with torchrun "
                          "(torchrun --nproc-per-node N -m flatfl ...)")
    if rank >= size:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={size}")
    timeout_seconds()  # checked where it enters, before any rank waits
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


# ------------------------------------------------------------------------------------------- the meeting point
def _master(w: World) -> tuple[str, int]:
    """``(MASTER_ADDR, MASTER_PORT)``, checked."""
    addr = os.environ.get("MASTER_ADDR", "").strip()
    raw = os.environ.get("MASTER_PORT", "").strip()
    missing = [name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", raw)) if not value]
    if missing:
        raise ConfigError(f"WORLD_SIZE={w.size} is set but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not: the ranks meet at MASTER_ADDR:MASTER_PORT "
                          "(rank 0's machine and a free port); torchrun sets both, or set them for every rank")
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"MASTER_PORT={raw[:40]!r} is not a port number (1 to 65535)")
    return addr, port


def _meeting_point(w: World):
    """The meeting point of this run's ranks, reached once (one line naming what is wrong when it cannot be)."""
    global _STORE
    if _STORE is None:
        _STORE = _connect(w)
    return _STORE


def _connect(w: World):
    """The store at MASTER_ADDR:MASTER_PORT, as rank ``w.rank`` reaches it: rank 0 opens it (torchrun's own under
    torchrun, which every rank reaches as a client), the others connect, each within the timeout; flatfl's keys
    apart under ``flatfl/``."""
    import datetime
    import socket

    import torch.distributed as dist

    seconds = timeout_seconds()
    host, port = _master(w)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun holds the store: every rank a client
    try:
        socket.getaddrinfo(host, port)
    except (socket.gaierror, UnicodeError):
        raise ConfigError(f"rank {w.rank}: MASTER_ADDR={host[:80]!r} is not a host name this machine can find") \
            from None  # this rank's own (its machine resolves names): said by it, whichever rank it is
    if w.rank == 0 and not agent:
        try:
            store = dist.TCPStore(host, port, w.size, is_master=True, timeout=datetime.timedelta(seconds=seconds),
                                  wait_for_workers=False)
        except RuntimeError as e:
            text = " ".join(str(e).split())
            if "EADDRINUSE" in text or "already in use" in text:
                raise ConfigError(f"rank 0 cannot open the ranks' meeting point: MASTER_PORT={port} is taken by "
                                  "another program on this machine (or a run still going); give every rank another "
                                  "MASTER_PORT (torchrun: --master-port)") from None
            raise ConfigError(f"rank 0 cannot open the ranks' meeting point at port {port}: {text[:160]}") from None
    else:
        store = _reach(host, port, w, seconds)
    prefix = "flatfl/"
    if agent:  # torchrun's store outlives one attempt: this attempt's keys apart
        prefix += f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return dist.PrefixStore(prefix, store)


def _reach(host: str, port: int, w: World, seconds: float):
    """A client of the store at ``host:port`` within ``seconds``: first until something accepts connections there,
    then torch's client in a thread (a program on that port that is not a store would keep it waiting for ever)."""
    import datetime
    import threading

    import torch.distributed as dist

    deadline = time.monotonic() + seconds
    where = f"MASTER_ADDR:MASTER_PORT = {host}:{port}"
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    never = (f"rank {w.rank} waited {seconds:g} s ({TIMEOUT_ENV}) for {'torchrun' if agent else 'rank 0'} at {where}; "
             f"it never answered: start every rank of WORLD_SIZE={w.size} (rank 0 on MASTER_ADDR), each with the same "
             "MASTER_ADDR and MASTER_PORT")
    while not _answers(host, port):
        if time.monotonic() >= deadline:
            raise ConfigError(never)
        time.sleep(0.2)
    left = max(1.0, deadline - time.monotonic())
    box: dict = {}

    def connect() -> None:
        try:
            box["store"] = dist.TCPStore(host, port, w.size, is_master=False, timeout=datetime.timedelta(seconds=left))
        except Exception as e:  # noqa: BLE001 - said below
            box["error"] = e

    thread = threading.Thread(target=connect, name="flatfl-reach-rank-0", daemon=True)
    thread.start()
    thread.join(left + 2)
    if "store" in box:
        return box["store"]
    if thread.is_alive():
        raise ConfigError(f"rank {w.rank}: something answers at {where}, but not as rank 0 of this run (waited "
                          f"{seconds:g} s, {TIMEOUT_ENV}): another program holds that port? give every rank a free "
                          "MASTER_PORT")
    raise ConfigError(never)


def _answers(host: str, port: int) -> bool:
    """Whether a program accepts connections at ``host:port`` now."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _exchange(name: str, value: str, w: World) -> list[str]:
    """Every rank's ``value`` (text), in rank order, through the meeting point: each rank leaves its own and waits
    (up to :func:`timeout_seconds`) for the others'; a failure another rank told meanwhile is raised
    (:class:`RankFailed`), and ranks that never come are named."""
    global _EXCHANGES, _MET
    store = _meeting_point(w)
    _EXCHANGES += 1
    keys = [f"{_EXCHANGES}/{name}/{r}" for r in range(w.size)]
    seconds = timeout_seconds()
    deadline = time.monotonic() + seconds
    pause = 0.01
    try:
        store.set(keys[w.rank], value)
        while not store.check(keys):
            failed = told_failure()
            if failed is not None:
                raise failed
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                raise ConfigError(
                    f"rank {w.rank} waited {seconds:g} s ({TIMEOUT_ENV}) for rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} of WORLD_SIZE={w.size}; {'they' if len(missing) > 1 else 'it'} "
                    f"never came: start every rank (torchrun --nproc-per-node, or each with its RANK) with the same "
                    "MASTER_ADDR and MASTER_PORT")
            time.sleep(pause)
            pause = min(0.2, pause * 1.5)
        values = [bytes(store.get(key)).decode("utf-8") for key in keys]
    except RuntimeError as e:  # the store's connection is gone: rank 0, which holds it, stopped
        raise RankStopped(f"rank {w.rank}: rank 0 of this distributed run stopped while the ranks met "
                          f"({' '.join(str(e).split())[:100]}); nothing half-written was kept") from None
    _MET = list(range(w.size))
    return values


def _text(value) -> str:
    """A record's value as compared and shown: its JSON text (NaN equal to NaN), '(none)' when a rank has none."""
    return "(none)" if value is _ABSENT else json.dumps(value, sort_keys=True, default=str)


def _shown(value) -> str:
    text = _text(value)
    return text if len(text) <= 80 else text[:77] + "..."


_ABSENT = object()


def _compare(records: list) -> None:
    """Every rank raises the same error when the ranks' ``records`` (dicts) differ: a rank's own error (key
    ``error``) first, else the first setting where a rank differs from rank 0."""
    errors = [(r, rec["error"]) for r, rec in enumerate(records) if isinstance(rec, dict) and "error" in rec]
    if errors:
        if len(errors) == len(records) and len({line for _, line in errors}) == 1:
            raise ConfigError(errors[0][1])  # the same error on every rank: said once, by rank 0
        raise RankFailed(errors[0][0], errors[0][1])
    reference = records[0]
    for r, rec in enumerate(records[1:], 1):
        for key in list(reference) + [k for k in rec if k not in reference]:
            mine, theirs = rec.get(key, _ABSENT), reference.get(key, _ABSENT)
            if _text(mine) != _text(theirs):
                raise ConfigError(f"rank {r} differs from rank 0 in {key}: {_shown(mine)} on rank {r}, "
                                  f"{_shown(theirs)} on rank 0; every rank must run the same command with the same "
                                  "settings, files and versions (nothing was computed or written)")


def meet(record: dict) -> None:
    """Before a command's work: every rank's ``record`` (a dict of JSON values: the command, its settings, the
    versions, digests of the files it names; or ``{"error": line}`` for a rank that could not start it) compared
    through the meeting point, in one exchange. A difference, or a rank's error, ends every rank alike (rank 0 says
    it); nothing in one process, or where the caller started torch.distributed itself."""
    w = launched()
    if not w.distributed or _WORLD is not None:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        return
    texts = _exchange("meet", json.dumps(record, default=str), w)
    _compare([json.loads(t) for t in texts])


def agree(record) -> None:
    """What the ranks loaded (``record``: names -> digests, JSON values; or a function of no argument returning
    them, called only over several ranks, so that one process computes no digest) compared over the process group,
    in one exchange: a difference ends every rank alike, naming the rank and what differs. Nothing in one process."""
    if _group_active():
        _compare(all_gather_objects(record() if callable(record) else record))


def digest(*parts) -> str:
    """The first 16 hex digits of the SHA-256 of ``parts``, what :func:`agree` compares: tensors and numpy arrays by
    shape, type and values (on the CPU), dicts, lists and tuples followed in order, anything else by its ``repr``."""
    import hashlib

    import numpy as np
    import torch

    h = hashlib.sha256()

    def add(x) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"tensor{tuple(x.shape)}{t.dtype};".encode())
            if t.numel():
                h.update(t.view(torch.uint8).numpy())  # the buffer itself, not a copy
        elif isinstance(x, np.ndarray):
            h.update(f"array{x.shape}{x.dtype};".encode())
            h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
        elif isinstance(x, dict):
            h.update(f"dict{len(x)};".encode())
            for k, v in x.items():
                add(k)
                add(v)
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}{len(x)};".encode())
            for v in x:
                add(v)
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())

    for part in parts:
        add(part)
    return h.hexdigest()[:16]


#: significant digits of a weights fingerprint: far coarser than the last-bit differences of a model computed on
#: different processors, far finer than any change of a trained model
FINGERPRINT_DIGITS = 7


def fingerprint(names, tensors) -> str:
    """What ranks compare of weights (:func:`agree`): each tensor's name (``names``, or its place), shape, and L1 and
    L2 norms in float64 to :data:`FINGERPRINT_DIGITS` significant digits (sums of positive terms, so that rounding
    differences stay in the last bits); a digest of them."""
    import torch

    rows = []
    for i, t in enumerate(tensors):
        x = t.detach().to(dtype=torch.float64)
        rows.append((names[i] if names else i, tuple(t.shape), f"{float(x.abs().sum()):.{FINGERPRINT_DIGITS}g}",
                     f"{float(x.square().sum()):.{FINGERPRINT_DIGITS}g}"))
    return digest(rows)


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
    import datetime

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
        store = _meeting_point(w)
        kinds = _exchange("join", backend, w)  # every rank here (or its error told) before the group waits for them
        if len(set(kinds)) > 1:
            other = next(r for r, k in enumerate(kinds) if k != kinds[0])
            raise ConfigError(f"rank {other} computes over {kinds[other]}, rank 0 over {kinds[0]}: every rank needs "
                              "the same kind of device")
        options = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.PrefixStore(f"group{_EXCHANGES}/", store), rank=w.rank,
                                world_size=w.size, timeout=datetime.timedelta(seconds=timeout_seconds()), **options)
        import atexit

        atexit.register(_end_group_at_exit)  # a script may end with the group open (a refusal it caught)
    _WORLD = World(rank=w.rank, size=w.size, local_rank=w.local_rank, backend=backend)
    _stop_on_sigterm()
    return device


def _end_group_at_exit() -> None:
    """At the interpreter's exit, the group flatfl started ends, without waiting for the other ranks: a process
    that leaves its gloo threads running when it exits is aborted by the C++ runtime ('terminate called ...')."""
    global _WORLD
    try:
        import torch.distributed as dist

        if _WORLD is not None and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is ending: nothing more to say
        pass
    _WORLD = None


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


# ------------------------------------------------------------------------------------------ a rank that fails
def _reached_world() -> World | None:
    """This process's world when it has reached the meeting point (None otherwise, or in one process)."""
    if _STORE is None:
        return None
    try:
        w = launched()
    except ConfigError:
        return None
    return w if w.distributed else None


def tell_others(line: str, code: int) -> bool:
    """Leave this rank's own error (``line`` without ``flatfl: error:``, exit ``code``) at the meeting point, where the
    other ranks read it; whether it was left (False in one process, or when the meeting point is out of reach)."""
    w = _reached_world()
    if w is None:
        return False
    try:
        _STORE.set(f"failed/{w.rank}", json.dumps({"line": str(line), "code": int(code)}))
        _STORE.add("failures", 1)
        return True
    except RuntimeError:
        return False


def told_failure() -> RankFailed | None:
    """The error a rank told the others (:func:`tell_others`), the lowest such rank's, as a :class:`RankFailed`;
    None when none did, or when the meeting point is out of reach."""
    w = _reached_world()
    if w is None:
        return None
    try:
        if int(_STORE.add("failures", 0)) == 0:
            return None
        for r in range(w.size):
            if _STORE.check([f"failed/{r}"]):
                said = json.loads(bytes(_STORE.get(f"failed/{r}")).decode("utf-8"))
                return RankFailed(r, said["line"], said["code"])
    except (RuntimeError, ValueError, KeyError, TypeError):
        return None
    return None


def end_with_error() -> None:
    """The last step of a rank that fails: the others are woken (the process group is taken down) and learn it; rank
    0, which holds the meeting point, waits up to :data:`LINGER_S` seconds for the ranks that met to end, so that
    they read what it told instead of finding it gone. Nothing in one process."""
    global _WORLD
    w = _reached_world()
    if w is None:
        return
    if _group_active():
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - ending anyway
            pass
        _WORLD = None
    try:
        _STORE.set(f"ended/{w.rank}", "1")
        if w.main:
            others = [f"ended/{r}" for r in _MET if r != w.rank]
            deadline = time.monotonic() + LINGER_S
            while others and not _STORE.check(others) and time.monotonic() < deadline:
                time.sleep(0.05)
    except RuntimeError:
        pass


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
