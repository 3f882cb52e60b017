"""The in-memory dataset type every loader returns (:mod:`flatfl.data.datasets` for the built-in datasets,
:mod:`flatfl.data.formats` for the file formats they come in): uint8 images and their normalisation."""
from __future__ import annotations

from dataclasses import dataclass, field

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
        """uint8 images -> float32, scaled to [0, 1] then standardised per channel (a new tensor: float inputs of a
        custom dataset are never changed in place)."""
        x = x.to(torch.float32, copy=True).div_(self.max_value)
        shape = (1, -1) + (1,) * max(0, x.dim() - 2)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(shape)
        return x.sub_(mean).div_(std)

    def split(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        if which == "train":
            return self.train_x, self.train_y
        if which == "test":
            return self.test_x, self.test_y
        raise ConfigError(f"unknown split {which!r}: choose 'train' or 'test'")
