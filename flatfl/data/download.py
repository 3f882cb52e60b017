"""Find a dataset's extracted files, or fetch, verify and extract its official archive.

The archives, their md5 checksums and URLs are the ones listed in docs/datasets.md ("Datasets"), read from the
data file ``archives.json`` beside this module (:func:`read_archives`). Everything lives under one ``root`` folder::

    root/
      cifar-10-python.tar.gz    (optional: kept after a download, or placed there by hand)
      cifar-10-batches-py/      data_batch_1..5, test_batch, batches.meta
      cifar-100-python/         train, test, meta
      tiny-imagenet-200/        wnids.txt, words.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG,
                                val/val_annotations.txt
      gzip/                     emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz
                                (EMNIST; the .gz files may also sit directly in root)
      fashion-mnist/            {train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (Fashion-MNIST; also directly in
                                root, or in Debian's /usr/share/datasets/fashion-mnist/: see ensure_fashion_mnist)

``root`` may also be the dataset folder itself (e.g. ``.../cifar-10-batches-py``).

:func:`ensure_dataset` returns the folder holding the files. When they are missing it uses an archive already in
``root`` or downloads one (when allowed), checks the archive's md5, and extracts it into a temporary folder inside
``root`` that is renamed into place only when extraction succeeded, so an interrupted or failed run never leaves a
half-downloaded archive or a half-extracted folder. Known per-file md5s (the CIFAR batch files) are checked on
every load.

A download is bounded: by the file's known size (a server announcing or sending more is stopped), by
:data:`DOWNLOAD_DEADLINE` for the whole file (a server trickling bytes cannot hold it for ever) and by
:data:`DOWNLOAD_TIMEOUT` for each wait; its ``.part`` file is removed on every way out (errors, the deadline,
Ctrl-C, SIGTERM).

:data:`ARCHIVES`, :data:`DOWNLOAD_TIMEOUT` and :data:`DOWNLOAD_DEADLINE` are module-level so tests (or a mirror) can
replace URLs, checksums and limits.
"""
from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import ConfigError, DatasetError


@dataclass(frozen=True)
class Archive:
    """One dataset's official archive and the folder it extracts to."""

    title: str  # for messages, e.g. "CIFAR-10"
    url: str
    filename: str  # the archive's file name inside root
    md5: str  # md5 of the whole archive
    folder: str  # the folder the archive extracts to, relative to root
    required: tuple[str, ...]  # files (relative to folder) that must exist
    layout: str  # human-readable description of folder's content, for error messages
    file_md5: dict[str, str] = field(default_factory=dict)  # known md5s of files inside folder
    loose_files_ok: bool = False  # the required files may also sit directly in root (EMNIST's .gz files)
    size: int | None = None  # the archive's size in bytes: a download stops (refused) beyond it


#: The file the archive table is read from (a data file beside this module, shipped with the package).
ARCHIVES_FILE = Path(__file__).with_name("archives.json")


def read_archives(path: Path = ARCHIVES_FILE) -> dict[str, Archive]:
    """The archive table of ``path`` (its ``archives``: dataset name -> :class:`Archive`'s fields), each field's
    name and type checked (a ValueError naming the archive otherwise)."""
    import dataclasses
    import json

    table = json.loads(path.read_text(encoding="utf-8"))["archives"]
    known = {f.name for f in dataclasses.fields(Archive)}
    archives = {}
    def text(v) -> bool:
        return isinstance(v, str) and v != ""

    for name, fields in table.items():
        if not isinstance(fields, dict):
            fields = {"": fields}  # refused below
        required, file_md5 = fields.get("required"), fields.get("file_md5", {})
        good = set(fields) <= known and isinstance(required, list) and \
            all(text(r) for r in required) and isinstance(file_md5, dict) and \
            all(text(k) and text(v) for k, v in file_md5.items()) and \
            all(text(fields.get(k)) for k in ("title", "url", "filename", "md5", "folder", "layout")) and \
            isinstance(fields.get("loose_files_ok", False), bool) and \
            (fields.get("size") is None or (type(fields["size"]) is int and fields["size"] > 0))
        if not good:
            raise ValueError(f"{path}: the archive of {name!r} has a field of the wrong name or type")
        archives[name] = Archive(**{**fields, "required": tuple(required)})
    return archives


ARCHIVES: dict[str, Archive] = read_archives()

DOWNLOAD_TIMEOUT = 15.0  # seconds: connect timeout and the longest wait for one read
DOWNLOAD_DEADLINE = 3600.0  # seconds: the longest one file's download may take, however the server trickles
_CHUNK = 1 << 20

# md5s already checked in this process, keyed by (path, size, mtime): a file is hashed once per process.
_verified: set[tuple[str, int, int, str]] = set()


