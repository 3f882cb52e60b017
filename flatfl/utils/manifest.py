"""Which files in a folder flatfl itself wrote: a small JSON manifest per folder.

Every file written through :mod:`flatfl.utils.io` is recorded, by name, in ``.flatfl-manifest.json`` of its
folder. Commands that replace or remove outputs (``train --force``, ``hessian``, ``surface``) only ever delete
files that the manifest lists, so a user's file that merely shares an output's name is never touched.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = ".flatfl-manifest.json"


def _read(folder: Path) -> dict:
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {"format": "flatfl-manifest", "files": []}
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        return {"format": "flatfl-manifest", "files": []}
    data["files"] = [f for f in data["files"] if isinstance(f, str)]
    return data


def _write(folder: Path, data: dict) -> None:
    from .atomic import atomic_write_bytes_unrecorded

    atomic_write_bytes_unrecorded(folder / MANIFEST, (json.dumps(data, indent=1) + "\n").encode("utf-8"))


def record(path: str | os.PathLike) -> None:
    """Note that flatfl wrote ``path`` (a file, by its name, in its folder's manifest)."""
    path = Path(path)
    if path.name == MANIFEST:
        return
    data = _read(path.parent)
    if path.name not in data["files"]:
        data["files"].append(path.name)
        _write(path.parent, data)


def record_many(paths) -> None:
    """Note several files at once (one manifest write per folder)."""
    by_folder: dict[Path, list[str]] = {}
    for p in map(Path, paths):
        if p.name != MANIFEST:
            by_folder.setdefault(p.parent, []).append(p.name)
    for folder, names in by_folder.items():
        data = _read(folder)
        new = [n for n in dict.fromkeys(names) if n not in data["files"]]
        if new:
            data["files"] += new
            _write(folder, data)


def owned(path: str | os.PathLike) -> bool:
    """True when flatfl wrote ``path`` (its folder's manifest lists it)."""
    path = Path(path)
    return path.name in _read(path.parent)["files"]


def refuse_foreign(folder: str | os.PathLike, names) -> None:
    """ConfigError when one of ``names`` exists in ``folder`` and flatfl did not write it (a user's file that merely
    shares an output's name is never replaced); called before any work, so that nothing is written."""
    from ..errors import ConfigError

    folder = Path(folder)
    if not folder.is_dir():
        return
    mine = owned_names(folder)
    for name in names:
        p = folder / name
        if (p.exists() or p.is_symlink()) and name not in mine:
            raise ConfigError(f"{p} exists and was not written by flatfl; move it away or choose another --out")


def owned_names(folder: str | os.PathLike) -> set[str]:
    return set(_read(Path(folder))["files"])


def remove_owned(path: str | os.PathLike) -> bool:
    """Delete ``path`` only if flatfl wrote it; returns whether it was deleted. A user's file is left alone."""
    path = Path(path)
    data = _read(path.parent)
    if path.name not in data["files"]:
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    data["files"].remove(path.name)
    _write(path.parent, data)
    return True


LEGACY_RUN_FILES = {"config.json", "partition.json", "metrics.csv", "resume.pt", "final.pt", "clients.pt"}


def is_flatfl_run(folder: str | os.PathLike) -> bool:
    """A folder whose config.json carries flatfl's header (``flatfl_version`` and a ``config`` table)."""
    try:
        data = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "flatfl_version" in data and isinstance(data.get("config"), dict)


def foreign_files(folder: str | os.PathLike, legacy_run: bool = False) -> list[Path]:
    """Files under ``folder`` that flatfl did not write (not in their folder's manifest; flatfl's own temporaries,
    '.NAME.PID.XXXXXXXX.tmp' exactly, excepted, a user's '.notes.tmp' not). With ``legacy_run``, the fixed names of
    a run folder written before manifests existed count as flatfl's."""
    import re

    from .atomic import temporary_writer
    from .lock import LOCK_NAME

    folder = Path(folder)
    out = []
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        mine = owned_names(here)
        for name in files:
            rel = (here / name).relative_to(folder)
            if name in mine or name in (MANIFEST, LOCK_NAME) or temporary_writer(name) is not None:
                continue
            if legacy_run and (str(rel) in LEGACY_RUN_FILES
                               or re.fullmatch(r"checkpoints/round_\d+\.pt", rel.as_posix())):
                continue
            out.append(here / name)
        for d in dirs:
            if (here / d).is_symlink():
                out.append(here / d)
    return out
