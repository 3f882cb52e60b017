"""Atomic file writing: a reader never sees a half-written file.

Everything is written to a temporary file in the destination's directory, flushed and fsynced, then renamed over
the destination (``os.replace`` is atomic on POSIX and Windows). Files get the permissions of an ordinary file
(0666 less the umask, not ``mkstemp``'s 0600), temporary names carry the writer's pid so that a killed writer's
leftovers can be recognised (:func:`flatfl.utils.lock.remove_stale_temporaries`), and every file written is
recorded in its folder's manifest (:mod:`flatfl.utils.manifest`) so that flatfl only ever deletes its own files.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

from . import manifest
from .atomic import atomic_write_bytes_unrecorded, file_mode, staged_file
from .csv_cells import csv_row

__all__ = ["atomic_open", "atomic_write_bytes", "atomic_write_bytes_unrecorded", "atomic_write_text",
           "atomic_write_json", "atomic_write_many", "atomic_torch_save", "json_safe", "csv_text"]


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """Open a temporary file next to ``path``; on success it replaces ``path``, on error it is removed."""
    path = Path(path)
    with staged_file(path, mode, before_rename=lambda: manifest.record(path)) as f:
        yield f


def atomic_write_many(files: dict) -> None:
    """Write several files as one step: every temporary file is written and fsynced first, then the manifest (a
    full disk fails here, leaving no output at all), then each is renamed over its destination, in the given
    order. A destination that exists and that flatfl did not write is refused (ConfigError), nothing written."""
    for path in files:  # never replace a file of the user's that merely shares an output's name
        manifest.refuse_foreign(Path(path).parent, [Path(path).name])
    staged: list[tuple[str, Path]] = []
    try:
        for path, data in files.items():
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
            staged.append((tmp, path))
            with os.fdopen(fd, "wb") as f:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
                f.flush()
                with contextlib.suppress(OSError):
                    os.fchmod(f.fileno(), file_mode())
                os.fsync(f.fileno())
        digests = {str(Path(path)): manifest.content_digest(data.encode("utf-8") if isinstance(data, str) else data)
                   for path, data in files.items()}
        manifest.record_many([path for _, path in staged], digests)  # before any rename: a full disk here changes nothing
        for tmp, path in staged:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` atomically; the manifest records the file by its name and content's digest."""
    path = Path(path)
    digest = manifest.content_digest(data)
    with staged_file(path, "wb", before_rename=lambda: manifest.record(path, digest)) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def csv_text(rows: list[dict], columns: list[str] | None = None) -> str:
    """``rows`` as CSV text: a header of ``columns`` (default the first row's keys), missing and None values empty,
    other keys left out, '\\n' line ends (the report tables' format), a field holding a line break quoted; every
    cell a spreadsheet would execute neutralised (:func:`flatfl.utils.csv_cells.csv_cell`)."""
    columns = columns or (list(rows[0]) if rows else [])
    buf = io.StringIO()
    # csv quotes a field holding a character of the line terminator: with '\r\n' a carriage return inside a field is
    # quoted too (with '\n' alone it would be written bare and end the line for every reader); each line's own
    # terminator is then written as '\n'
    w = csv.writer(buf, lineterminator="\r\n")
    lines = []
    for cells in [columns] + [["" if r.get(k) is None else r.get(k) for k in columns] for r in rows]:
        buf.seek(0)
        buf.truncate()
        w.writerow(csv_row(cells))
        lines.append(buf.getvalue()[:-2])
    return "".join(line + "\n" for line in lines)


def json_safe(obj: Any) -> Any:
    """A JSON-safe copy of ``obj``: numpy arrays and scalars to Python, NaN and infinities to None (strict JSON)."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())