def md5_of(path: str | os.PathLike) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_md5(path: Path, expected: str) -> None:
    """Raise :class:`DatasetError` when ``path``'s md5 is not ``expected``."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, expected)
    if key in _verified:
        return
    got = md5_of(path)
    if got != expected:
        raise DatasetError(f"checksum mismatch for {path}: expected {expected}, got {got}")
    _verified.add(key)


def archive_for(name: str) -> Archive:
    try:
        return ARCHIVES[name]
    except KeyError:
        raise ConfigError(f"no archive known for dataset {name!r}: choose one of {', '.join(ARCHIVES)}") from None


def ensure_dataset(name: str, root: str | os.PathLike, download: bool = True,
                   required: tuple[str, ...] | None = None) -> Path:
    """Return the folder holding dataset ``name``'s extracted files, extracting or downloading them if needed.

    ``required`` overrides the table's list of files that must exist (EMNIST passes its split's four files).
    Raises :class:`DatasetError` when the files are missing and cannot be obtained, when a checksum does not
    match, or when an archive is corrupt.
    """
    spec = archive_for(name)
    root = Path(root).expanduser()
    needed = spec.required if required is None else tuple(required)

    found = _find_folder(spec, root, needed)
    if found is not None:
        _verify_files(spec, found)
        return found

    folder = root / spec.folder
    if folder.exists():
        missing = [f for f in needed if not (folder / f).exists()]
        raise DatasetError(
            f"{spec.title} folder {folder} is incomplete (missing {', '.join(missing)}); expected {spec.layout}; "
            f"delete it to have it re-extracted"
        )

    archive = root / spec.filename
    if not archive.is_file():
        if not download:
            raise DatasetError(_missing_message(spec, root, "download=False"))
        _download(spec, root, archive)
    verify_md5(archive, spec.md5)
    _extract(spec, archive, root, needed)
    _verify_files(spec, folder)
    return folder


def _find_folder(spec: Archive, root: Path, needed: tuple[str, ...]) -> Path | None:
    candidates = [root / spec.folder]
    if root.name == spec.folder or spec.loose_files_ok:
        candidates.append(root)
    for c in candidates:
        if c.is_dir() and all((c / f).exists() for f in needed):
            return c
    return None


def _verify_files(spec: Archive, folder: Path) -> None:
    for rel, md5 in spec.file_md5.items():
        path = folder / rel
        if path.is_file():
            verify_md5(path, md5)


def _missing_message(spec: Archive, root: Path, reason: str) -> str:
    where = f"{root / spec.folder}/" + (f" (or directly in {root}/)" if spec.loose_files_ok else "")
    return (
        f"{spec.title} not found: expected {where} holding {spec.layout}, or the archive {root / spec.filename}; "
        f"could not download it ({reason}); fetch {spec.url} by hand (md5 {spec.md5}) and put it in {root}/"
    )


def _remove_stale_temporaries(spec: Archive, root: Path) -> None:
    """A download or extraction killed midway leaves ``.NAME.PID.XXXXXXXX.part`` / ``.extracting``: removed here
    once the process that named it is gone (only these names; a live download's temporaries are kept)."""
    remove_stale_temporaries(root, (spec.filename, spec.folder))


def remove_stale_temporaries(folder: Path, names) -> None:
    """Remove ``folder``'s ``.NAME.PID.XXXXXXXX.part`` / ``.extracting`` temporaries of the given ``names`` whose
    process is gone (a download or extraction killed midway); nothing else."""
    import re

    from ..utils.lock import pid_alive

    alternatives = "|".join(re.escape(n) for n in names)
    pattern = re.compile(rf"^\.(?:{alternatives})\.(\d+)\.[a-z0-9_]{{8}}\.(?:part|extracting)$")
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for p in entries:
        m = pattern.match(p.name)
        if not m or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))) or p.is_symlink():
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def _download(spec: Archive, root: Path, archive: Path) -> None:
    """Fetch ``spec.url`` into ``archive``: written under a temporary name, renamed only when complete."""
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(spec, root)
    _fetch(spec.url, archive, spec.md5, lambda reason: _missing_message(spec, root, reason), size=spec.size)


