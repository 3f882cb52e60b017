"""Readers for the standard on-disk dataset formats (docs/datasets.md, "Datasets"), without torchvision.

Every loader takes ``root``, the folder that holds the extracted dataset folder (see :mod:`flatfl.data.download`
for the full layout)::

    load_cifar10(root)       root/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
    load_cifar100(root)      root/cifar-100-python/{train, test, meta}
    load_tinyimagenet(root)  root/tiny-imagenet-200/{wnids.txt, train/<wnid>/images/*.JPEG,
                                                     val/images/*.JPEG, val/val_annotations.txt}
    load_emnist(root)        root/gzip/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz
                             (or the same .gz files directly in root)
    load_fashion_mnist(root) root/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (or in root, or
                             Debian's /usr/share/datasets/fashion-mnist/)

and returns an :class:`~flatfl.data.image.ImageDataset` with uint8 images (N, C, H, W) and int64 labels. Missing
files are fetched (when ``download`` is true) by :func:`~flatfl.data.download.ensure_dataset`; unreadable or
inconsistent files raise :class:`~flatfl.errors.DatasetError` naming the file.
"""
from __future__ import annotations

import gzip
import hashlib
import math
import os
import pickle
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DatasetError
from ..utils.io import atomic_open
from .image import ImageDataset
from .download import ensure_dataset

# Normalisation constants (mean, std of x/255 per channel).
CIFAR10_MEAN, CIFAR10_STD = (0.491, 0.482, 0.447), (0.247, 0.243, 0.262)  # FedDyn / MAN code
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)  # docs/datasets.md, MAN code
TINYIMAGENET_MEAN, TINYIMAGENET_STD = (0.4802, 0.4481, 0.3975), (0.2302, 0.2265, 0.2262)


# ----------------------------------------------------------------------------------------------------------- CIFAR
class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts/lists of numbers, strings and numpy arrays, and refuses every other global.

    The CIFAR files are pickles; a general unpickler would run whatever code a tampered file names.
    """

    _sample = np.zeros(1, dtype=np.uint8)
    _ALLOWED = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("numpy.core.multiarray", "_reconstruct"): _sample.__reduce_ex__(2)[0],
        ("numpy._core.multiarray", "_reconstruct"): _sample.__reduce_ex__(2)[0],
        ("numpy.core.numeric", "_frombuffer"): _sample.__reduce_ex__(5)[0],
        ("numpy._core.numeric", "_frombuffer"): _sample.__reduce_ex__(5)[0],
        ("_codecs", "encode"): __import__("codecs").encode,
    }

    def find_class(self, module: str, name: str):
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}") from None


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = _ArrayUnpickler(f, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            UnicodeDecodeError, OSError, MemoryError) as e:
        raise DatasetError(f"cannot read CIFAR pickle {path}: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"CIFAR pickle {path} holds a {type(obj).__name__}, expected a dict")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _field(d: dict, key: str, path: Path):
    if key not in d:
        raise DatasetError(f"CIFAR pickle {path} has no {key!r} entry (has {', '.join(map(str, d))})")
    return d[key]


def _cifar_batch(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR batch file -> images uint8 (N, 3, 32, 32) and labels int64 (N,).

    ``data`` rows hold the 1024 red, then 1024 green, then 1024 blue values, each plane row-major.
    """
    d = _unpickle(path)
    data = np.asarray(_field(d, "data", path))
    labels = np.asarray(_field(d, label_key, path))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DatasetError(f"CIFAR pickle {path}: 'data' is {data.dtype} {data.shape}, expected uint8 (N, 3072)")
    if labels.shape != (data.shape[0],):
        raise DatasetError(f"CIFAR pickle {path}: {len(labels)} labels for {data.shape[0]} images")
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetError(f"CIFAR pickle {path}: labels outside 0..{num_classes - 1}")
    return data.reshape(-1, 3, 32, 32), labels


def _class_names(path: Path, key: str, num_classes: int) -> list[str]:
    names = [str(n) for n in _field(_unpickle(path), key, path)]
    if len(names) != num_classes:
        raise DatasetError(f"CIFAR meta file {path}: {len(names)} names in {key!r}, expected {num_classes}")
    return names


def _as_dataset(name: str, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                num_classes: int, mean, std, class_names: list[str], augment: bool) -> ImageDataset:
    return ImageDataset(
        name=name,
        train_x=torch.from_numpy(np.ascontiguousarray(train[0])), train_y=torch.from_numpy(train[1]),
        test_x=torch.from_numpy(np.ascontiguousarray(test[0])), test_y=torch.from_numpy(test[1]),
        num_classes=num_classes, mean=tuple(mean), std=tuple(std), max_value=255.0,
        class_names=class_names, augment_default=augment,
    )


