"""Test helper: another process holding a folder's flatfl lock, as a running flatfl writer does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def start_lock_holder(folder: Path) -> subprocess.Popen:
    """A process holding ``folder/.flatfl.lock`` (flock, its pid written in it) for up to two minutes; returned
    once it holds the lock."""
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, b'%d\\n' % os.getpid())\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder / ".flatfl.lock")], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc
