"""The atomic-write primitive under :mod:`flatfl.utils.io` and :mod:`flatfl.utils.manifest` (which records what io
writes, and writes itself with :func:`atomic_write_bytes_unrecorded`): a temporary file next to the destination,
flushed and fsynced, then renamed over it."""
from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


# the names of the temporary files staged_file (and flatfl.utils.io) write: '.NAME.PID.XXXXXXXX.tmp', where
# XXXXXXXX are tempfile.mkstemp's eight characters; nothing else is ever a flatfl temporary
TEMPORARY_NAME = re.compile(r"^\..+\.(\d+)\.[a-z0-9_]{8}\.tmp$")


def temporary_writer(name: str) -> int | None:
    """The process id in a flatfl temporary's name ('.NAME.PID.XXXXXXXX.tmp'); None for any other name (a user's
    '.notes.tmp' included)."""
    m = TEMPORARY_NAME.match(name)
    return int(m.group(1)) if m else None


def file_mode() -> int:
    """The permissions of an ordinary new file: 0666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextlib.contextmanager
def staged_file(path: Path, mode: str, before_rename: Callable[[], None] | None = None) -> Iterator[Any]:
    """Write to a temporary file beside ``path``; on success call ``before_rename`` (a full disk there leaves the
    destination as it was) and rename it over ``path``; on error remove it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            with contextlib.suppress(OSError):
                os.fchmod(f.fileno(), file_mode())
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_bytes_unrecorded(path: str | os.PathLike, data: bytes) -> None:
    """Atomic write that is not noted in the folder's manifest (the manifest itself)."""
    with staged_file(Path(path), "wb") as f:
        f.write(data)