def load_cifar10(root: str | os.PathLike, download: bool = True) -> ImageDataset:
    """CIFAR-10 from ``root/cifar-10-batches-py`` (50,000 train / 10,000 test, 3x32x32, 10 classes).

    Normalisation: the FedDyn code's mean (0.491, 0.482, 0.447), std (0.247, 0.243, 0.262). Flip + crop
    augmentation on by default (docs/update-rules.md §0).
    """
    folder = ensure_dataset("cifar10", root, download)
    batches = [_cifar_batch(folder / f"data_batch_{i}", "labels", 10) for i in range(1, 6)]
    train = (np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches]))
    test = _cifar_batch(folder / "test_batch", "labels", 10)
    names = _class_names(folder / "batches.meta", "label_names", 10)
    return _as_dataset("cifar10", train, test, 10, CIFAR10_MEAN, CIFAR10_STD, names, augment=True)


def load_cifar100(root: str | os.PathLike, download: bool = True) -> ImageDataset:
    """CIFAR-100 from ``root/cifar-100-python`` (50,000 / 10,000, 3x32x32, the 100 ``fine_labels``).

    Normalisation: mean (0.5071, 0.4867, 0.4408), std (0.2675, 0.2565, 0.2761) (docs/datasets.md, MAN code).
    """
    folder = ensure_dataset("cifar100", root, download)
    train = _cifar_batch(folder / "train", "fine_labels", 100)
    test = _cifar_batch(folder / "test", "fine_labels", 100)
    names = _class_names(folder / "meta", "fine_label_names", 100)
    return _as_dataset("cifar100", train, test, 100, CIFAR100_MEAN, CIFAR100_STD, names, augment=True)


# ---------------------------------------------------------------------------------------------------- Tiny-ImageNet
TINY_SIZE = 64
_TINY_CACHE = "flatfl-decoded.npz"  # inside root/tiny-imagenet-200/


def _tiny_listing(folder: Path) -> tuple[list[str], list[tuple[Path, int]], list[tuple[Path, int]]]:
    """Class ids (sorted) and the (file, label) lists of the train and val splits."""
    wnids_file = folder / "wnids.txt"
    wnids = sorted({w.strip() for w in wnids_file.read_text().split() if w.strip()})
    if not wnids:
        raise DatasetError(f"{wnids_file} lists no class ids")
    index = {w: i for i, w in enumerate(wnids)}

    train: list[tuple[Path, int]] = []
    for w in wnids:
        images = folder / "train" / w / "images"
        if not images.is_dir():
            raise DatasetError(f"Tiny-ImageNet class folder {images} is missing")
        files = sorted(p for p in images.iterdir() if p.suffix.lower() in (".jpeg", ".jpg"))
        if not files:
            raise DatasetError(f"Tiny-ImageNet class folder {images} holds no JPEG files")
        train.extend((p, index[w]) for p in files)

    ann = folder / "val" / "val_annotations.txt"
    val: list[tuple[Path, int]] = []
    for lineno, line in enumerate(ann.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) < 2 or parts[1].strip() not in index:
            raise DatasetError(f"{ann} line {lineno}: expected '<file>\\t<wnid>\\t...' with a wnid from wnids.txt")
        val.append((folder / "val" / "images" / parts[0].strip(), index[parts[1].strip()]))
    if not val:
        raise DatasetError(f"{ann} lists no images")
    return wnids, train, val