class _Terminated(BaseException):
    """SIGTERM arrived during a download (raised so that its temporary file is removed on the way out)."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While a download runs in the main thread, SIGTERM (``kill``, ``timeout``) unwinds it like Ctrl-C does, so its
    ``.part`` file is removed; then the signal is delivered again, to end the process as it would have. A handler
    installed by someone else is left alone."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def unwind(signum, frame):
        raise _Terminated

    signal.signal(signal.SIGTERM, unwind)
    terminated = False
    try:
        yield
    except _Terminated:
        terminated = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if terminated:
        os.kill(os.getpid(), signal.SIGTERM)


class _Deadline:
    """The overall deadline of one download: when it passes, the connection's sockets are shut, so that a server
    that trickles (headers or data, a byte at a time) cannot keep a read going for ever."""

    def __init__(self, seconds: float):
        import threading

        self.seconds, self.expired, self._sockets = float(seconds), False, []
        self._lock = threading.Lock()
        self._timer = threading.Timer(self.seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self):
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()
        return False

    def watch(self, sock) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                self._shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                self._shut(sock)

    @staticmethod
    def _shut(sock) -> None:
        import socket

        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def opener(self):
        """A urllib opener whose HTTP(S) connections this deadline watches."""
        deadline = self

        def watched(http_class):
            class Watched(http_class):
                def connect(self):
                    super().connect()
                    deadline.watch(self.sock)

            return Watched

        class HTTP(urllib.request.HTTPHandler):
            def do_open(self, http_class, req, **kwargs):
                return super().do_open(watched(http_class), req, **kwargs)

        class HTTPS(urllib.request.HTTPSHandler):
            def do_open(self, http_class, req, **kwargs):
                return super().do_open(watched(http_class), req, **kwargs)

        return urllib.request.build_opener(HTTP, HTTPS)


def _fetch(url: str, dest: Path, md5: str, missing: Callable[[str], str], size: int | None = None) -> None:
    """Download ``url`` to ``dest`` under a temporary name in its folder; check its md5; rename it into place only
    when complete. A failed request raises :class:`DatasetError` with ``missing(reason)``.

    Bounded: ``size`` (the file's known size) caps what is accepted (a server announcing or sending more is
    stopped), :data:`DOWNLOAD_DEADLINE` caps the time the whole download takes, :data:`DOWNLOAD_TIMEOUT` each wait.
    The temporary ``.part`` file is removed on every way out (an error, the deadline, Ctrl-C, SIGTERM)."""
    with _sigterm_unwinds():
        fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.{os.getpid()}.", suffix=".part", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, _Deadline(DOWNLOAD_DEADLINE) as deadline:
                late = lambda got: DatasetError(missing(  # noqa: E731
                    f"{url}: not finished within {deadline.seconds:g} s ({got:,} bytes received); stopped"))
                try:
                    with deadline.opener().open(url, timeout=DOWNLOAD_TIMEOUT) as resp:
                        total = resp.headers.get("Content-Length") if hasattr(resp, "headers") else None
                        total = int(total) if total and total.isdigit() else None
                        if size is not None and total is not None and total > size:
                            raise DatasetError(missing(f"{url}: the server announces {total:,} bytes, more than the "
                                                       f"{size:,} of {dest.name}; not downloaded"))
                        got = _copy_with_progress(resp, out, total or size, dest.name, size, deadline, url, missing)
                except urllib.error.HTTPError as e:
                    raise DatasetError(missing(f"{url}: HTTP {e.code} {e.reason}")) from None
                except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                    if deadline.expired:
                        raise late(out.tell()) from None
                    reason = getattr(e, "reason", None) or e
                    raise DatasetError(missing(f"{url}: {reason}")) from None
                if deadline.expired:  # the shut socket may read as the end of the data
                    raise late(got)
                out.flush()
                os.fsync(out.fileno())
            got = md5_of(tmp)
            if got != md5:
                raise DatasetError(f"checksum mismatch for {dest.name} downloaded from {url}: expected {md5}, "
                                   f"got {got}")
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _copy_with_progress(src, dst, total: int | None, label: str, limit: int | None = None,
                        deadline: _Deadline | None = None, url: str = "", missing=str) -> int:
    """Copy ``src`` to ``dst`` (what arrives, as it arrives: ``read1``), at most ``limit`` bytes and not past the
    ``deadline``; returns the bytes copied."""
    import time

    from tqdm import tqdm

    read = getattr(src, "read1", None) or src.read
    ends = time.monotonic() + deadline.seconds if deadline is not None else None
    received = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {label}",
              disable=not sys.stderr.isatty(), leave=False) as bar:
        for chunk in iter(lambda: read(_CHUNK), b""):
            received += len(chunk)
            if limit is not None and received > limit:
                raise DatasetError(missing(f"{url}: the server sent more than the {limit:,} bytes of {label}; "
                                           "stopped"))
            dst.write(chunk)
            bar.update(len(chunk))
            if ends is not None and (deadline.expired or time.monotonic() > ends):
                raise DatasetError(missing(f"{url}: not finished within {deadline.seconds:g} s ({received:,} bytes "
                                           "received); stopped"))
    return received


def _extract(spec: Archive, archive: Path, root: Path, needed: tuple[str, ...]) -> None:
    """Extract into a temporary folder inside ``root``; move ``spec.folder`` into place only when complete."""
    _remove_stale_temporaries(spec, root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder}.{os.getpid()}.", suffix=".extracting", dir=root))
    try:
        try:
            if zipfile.is_zipfile(archive):
                _extract_zip(archive, tmp)
            else:
                _extract_tar(archive, tmp)
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, ValueError) as e:
            raise DatasetError(f"cannot extract {archive}: {e}") from None
        produced = tmp / spec.folder
        missing = [f for f in needed if not (produced / f).exists()]
        if not produced.is_dir() or missing:
            what = f"{spec.folder}/" if not produced.is_dir() else ", ".join(f"{spec.folder}/{m}" for m in missing)
            raise DatasetError(f"archive {archive} does not contain {what}")
        try:
            os.replace(produced, root / spec.folder)
        except OSError as e:
            # Another process (e.g. a parallel run) may have put a complete copy there first: use it.
            if _find_folder(spec, root, needed) is None:
                raise DatasetError(f"cannot move the extracted files to {root / spec.folder}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _inside(base: Path, name: str) -> bool:
    target = (base / name).resolve()
    return target == base or base in target.parents


def _extract_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:*") as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
            return
        base = dest.resolve()  # older Pythons: refuse absolute paths, '..' and links by hand
        for m in tf.getmembers():
            if not _inside(base, m.name) or m.issym() or m.islnk() or m.isdev():
                raise DatasetError(f"refusing to extract unsafe member {m.name!r} of {archive}")
        tf.extractall(dest)


def _extract_zip(archive: Path, dest: Path) -> None:
    base = dest.resolve()
    with zipfile.ZipFile(archive) as zf:
        for name in zf.namelist():
            if not _inside(base, name):
                raise DatasetError(f"refusing to extract unsafe member {name!r} of {archive}")
        zf.extractall(dest)


# ---------------------------------------------------------------------------------------------------- Fashion-MNIST
#: Where Debian's ``dataset-fashion-mnist`` package puts the four files (module-level so tests can point it elsewhere)
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_FOLDER = "fashion-mnist"
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"


@dataclass(frozen=True)
class IdxFile:
    """One Fashion-MNIST file: the md5 of upstream's .gz (checked after a download) and the sha256 of the
    decompressed IDX bytes (checked on every load: Debian recompressed the .gz files, so their md5s differ)."""

    name: str
    gz_md5: str
    sha256: str
    size: int | None = None  # bytes of the decompressed IDX file: a header declaring more is refused
    gz_size: int | None = None  # bytes of upstream's .gz: a download stops beyond it


#: train images, train labels, test images, test labels (docs/datasets.md, "Datasets")
FASHION_MNIST_FILES: tuple[IdxFile, ...] = (
    IdxFile("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888", 16 + 60_000 * 28 * 28, 26_421_880),
    IdxFile("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe",
            "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9", 8 + 60_000, 29_515),
    IdxFile("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79",
            "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b", 16 + 10_000 * 28 * 28, 4_422_102),
    IdxFile("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310",
            "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34", 8 + 10_000, 5_148),
)


def _fashion_missing(root: Path, reason: str) -> str:
    return (f"Fashion-MNIST not found in {root / FASHION_MNIST_FOLDER}/, {root}/ or {DEBIAN_FASHION_MNIST}/ "
            f"({reason}): install the Debian package (apt-get install {FASHION_MNIST_PACKAGE}) or run with "
            f"--download to fetch it from {FASHION_MNIST_URL}")


def ensure_fashion_mnist(root: str | os.PathLike, download: bool = False) -> Path:
    """The folder holding Fashion-MNIST's four ``.gz`` files: ``root/fashion-mnist/`` or ``root/`` (``--data-dir``),
    else Debian's :data:`DEBIAN_FASHION_MNIST`, else (``download``) fetched from upstream into
    ``root/fashion-mnist/`` file by file, each under a temporary name, md5-checked, then renamed into place.
    Raises :class:`DatasetError` with one line naming the apt package and ``--download`` when none works."""
    root = Path(root).expanduser()
    names = [f.name for f in FASHION_MNIST_FILES]
    for folder in (root / FASHION_MNIST_FOLDER, root, DEBIAN_FASHION_MNIST):
        if folder.is_dir() and all((folder / n).is_file() for n in names):
            return folder
    if not download:
        raise DatasetError(_fashion_missing(root, "not downloaded without --download"))
    folder = root / FASHION_MNIST_FOLDER
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetError(_fashion_missing(root, f"cannot create {folder}: {e.strerror or e}")) from None
    remove_stale_temporaries(folder, names)  # of a download killed midway
    for f in FASHION_MNIST_FILES:
        if not (folder / f.name).is_file():
            _fetch(FASHION_MNIST_URL + f.name, folder / f.name, f.gz_md5,
                   lambda reason: _fashion_missing(root, f"could not download it: {reason}"), size=f.gz_size)
    return folder
