"""Datasets held in memory as uint8 image tensors, with their per-dataset normalisation.

``load_dataset(name, data_dir)`` returns an :class:`ImageDataset`. Images stay uint8 (N, C, H, W) until a batch is
drawn, so CIFAR-100 costs 150 MB and Tiny-ImageNet 1.2 GB of memory; :meth:`ImageDataset.normalize` turns a batch
into float32 on the batch's device.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError, unknown_name
from ..utils.torch_files import PLAIN_PICKLE, check_nesting, load_weights_only, plain_pickle
from .image import ImageDataset

__all__ = ["DATASETS", "ImageDataset", "as_image_dataset", "dataset_payload", "digits_arrays", "load_dataset",
           "load_saved_dataset"]


CUSTOM_DATA_FORMAT = "flatfl-data"


MAX_CLASSES = 100_000  # class indices a data set may use (each is a network output and a label-count column)


def _stack(data, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of a TensorDataset, a pair of tensors/arrays, or any map-style dataset of (input, label)."""
    tensors = getattr(data, "tensors", None)
    if isinstance(tensors, (tuple, list)) and len(tensors) == 2:  # torch.utils.data.TensorDataset
        x, y = tensors
    elif isinstance(data, (tuple, list)) and len(data) == 2 and all(hasattr(t, "shape") for t in data):
        x, y = data
    else:
        try:
            n = len(data)
            items = [data[i] for i in range(n)]
        except Exception as e:
            raise ConfigError(f"{what}: expected a map-style dataset of (image, label) pairs (len() and [i]), a "
                              f"TensorDataset or a pair of tensors; got {type(data).__name__} ({e})") from None
        if n == 0:
            raise ConfigError(f"{what} is empty")
        if not all(isinstance(it, (tuple, list)) and len(it) >= 2 for it in items):
            raise ConfigError(f"{what}: every item must be an (image, label) pair")
        try:
            inputs = [torch.as_tensor(np.asarray(it[0]) if not torch.is_tensor(it[0]) else it[0]) for it in items]
        except Exception as e:
            raise ConfigError(f"{what}: an item's image is not an array of numbers ({type(e).__name__})") from None
        shapes = {tuple(t.shape) for t in inputs}
        if len(shapes) > 1:
            first = tuple(inputs[0].shape)
            k = next(i for i, t in enumerate(inputs) if tuple(t.shape) != first)
            raise ConfigError(f"{what}: items have different shapes (item 0 is {first}, item {k} is "
                              f"{tuple(inputs[k].shape)}); every image must have one shape")
        x = torch.stack(inputs)
        try:
            y = torch.as_tensor([int(it[1]) for it in items])
        except (TypeError, ValueError, OverflowError, RuntimeError):
            raise ConfigError(f"{what}: every label must be one integer class index") from None
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if y.dim() != 1 or len(y) != len(x):
        raise ConfigError(f"{what}: need one integer label per input, got inputs {tuple(x.shape)} and labels "
                          f"{tuple(y.shape)}")
    if y.is_floating_point() and not bool((y == y.round()).all()):
        raise ConfigError(f"{what}: labels must be class indices (integers)")
    y = y.to(torch.int64)
    if len(y) and int(y.min()) < 0:
        raise ConfigError(f"{what}: labels must be class indices >= 0")
    if len(y) and int(y.max()) >= MAX_CLASSES:
        raise ConfigError(f"{what}: a label is {int(y.max())}; class indices must be below {MAX_CLASSES:,} (one "
                          "output and one column of every client's label counts per class)")
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        raise ConfigError(f"{what}: the inputs hold NaN or infinite values")
    if x.dim() == 3:  # (N, H, W) grey images
        x = x.unsqueeze(1)
    if x.dtype != torch.uint8:
        x = x.to(torch.float32)
    return x.contiguous(), y.contiguous()


