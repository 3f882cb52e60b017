"""A projection head between a network's features and a new classifier: MOON's model (Li et al. CVPR 2021,
``model.py::ModelFedCon``): the encoder's features h -> [Linear(d, d), ReLU, Linear(d, proj_dim)] -> z ->
classifier Linear(proj_dim, C). It keeps the flatfl model interface (``features(x) = z``, ``classifier``,
``feature_dim``, ``activation_modules()``), so regularizers and the Hessian tools see an ordinary flatfl model.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError


class ProjectionHeadModel(nn.Module):
    """features(x) = projection(encoder.features(x)) = z; forward(x) = classifier(z).

    ``flatfl_spec`` is the encoder's spec with ``projection_head`` (the head's output size) added."""

    def __init__(self, encoder: nn.Module, proj_dim: int = 256):
        super().__init__()
        for need in ("features", "classifier", "feature_dim"):
            if not hasattr(encoder, need):
                raise ConfigError(f"MOON needs a model with features(x), classifier and feature_dim; "
                                  f"{type(encoder).__name__} has no {need}")
        d, classes = int(encoder.feature_dim), int(encoder.classifier.out_features)
        encoder.classifier = nn.Identity()  # MOON's own classifier sits after the projection head
        self.encoder = encoder
        self.projection = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, proj_dim))
        self.classifier = nn.Linear(proj_dim, classes)
        self.feature_dim = proj_dim

    @property
    def proj_dim(self) -> int:
        return int(self.projection[-1].out_features)

    @property
    def flatfl_spec(self) -> dict | None:
        inner = getattr(self.encoder, "flatfl_spec", None)
        return None if not isinstance(inner, dict) else dict(inner, projection_head=self.proj_dim)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.encoder.features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def activation_modules(self) -> list[nn.Module]:
        inner = getattr(self.encoder, "activation_modules", None)
        return [*(inner() if callable(inner) else []), self.projection[1]]