def _tiny_fingerprint(folder: Path, wnids: list[str], train, val) -> str:
    """Identifies the file set the cache was decoded from (names, sizes, modification times)."""
    h = hashlib.sha256()
    h.update("\n".join(wnids).encode())
    for path, label in list(train) + list(val):
        st = path.stat() if path.exists() else None
        h.update(f"{path.relative_to(folder)}|{label}|{st and st.st_size}|{st and st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _decode_jpegs(items: list[tuple[Path, int]], what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:  # pragma: no cover - pillow is a dependency
        raise DatasetError("reading Tiny-ImageNet needs pillow: pip install pillow") from None
    from tqdm import tqdm

    x = np.empty((len(items), 3, TINY_SIZE, TINY_SIZE), dtype=np.uint8)
    y = np.empty(len(items), dtype=np.int64)
    for i, (path, label) in enumerate(tqdm(items, desc=f"decoding Tiny-ImageNet {what}", leave=False,
                                           disable=not sys.stderr.isatty())):
        try:
            with Image.open(path) as im:
                rgb = np.asarray(im.convert("RGB"))  # some images are greyscale
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise DatasetError(f"cannot decode image {path}: {e}") from None
        if rgb.shape != (TINY_SIZE, TINY_SIZE, 3):
            raise DatasetError(f"image {path} is {rgb.shape[1]}x{rgb.shape[0]}, expected {TINY_SIZE}x{TINY_SIZE}")
        x[i] = rgb.transpose(2, 0, 1)
        y[i] = label
    return x, y


def load_tinyimagenet(root: str | os.PathLike, download: bool = True) -> ImageDataset:
    """Tiny-ImageNet from ``root/tiny-imagenet-200`` (100,000 train / 10,000 val as test, 3x64x64, 200 classes).

    Labels index the *sorted* wnids (the ImageFolder convention; ``wnids.txt`` itself is unsorted); class names
    come from ``words.txt`` when present. The official test split is unlabelled, so val is the test set.
    Decoding 110k JPEGs takes a while, so the decoded arrays are cached in ``tiny-imagenet-200/flatfl-decoded.npz``
    (written atomically, rebuilt when the files change; if the folder is read-only the cache is skipped).
    Normalisation: mean (0.4802, 0.4481, 0.3975), std (0.2302, 0.2265, 0.2262).
    """
    folder = ensure_dataset("tinyimagenet", root, download)
    wnids, train, val = _tiny_listing(folder)
    fingerprint = _tiny_fingerprint(folder, wnids, train, val)
    cache = folder / _TINY_CACHE
    arrays = _read_tiny_cache(cache, fingerprint)
    if arrays is None:
        arrays = (*_decode_jpegs(train, "train"), *_decode_jpegs(val, "val"))
        try:
            with atomic_open(cache, "wb") as f:
                np.savez(f, train_x=arrays[0], train_y=arrays[1], test_x=arrays[2], test_y=arrays[3],
                         fingerprint=np.array(fingerprint))
        except OSError as e:
            warnings.warn(f"could not write the Tiny-ImageNet cache {cache}: {e}", stacklevel=2)
    names = _tiny_class_names(folder, wnids)
    return _as_dataset("tinyimagenet", (arrays[0], arrays[1]), (arrays[2], arrays[3]), len(wnids),
                       TINYIMAGENET_MEAN, TINYIMAGENET_STD, names, augment=True)


def _read_tiny_cache(cache: Path, fingerprint: str):
    if not cache.is_file():
        return None
    try:
        with np.load(cache, allow_pickle=False) as z:
            if str(z["fingerprint"]) != fingerprint:
                return None
            return z["train_x"], z["train_y"], z["test_x"], z["test_y"]
    except (OSError, ValueError, KeyError, EOFError, zlib.error) as e:
        warnings.warn(f"ignoring unreadable Tiny-ImageNet cache {cache}: {e}", stacklevel=3)
        return None


def _tiny_class_names(folder: Path, wnids: list[str]) -> list[str]:
    words = folder / "words.txt"
    names = dict.fromkeys(wnids, "")
    if words.is_file():
        for line in words.read_text(errors="replace").splitlines():
            wnid, _, text = line.partition("\t")
            if wnid in names:
                names[wnid] = text.strip()
    return [names[w] or w for w in wnids]


# ----------------------------------------------------------------------------------------------------------- EMNIST
_DIGITS = "0123456789"
_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_MERGED_LOWER = "abdefghnqrt"  # the lower-case letters bymerge/balanced keep apart from their upper case
# split -> (class names, label offset in the files). "letters" labels run 1..26 in the files; they become 0..25.
EMNIST_SPLITS: dict[str, tuple[str, int]] = {
    "byclass": (_DIGITS + _UPPER + _UPPER.lower(), 0),
    "bymerge": (_DIGITS + _UPPER + _MERGED_LOWER, 0),
    "balanced": (_DIGITS + _UPPER + _MERGED_LOWER, 0),
    "letters": (_UPPER, 1),
    "digits": (_DIGITS, 0),
    "mnist": (_DIGITS, 0),
}
_IDX_IMAGES_MAGIC, _IDX_LABELS_MAGIC = 0x00000803, 0x00000801  # uint8 data, 3 resp. 1 dimensions


#: the most an IDX file's header may declare when its real size is not known (EMNIST): above the largest file of the
#: data sets read here (EMNIST byclass's training images, 697,932 x 28 x 28 + 16 = 547,178,704 bytes)
MAX_IDX_BYTES = 1 << 30
_IDX_CHUNK = 1 << 22


def read_idx(path: Path, magic: int, sha256: str | None = None, size: int | None = None) -> np.ndarray:
    """Read a gzipped IDX file: big-endian uint32 magic (0, 0, type 0x08 = uint8, ndim), ndim uint32 sizes, data.

    Streamed, never inflated beyond what its header declares: the header is read first, and a declared size above
    ``size`` (the file's known size, when known) or :data:`MAX_IDX_BYTES` is refused before anything else is
    inflated; then exactly the declared bytes are read, and a file holding more (a gzip bomb behind a plausible
    header) is refused without reading on. ``sha256``: the expected hash of the decompressed bytes (a mismatch
    raises :class:`DatasetError`)."""
    ndim = magic & 0xFF
    header_len = 4 + 4 * ndim
    limit = MAX_IDX_BYTES if size is None else int(size)
    try:
        with gzip.open(path, "rb") as f:
            header = f.read(header_len)
            if len(header) < header_len:
                raise DatasetError(f"IDX file {path} is truncated: {len(header)} bytes, shorter than its header")
            got = int.from_bytes(header[:4], "big")
            if got != magic:
                raise DatasetError(f"IDX file {path} has magic number 0x{got:08x}, expected 0x{magic:08x}")
            dims = tuple(int.from_bytes(header[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
            expected = header_len + math.prod(dims)
            if expected > limit:
                raise DatasetError(f"IDX file {path} declares {dims} ({expected:,} bytes), more than the "
                                   f"{limit:,} bytes this file may hold: refused before inflating it")
            try:
                data = np.empty(expected - header_len, dtype=np.uint8)
            except MemoryError:
                raise DatasetError(f"IDX file {path} declares {dims} ({expected:,} bytes): not enough memory "
                                   "to hold it") from None
            view, filled = memoryview(data), 0
            while filled < data.size:
                n = f.readinto(view[filled:filled + _IDX_CHUNK])
                if not n:
                    break
                filled += n
            if filled < data.size:
                raise DatasetError(f"IDX file {path} has {header_len + filled} bytes, its header {dims} implies "
                                   f"{expected}")
            if f.read(1):
                raise DatasetError(f"IDX file {path} holds more than the {expected:,} bytes its header {dims} "
                                   "declares (the rest was not inflated)")
    except (OSError, EOFError, zlib.error) as e:
        raise DatasetError(f"cannot decompress IDX file {path}: {e}") from None
    if sha256 is not None:
        digest = hashlib.sha256(header)
        digest.update(view)
        if digest.hexdigest() != sha256:
            raise DatasetError(f"checksum mismatch for {path}: the decompressed IDX bytes have sha256 "
                               f"{digest.hexdigest()}, expected {sha256}")
    return data.reshape(dims)


def emnist_files(split: str) -> tuple[str, str, str, str]:
    """File names of a split: train images, train labels, test images, test labels."""
    return tuple(f"emnist-{split}-{part}-ubyte.gz" for part in  # type: ignore[return-value]
                 ("train-images-idx3", "train-labels-idx1", "test-images-idx3", "test-labels-idx1"))


def _idx_pair(images_path: Path, labels_path: Path, num_classes: int, offset: int = 0,
              sha256: tuple[str | None, str | None] = (None, None),
              sizes: tuple[int | None, int | None] = (None, None)) -> tuple[np.ndarray, np.ndarray]:
    """One split's 28x28 images (N, 28, 28) as stored and its labels (minus ``offset``), checked for consistency."""
    images = read_idx(images_path, _IDX_IMAGES_MAGIC, sha256[0], sizes[0])
    labels = read_idx(labels_path, _IDX_LABELS_MAGIC, sha256[1], sizes[1]).astype(np.int64) - offset
    if images.shape[1:] != (28, 28):
        raise DatasetError(f"IDX file {images_path} holds {images.shape[1]}x{images.shape[2]} images, expected 28x28")
    if len(labels) != len(images):
        raise DatasetError(f"{labels_path} has {len(labels)} labels for the {len(images)} images of {images_path}")
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetError(f"{labels_path}: labels outside {offset}..{num_classes - 1 + offset}")
    return images, labels


def _emnist_part(images_path: Path, labels_path: Path, num_classes: int, offset: int) -> tuple[np.ndarray, np.ndarray]:
    images, labels = _idx_pair(images_path, labels_path, num_classes, offset)
    # The files store each image transposed (column-major) relative to MNIST: swap rows and columns.
    return np.ascontiguousarray(images.transpose(0, 2, 1))[:, None], labels


def _mean_std_uint8(x: np.ndarray) -> tuple[float, float]:
    """Exact mean and std of x/255 over all pixels, from the 256-bin histogram of the uint8 values."""
    counts = torch.from_numpy(np.ascontiguousarray(x).reshape(-1)).bincount(minlength=256).double()
    v = torch.arange(256, dtype=torch.float64) / 255.0
    n = counts.sum()
    mean = (counts * v).sum() / n
    var = (counts * (v - mean) ** 2).sum() / n
    return float(mean), float(var.sqrt())


def load_emnist(root: str | os.PathLike, download: bool = True, split: str = "byclass") -> ImageDataset:
    """EMNIST (28x28 grey handwritten characters) from the NIST IDX files, in ``root/gzip/`` or ``root/``.

    Default split "byclass" (62 classes: digits, upper- and lower-case letters; 697,932 train / 116,323 test).
    The FedSAM slides (Table 1) name only "EMNIST"; the methods it compares against (MimeLite, FedCM)
    were run on the 62-class federated EMNIST, and byclass is the NIST split with exactly those 62 classes and
    all the images ("balanced", 47 classes, is the other common choice: pass ``split="balanced"``). This choice is
    an inference, not stated in the slides. ``split`` is one of byclass, bymerge, balanced, letters (labels
    shifted to 0..25), digits, mnist.

    Normalisation: the exact per-pixel mean/std of the split's *training* images (computed at load time, as for
    ``digits``), because the published constants differ between splits. No augmentation by default.
    Images are transposed on disk relative to MNIST; they are returned upright.
    """
    key = split.lower()
    if key not in EMNIST_SPLITS:
        raise ConfigError(f"unknown EMNIST split {split!r}: choose one of {', '.join(EMNIST_SPLITS)}")
    names, offset = EMNIST_SPLITS[key]
    files = emnist_files(key)
    folder = ensure_dataset("emnist", root, download, required=files)
    train = _emnist_part(folder / files[0], folder / files[1], len(names), offset)
    test = _emnist_part(folder / files[2], folder / files[3], len(names), offset)
    mean, std = _mean_std_uint8(train[0])
    return _as_dataset("emnist", train, test, len(names), (mean,), (std,), list(names), augment=False)


# ---------------------------------------------------------------------------------------------------- Fashion-MNIST
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot")


def load_fashion_mnist(root: str | os.PathLike, download: bool = False) -> ImageDataset:
    """Fashion-MNIST (Xiao et al. 2017; 60,000 train / 10,000 test 28x28 grey images of clothes, 10 classes).

    Files: ``{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`` in ``root/fashion-mnist/`` or ``root/``, else in
    Debian's ``/usr/share/datasets/fashion-mnist/`` (``apt-get install dataset-fashion-mnist``), else downloaded
    when ``download`` (:func:`~flatfl.data.download.ensure_fashion_mnist`). The sha256 of each file's decompressed
    bytes is checked on every load (the same for Debian's recompressed files and upstream's). Images are stored
    upright (not transposed as EMNIST's). Normalisation: the exact mean/std of the training images (0.2860, 0.3530).
    No augmentation by default.
    """
    from .download import FASHION_MNIST_FILES, ensure_fashion_mnist

    folder = ensure_fashion_mnist(root, download)
    files = [folder / f.name for f in FASHION_MNIST_FILES]
    hashes = [f.sha256 for f in FASHION_MNIST_FILES]
    sizes = [f.size for f in FASHION_MNIST_FILES]  # known: a header declaring more is refused before inflating
    k = len(FASHION_MNIST_CLASSES)
    train_x, train_y = _idx_pair(files[0], files[1], k, sha256=(hashes[0], hashes[1]), sizes=(sizes[0], sizes[1]))
    test_x, test_y = _idx_pair(files[2], files[3], k, sha256=(hashes[2], hashes[3]), sizes=(sizes[2], sizes[3]))
    train_x, test_x = train_x[:, None].copy(), test_x[:, None].copy()  # writable (N, 1, 28, 28)
    mean, std = _mean_std_uint8(train_x)
    return _as_dataset("fashion-mnist", (train_x, train_y), (test_x, test_y), k, (mean,), (std,),
                       list(FASHION_MNIST_CLASSES), augment=False)
