"""Datasets held in memory as uint8 image tensors, with their per-dataset normalisation.

``load_dataset(name, data_dir)`` returns an :class:`ImageDataset`. Images stay uint8 (N, C, H, W) until a batch is
drawn, so CIFAR-100 costs 150 MB and Tiny-ImageNet 1.2 GB of memory; :meth:`ImageDataset.normalize` turns a batch
into float32 on the batch's device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError


@dataclass
class ImageDataset:
    name: str
    train_x: torch.Tensor  # uint8 (N, C, H, W)
    train_y: torch.Tensor  # int64 (N,)
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    max_value: float = 255.0  # the uint8 value that maps to 1.0 before normalisation (digits: 16)
    class_names: list[str] = field(default_factory=list)
    augment_default: bool = False  # the FedDyn-code flip + padded crop during training (CIFAR, Tiny-ImageNet)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]

    @property
    def in_channels(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[2])

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32, scaled to [0, 1] then standardised per channel."""
        x = x.to(torch.float32).div_(self.max_value)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
        return x.sub_(mean).div_(std)

    def split(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        if which == "train":
            return self.train_x, self.train_y
        if which == "test":
            return self.test_x, self.test_y
        raise ConfigError(f"unknown split {which!r}: choose 'train' or 'test'")


def _load_digits(data_dir: Path | None, **_: object) -> ImageDataset:
    """scikit-learn's embedded 8x8 digits (1,797 real images), split 80/20 by a fixed stratified permutation."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.uint8)).unsqueeze(1)  # values 0..16
    y = torch.from_numpy(d.target.astype(np.int64))
    # Fixed split, independent of the run seed, so every run sees the same test set.
    rng = np.random.default_rng(20240531)
    test_idx = []
    for c in range(10):
        idx = np.flatnonzero(d.target == c)
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
    }


DATASETS = ("digits", "cifar10", "cifar100", "tinyimagenet", "emnist")


def load_dataset(name: str, data_dir: str | Path | None = None, download: bool = True, **kwargs: object) -> ImageDataset:
    """Load a dataset by name. ``data_dir`` holds the standard on-disk files (ignored for ``digits``)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in DATASETS:
        raise ConfigError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if key == "digits":
        return _load_digits(None)
    root = Path(data_dir if data_dir is not None else "data").expanduser()
    return _formats()[key](root, download=download, **kwargs)
