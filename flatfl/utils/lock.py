"""One writer per output folder: an exclusive lock file holding the writer's process id.

``folder_lock(path)`` takes ``PATH/.flatfl.lock`` with ``fcntl.flock`` (released by the kernel when the process dies,
so a killed writer never leaves a stale lock); where ``fcntl`` is missing it falls back to ``O_CREAT | O_EXCL`` and
treats a lock whose process is gone as stale. A second writer gets :class:`~flatfl.errors.ConfigError` naming the
process that holds the folder. The lock is re-entrant within one process. While held, temporary files of writers
that died (``.NAME.PID.XXXX.tmp``) are removed from the folder.
"""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Iterator

from ..errors import ConfigError
from .atomic import temporary_writer

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_NAME = ".flatfl.lock"
_held: dict[str, list] = {}  # resolved folder -> [fd, count]


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete ``.NAME.PID.XXXXXXXX.tmp`` files (flatfl's atomic writes) whose writing process is gone, in ``folder``
    and its direct sub-folders (a run's ``checkpoints/``, ``hessian/``). Any other file, a user's ``.notes.tmp``
    included, and the temporaries of a writer still alive are left alone."""
    removed = []
    folder = Path(folder)
    try:
        places = [folder] + [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]
    except OSError:
        return removed
    for place in places:
        try:
            entries = list(place.iterdir())
        except OSError:
            continue
        for p in entries:
            pid = temporary_writer(p.name)
            if pid is not None and pid != os.getpid() and not pid_alive(pid) and p.is_file() and not p.is_symlink():
                with contextlib.suppress(OSError):
                    p.unlink()
                    removed.append(p)
    return removed


def _holder(lock: Path) -> str:
    try:
        pid = lock.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "another process"


_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _open_lock(lock: Path, extra: int = 0) -> int:
    """Open (or create) the lock file without following a link and without truncating anything; refuse a lock
    'file' that is a link, a device, a pipe or a hard link to another file (its PID would overwrite that file)."""
    try:
        fd = os.open(lock, _OPEN_FLAGS | extra, 0o666)
    except OSError as e:
        if lock.is_symlink():
            raise ConfigError(f"{lock} is a symbolic link; flatfl does not follow it (it would write into the file "
                              "it points to): remove it") from None
        if isinstance(e, FileExistsError):
            raise
        raise ConfigError(f"cannot open the lock file {lock}: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        what = "a hard link to another file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise ConfigError(f"{lock} is {what}; flatfl will not write its process id into it: remove it")
    return fd


def _acquire(folder: Path) -> int:
    lock = folder / LOCK_NAME
    for _ in range(20):
        if fcntl is not None:
            fd = _open_lock(lock)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise ConfigError(f"{folder} is being written by another flatfl process ({_holder(lock)}); "
                                  "wait for it to finish or choose another --out") from None
            try:  # the file may have been unlinked by the previous holder between our open and flock
                same = os.fstat(fd).st_ino == os.stat(lock).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
        else:  # pragma: no cover - exercised on Windows only
            try:
                fd = _open_lock(lock, os.O_EXCL)
            except FileExistsError:
                text = _holder(lock)
                if text.startswith("pid ") and not pid_alive(int(text[4:])):
                    with contextlib.suppress(OSError):
                        lock.unlink()
                    continue
                raise ConfigError(f"{folder} is being written by another flatfl process ({text}); "
                                  "wait for it to finish or choose another --out") from None
        os.ftruncate(fd, 0)  # only now, the lock held: the file is ours (no link, no other name)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd
    raise ConfigError(f"cannot lock {folder}: its lock file keeps changing")  # pragma: no cover


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold ``folder``'s lock for the block (the folder is created if needed, and removed again if the block
    leaves it empty). Under torchrun only rank 0 writes, and only it takes the lock (:mod:`flatfl.utils.ranks`):
    the other ranks run the block without touching the folder."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--out {folder} exists and is not a directory")
    from .ranks import is_main

    if not is_main():
        yield folder
        return
    created = []  # folders made here, innermost first: removed again if left empty
    probe = folder
    while not probe.exists() and probe != probe.parent:
        created.append(probe)
        probe = probe.parent
    folder.mkdir(parents=True, exist_ok=True)
    key = str(folder.resolve())
    if key in _held:
        _held[key][1] += 1
        try:
            yield folder
        finally:
            _held[key][1] -= 1
        return
    fd = _acquire(folder)
    _held[key] = [fd, 1]
    try:
        remove_stale_temporaries(folder)
        yield folder
    finally:
        del _held[key]
        with contextlib.suppress(OSError):
            (folder / LOCK_NAME).unlink()
        os.close(fd)
        for made in created:
            try:
                made.rmdir()  # only succeeds when nothing was written
            except OSError:
                break


def locks_output(fn):
    """Decorator: run ``fn(checkpoint, out, ...)`` holding ``out``'s lock (one writer per output folder)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        out = kwargs["out"] if "out" in kwargs else args[1]
        with folder_lock(out):
            return fn(*args, **kwargs)

    return wrapper
