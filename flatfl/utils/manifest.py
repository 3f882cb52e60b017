"""Which files in a folder flatfl itself wrote: a small JSON manifest per folder.

Every file written through :mod:`flatfl.utils.io` is recorded, by name, in ``.flatfl-manifest.json`` of its
folder; a file written from bytes in memory (reports, CSV, JSON, figures: up to :data:`DIGEST_LIMIT`) also by the sha256 of
its content, so that a file flatfl wrote and the user then overwrote with text of their own counts as the user's.
Commands that replace or remove outputs (``train --force``, ``hessian``, ``surface``, ``report``) only ever delete
or replace files that the manifest lists, so a user's file that merely shares an output's name is never touched.

Outputs of different commands can share file names (a report's and a contrast's ``effects.png``). The manifest
also records which kind of output its folder holds (:func:`record_kind`), and :func:`refuse_other_kind` refuses to
write one kind over another, so that one command's files never replace another's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = ".flatfl-manifest.json"
DIGEST_LIMIT = 64 << 20  # files written from memory up to this size are recorded by their content's sha256 too


def _read(folder: Path) -> dict:
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {"format": "flatfl-manifest", "files": [], "sha256": {}}
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        return {"format": "flatfl-manifest", "files": [], "sha256": {}}
    data["files"] = [f for f in data["files"] if isinstance(f, str)]
    digests = data.get("sha256")
    data["sha256"] = {k: v for k, v in digests.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(digests, dict) else {}
    return data


def content_digest(data: bytes) -> str | None:
    """The digest the manifest records of a file of ``data`` (None above :data:`DIGEST_LIMIT`: by name only)."""
    import hashlib

    return hashlib.sha256(data).hexdigest() if len(data) <= DIGEST_LIMIT else None


def _file_digest(path: Path) -> str | None:
    import hashlib

    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def _owned(folder: Path, name: str, data: dict) -> bool:
    """``data`` (the folder's manifest) lists the file and it is as flatfl wrote it: no digest recorded (a file
    written from a stream), no file, or the same content."""
    if name not in data["files"]:
        return False
    recorded = data["sha256"].get(name)
    path = folder / name
    if recorded is None or not path.is_file():
        return True
    return path.stat().st_size <= DIGEST_LIMIT and _file_digest(path) == recorded


def _write(folder: Path, data: dict) -> None:
    from .atomic import atomic_write_bytes_unrecorded

    atomic_write_bytes_unrecorded(folder / MANIFEST, (json.dumps(data, indent=1) + "\n").encode("utf-8"))


def record(path: str | os.PathLike, digest: str | None = None) -> None:
    """Note that flatfl wrote ``path`` (a file, by its name, in its folder's manifest; with ``digest``, the sha256
    of its content, :func:`content_digest`)."""
    record_many([path], {str(Path(path)): digest})


def record_many(paths, digests: dict | None = None) -> None:
    """Note several files at once (one manifest write per folder); ``digests``: {path: sha256 or None}."""
    by_folder: dict[Path, list[str]] = {}
    for p in map(Path, paths):
        if p.name != MANIFEST:
            by_folder.setdefault(p.parent, []).append(p.name)
    for folder, names in by_folder.items():
        data = _read(folder)
        before = json.dumps(data, sort_keys=True)
        for name in dict.fromkeys(names):
            if name not in data["files"]:
                data["files"].append(name)
            digest = (digests or {}).get(str(folder / name))
            if digest is None:
                data["sha256"].pop(name, None)  # written from a stream: known by name only
            else:
                data["sha256"][name] = digest
        if not data["sha256"]:
            data.pop("sha256")
        if json.dumps(data, sort_keys=True) != before:
            _write(folder, data)


def owned(path: str | os.PathLike) -> bool:
    """True when flatfl wrote ``path`` (its folder's manifest lists it) and it is as flatfl wrote it."""
    path = Path(path)
    data = _read(path.parent)
    return _owned(path.parent, path.name, data)


def refuse_foreign(folder: str | os.PathLike, names) -> None:
    """ConfigError when one of ``names`` exists in ``folder`` and flatfl did not write it (a user's file that merely
    shares an output's name is never replaced); called before any work, so that nothing is written."""
    from ..errors import ConfigError

    folder = Path(folder)
    if not folder.is_dir():
        return
    data = _read(folder)
    for name in names:  # only the files named are read for their digest
        p = folder / name
        if (p.exists() or p.is_symlink()) and not _owned(folder, name, data):
            how = "was changed since flatfl wrote it" if name in data["files"] else "was not written by flatfl"
            raise ConfigError(f"{p} exists and {how}; move it away or choose another --out")


def owned_names(folder: str | os.PathLike) -> set[str]:
    """The names of the files in ``folder`` that flatfl wrote and that are as it wrote them."""
    folder = Path(folder)
    data = _read(folder)
    return {name for name in data["files"] if _owned(folder, name, data)}


def remove_owned(path: str | os.PathLike) -> bool:
    """Delete ``path`` only if flatfl wrote it; returns whether it was deleted. A user's file is left alone."""
    path = Path(path)
    data = _read(path.parent)
    if not _owned(path.parent, path.name, data):
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    data["files"].remove(path.name)
    data["sha256"].pop(path.name, None)
    if not data["sha256"]:
        data.pop("sha256")
    _write(path.parent, data)
    return True


def recorded_kind(folder: str | os.PathLike) -> str | None:
    """The kind of output ``folder`` holds as its manifest records it (:func:`record_kind`); None when it records
    none."""
    kind = _read(Path(folder)).get("kind")
    return kind if isinstance(kind, str) else None


def record_kind(folder: str | os.PathLike, kind: str) -> None:
    """Record in ``folder``'s manifest that it holds an output of ``kind`` ('report', 'contrast'...)."""
    folder = Path(folder)
    data = _read(folder)
    if data.get("kind") != kind:
        data["kind"] = kind
        _write(folder, data)


def refuse_other_kind(folder: str | os.PathLike, kind: str, signs: dict[str, tuple[str, ...]]) -> None:
    """ConfigError when ``folder`` holds flatfl's output of another kind than ``kind``: the kind its manifest
    records, or, in a folder of an older flatfl (no kind recorded), each kind of ``signs`` (kind -> the names of
    files only that kind writes) whose files the manifest lists as flatfl's. Called before any work, so that
    nothing is written."""
    from ..errors import ConfigError

    folder = Path(folder)
    if not folder.is_dir():
        return
    data = _read(folder)
    recorded = data.get("kind")
    if isinstance(recorded, str):
        found = {recorded: [n for n in signs.get(recorded, ()) if n in data["files"]]}
    else:
        found = {k: [n for n in names if n in data["files"]] for k, names in signs.items()}
        found = {k: names for k, names in found.items() if names}
    other = [k for k in found if k != kind]
    if other:
        held = f" ({', '.join(found[other[0]])})" if found[other[0]] else ""
        raise ConfigError(f"{folder} holds a flatfl {other[0]}{held}; a {kind} is never written over another "
                          f"output: choose another --out")


LEGACY_RUN_FILES = {"config.json", "partition.json", "metrics.csv", "resume.pt", "final.pt", "clients.pt"}


def is_run_record(data) -> bool:
    """A parsed config.json carries flatfl's header (``flatfl_version`` and a ``config`` table)."""
    return isinstance(data, dict) and "flatfl_version" in data and isinstance(data.get("config"), dict)


def is_flatfl_run(folder: str | os.PathLike) -> bool:
    """A folder whose config.json carries flatfl's header (:func:`is_run_record`)."""
    try:
        data = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return is_run_record(data)


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
