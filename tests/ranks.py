"""Test support: a command or a Python job run as several ranks on this machine, as torchrun starts them (each rank a
process with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; gloo on the CPU).

:func:`start_ranks` starts them and returns the processes; :func:`run_ranks` waits for them under a timeout and
returns each rank's exit code, stdout and stderr; :func:`run_job` runs ``tests/rank_jobs.py JOB`` as the ranks."""
from __future__ import annotations

import itertools
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

__all__ = ["free_port", "start_ranks", "run_ranks", "run_job", "torchrun"]


#: ports each pytest-xdist worker (gw0, gw1, ...) hands out, in a slice of its own just below the kernel's ephemeral
#: range; from a random start, so that two test sessions on one machine seldom try the same one
SLICE, SLICES = 500, 16
_turn = itertools.count(random.randrange(SLICE))


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port for the ranks' rendezvous (MASTER_PORT) that nothing holds now. Not one bound to port 0: those, and the
    local end of every connection (gloo's own), come from the kernel's ephemeral range, so the port could be handed
    to another process in the seconds before rank 0 binds it, and two pytest-xdist workers starting ranks at once
    could get the same one. Here each worker takes the ports of its own slice below that range in turn, skipping
    any that cannot be bound (in use, or closed too recently)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) % SLICES if worker[2:].isdigit() else 0
    start = _ephemeral_start() - SLICES * SLICE + index * SLICE
    if start >= 1024:
        for _ in range(SLICE):
            port = start + next(_turn) % SLICE
            if _bindable(port):
                return port
    with socket.socket() as s:  # a machine without room below its ephemeral range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, size: int, port: int) -> dict:
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    env.pop("FLATFL_DEBUG", None)
    return env


def start_ranks(args: list[str], size: int, cwd=None) -> list[subprocess.Popen]:
    """``python args...`` started as ranks 0..size-1 of one world."""
    port = free_port()
    return [subprocess.Popen([sys.executable, *args], env=_env(rank, size, port), cwd=cwd, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for rank in range(size)]


def run_ranks(args: list[str], size: int, timeout: float = 300, cwd=None) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of every rank of ``python args...`` run as ``size`` ranks."""
    procs = start_ranks(args, size, cwd)
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def run_job(job: str, size: int, *args: str, timeout: float = 300) -> list[tuple[int, str, str]]:
    """``tests/rank_jobs.py JOB ARGS`` as ``size`` ranks; every rank must succeed (the failure shows their output)."""
    results = run_ranks([str(HERE / "rank_jobs.py"), job, *args], size, timeout)
    bad = [(rank, code, err[-2000:]) for rank, (code, _, err) in enumerate(results) if code != 0]
    assert not bad, bad
    return results


def torchrun(args: list[str], size: int, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node size -m flatfl args...`` (torch's own launcher)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("FLATFL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(size), "-m", "flatfl", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