def as_image_dataset(train, test=None, *, num_classes: int | None = None, name: str = "custom") -> ImageDataset:
    """An :class:`ImageDataset` from your own data: ``train`` (and ``test``) may each be a
    ``torch.utils.data.TensorDataset``, any map-style dataset of (image, label) pairs, or an (inputs, labels) pair
    of tensors. An :class:`ImageDataset` is returned unchanged.

    Inputs are held in memory. Float inputs are used as given (no scaling); uint8 images are scaled to [0, 1] and
    standardised per channel with the training split's mean and standard deviation, as the built-in datasets are.
    Without ``test``, a fixed 20% of each class of ``train`` (a permutation seeded 20240531, independent of the run
    seed) is held out as the test split. ``num_classes`` defaults to the largest label + 1.
    """
    if isinstance(train, ImageDataset):
        return train
    x, y = _stack(train, "dataset")
    if test is not None:
        tx, ty = _stack(test, "test dataset")
        if tuple(tx.shape[1:]) != tuple(x.shape[1:]):
            raise ConfigError(f"test inputs have shape {tuple(tx.shape[1:])}, training inputs {tuple(x.shape[1:])}")
        tx = tx.to(x.dtype)
    else:
        tr, te = _held_out_split(y.numpy())
        x, y, tx, ty = x[tr], y[tr], x[te], y[te]
    k = int(max(int(y.max()), int(ty.max()) if len(ty) else 0)) + 1
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or not 1 <= num_classes <= MAX_CLASSES:
            raise ConfigError(f"num_classes must be an integer from 1 to {MAX_CLASSES:,}, got {num_classes!r}")
        if num_classes < k:
            raise ConfigError(f"num_classes={num_classes} but a label is {k - 1}")
        k = int(num_classes)
    if x.dtype == torch.uint8:
        xf = x.float() / 255.0
        dims = [0] + list(range(2, x.dim()))
        mean = tuple(float(v) for v in xf.mean(dim=dims).reshape(-1))
        std = tuple(max(float(v), 1e-8) for v in xf.std(dim=dims).reshape(-1))
        max_value = 255.0
    else:
        mean, std, max_value = (0.0,), (1.0,), 1.0
    return ImageDataset(name=name, train_x=x, train_y=y, test_x=tx.contiguous(), test_y=ty.contiguous(),
                        num_classes=k, mean=mean, std=std, max_value=max_value,
                        class_names=[str(i) for i in range(k)], augment_default=False)


