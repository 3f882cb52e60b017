"""The contract every flatfl model keeps: ``forward(x) == classifier(features(x))``.

* ``features(x)`` returns the penultimate representation, shape (B, feature_dim);
* ``classifier`` is the final ``nn.Linear`` (MOON puts its projection head between the two);
* ``activation_modules()`` lists, in forward order, the modules whose outputs are the post-non-linearity activations
  that MAN penalises (docs/update-rules.md §16), logits excluded. Each is its own module instance, used once per forward,
  so a forward hook on it sees each activation exactly once.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import ConfigError


class FeatureClassifier(nn.Module):
    """Base class: subclasses set ``self.classifier`` and ``self.feature_dim`` and implement ``features``."""

    classifier: nn.Linear
    feature_dim: int

    def features(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def activation_modules(self) -> list[nn.Module]:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def conv_output_size(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial size after a convolution or pooling window (PyTorch's floor rule)."""
    return (size + 2 * padding - kernel) // stride + 1


def require_positive_size(model_name: str, image_size: int, size: int, where: str) -> None:
    """Raise :class:`ConfigError` when an input of ``image_size`` shrinks to nothing at ``where``."""
    if size < 1:
        raise ConfigError(f"model '{model_name}' cannot take {image_size}x{image_size} inputs: the feature map "
                          f"vanishes at {where}")