def _held_out_split(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fixed stratified 80/20 split (20% of each class, rounded down, to the test side)."""
    rng = np.random.default_rng(20240531)
    test_mask = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        test_mask[idx[: len(idx) // 5]] = True
    if test_mask.all() or not test_mask.any():
        raise ConfigError(f"cannot hold out a test split from {len(labels)} samples: pass a test dataset")
    return np.flatnonzero(~test_mask), np.flatnonzero(test_mask)


def dataset_payload(ds: ImageDataset) -> dict:
    """A custom dataset as plain tensors and values (``torch.load(weights_only=True)`` reads it back)."""
    return {"format": CUSTOM_DATA_FORMAT, "name": ds.name, "train_x": ds.train_x, "train_y": ds.train_y,
            "test_x": ds.test_x, "test_y": ds.test_y, "num_classes": ds.num_classes, "mean": list(ds.mean),
            "std": list(ds.std), "max_value": float(ds.max_value), "class_names": list(ds.class_names)}


def check_saved_dataset(d: dict, path) -> None:
    """A data.pt's fields by type and range: the four tensors (inputs of one shape, integer labels), a class count
    up to :data:`MAX_CLASSES` and every label below it; a DatasetError line naming the field otherwise."""
    from ..errors import DatasetError

    for key in ("train_x", "train_y", "test_x", "test_y"):
        if not isinstance(d.get(key), torch.Tensor):
            raise DatasetError(f"{path} is a damaged flatfl data file ({key} is not a tensor)")
    k = d.get("num_classes")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_CLASSES:
        raise DatasetError(f"{path} is a damaged flatfl data file (num_classes {k!r} is not an integer from 1 to "
                           f"{MAX_CLASSES:,})")
    for split in ("train", "test"):
        x, y = d[f"{split}_x"], d[f"{split}_y"]
        if y.dim() != 1 or y.is_floating_point() or y.is_complex() or len(y) != len(x):
            raise DatasetError(f"{path} is a damaged flatfl data file ({split}_y is not one integer label per input)")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= k):
            raise DatasetError(f"{path}: a {split} label is {int(y.min()) if int(y.min()) < 0 else int(y.max())}, "
                               f"outside the data set's {k} classes (0 to {k - 1})")
    if tuple(d["train_x"].shape[1:]) != tuple(d["test_x"].shape[1:]):
        raise DatasetError(f"{path} is a damaged flatfl data file (train and test inputs differ in shape)")
    for key, kind in (("mean", (list, tuple)), ("std", (list, tuple)), ("max_value", (int, float)),
                      ("class_names", (list, tuple)), ("name", (str,))):
        if isinstance(d.get(key), bool) or not isinstance(d.get(key), kind):
            raise DatasetError(f"{path} is a damaged flatfl data file ({key} is {type(d.get(key)).__name__})")


def load_saved_dataset(path: str | Path) -> ImageDataset:
    """Read the ``data.pt`` a run on a custom dataset saved (tensors only, no code executed)."""
    from ..errors import DatasetError

    path = Path(path)
    try:
        d = load_weights_only(path)
    except FileNotFoundError:
        raise DatasetError(f"the run's saved data is missing: {path}") from None
    except Exception:
        if plain_pickle(path):
            raise DatasetError(f"{path} is not a flatfl data file ({PLAIN_PICKLE})") from None
        raise DatasetError(f"{path} is not a readable flatfl data file (corrupt or truncated)") from None
    if not isinstance(d, dict) or d.get("format") != CUSTOM_DATA_FORMAT:
        raise DatasetError(f"{path} is not a flatfl data file")
    check_nesting(d, path, DatasetError)  # before anything walks it (a list shared at every level never ends)
    check_saved_dataset(d, path)
    return ImageDataset(name=d["name"], train_x=d["train_x"], train_y=d["train_y"], test_x=d["test_x"],
                        test_y=d["test_y"], num_classes=int(d["num_classes"]), mean=tuple(d["mean"]),
                        std=tuple(d["std"]), max_value=float(d["max_value"]), class_names=list(d["class_names"]))


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (images (1797, 8, 8), labels): its CSV file read as ``load_digits`` reads it, without
    importing scikit-learn (a second and more a process); ``load_digits`` itself where the file is not found."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images, d.target


def _load_digits(data_dir: Path | None, **_: object) -> ImageDataset:
    """scikit-learn's embedded 8x8 digits (1,797 real images), split 80/20 by a fixed stratified permutation."""
    images, target = digits_arrays()
    x = torch.from_numpy(images.astype(np.uint8)).unsqueeze(1)  # values 0..16
    y = torch.from_numpy(target.astype(np.int64))
    # Fixed split, independent of the run seed, so every run sees the same test set.
    rng = np.random.default_rng(20240531)
    test_idx = []
    for c in range(10):
        idx = np.flatnonzero(target == c)
        rng.shuffle(idx)
        test_idx.extend(idx[: len(idx) // 5].tolist())
    test_mask = np.zeros(len(y), dtype=bool)
    test_mask[test_idx] = True
    tr, te = np.flatnonzero(~test_mask), np.flatnonzero(test_mask)
    xf = x.float() / 16.0
    mean = (float(xf[tr].mean()),)
    std = (float(xf[tr].std()),)
    return ImageDataset(
        name="digits", train_x=x[tr].contiguous(), train_y=y[tr].contiguous(), test_x=x[te].contiguous(),
        test_y=y[te].contiguous(), num_classes=10, mean=mean, std=std, max_value=16.0,
        class_names=[str(i) for i in range(10)], augment_default=False,
    )


def _formats() -> dict[str, Callable[..., ImageDataset]]:
    from . import formats

    return {
        "cifar10": formats.load_cifar10,
        "cifar100": formats.load_cifar100,
        "tinyimagenet": formats.load_tinyimagenet,
        "emnist": formats.load_emnist,
        "fashionmnist": formats.load_fashion_mnist,
    }


#: the built-in datasets, as spelled without dashes or underscores ('fashion-mnist' is 'fashionmnist')
DATASETS = ("digits", "cifar10", "cifar100", "tinyimagenet", "emnist", "fashionmnist")
#: the same, as written in messages ('fashion-mnist')
DATASET_NAMES = ("digits", "cifar10", "cifar100", "tinyimagenet", "emnist", "fashion-mnist")
#: datasets fetched only when asked (``--download``): their usual source is a system package, not the network
DOWNLOAD_ON_REQUEST = ("fashionmnist",)


def load_dataset(name: str, data_dir: str | Path | None = None, download: bool | None = None,
                 **kwargs: object) -> ImageDataset:
    """Load a dataset by name. ``data_dir`` holds the standard on-disk files (ignored for ``digits``).

    ``download``: fetch missing files; None (default) does so for every dataset except those of
    :data:`DOWNLOAD_ON_REQUEST` (Fashion-MNIST, read from Debian's package when ``data_dir`` lacks it)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in DATASETS:
        raise unknown_name("dataset", name, DATASET_NAMES)
    if key == "digits":
        return _load_digits(None)
    root = Path(data_dir if data_dir is not None else "data").expanduser()
    if download is None:
        download = key not in DOWNLOAD_ON_REQUEST
    return _formats()[key](root, download=bool(download), **kwargs)
