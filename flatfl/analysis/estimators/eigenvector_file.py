"""The eigenvector file ``flatfl hessian --save-eigenvectors`` writes (``eigenvectors.pt``) and its reader: the
saved unit eigenvectors in the parameter layout, their eigenvalues and residuals, and the weights they belong to
(the loss surface's Hessian directions read it)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...checkpoint import load_tensors
from ...errors import CheckpointError

__all__ = ["EIGENVECTOR_FORMAT", "EigenvectorFile", "load_eigenvectors"]

#: the ``format`` field of an eigenvector file
EIGENVECTOR_FORMAT = "flatfl-eigenvectors"


@dataclass
class EigenvectorFile:
    """Saved Hessian eigenvectors: ``vectors`` (k, dim) float32 unit rows in the parameter layout below."""

    eigenvalues: torch.Tensor
    residuals: torch.Tensor
    vectors: torch.Tensor
    param_names: list[str]
    param_shapes: list[tuple[int, ...]]
    checkpoint: str | None
    round: int | None
    weights_sha256: str | None = None

    def as_parameters(self, i: int) -> "OrderedDict[str, torch.Tensor]":
        """Eigenvector ``i`` shaped like the model's parameters, keyed by parameter name."""
        out, offset = OrderedDict(), 0
        for name, shape in zip(self.param_names, self.param_shapes):
            size = int(np.prod(shape)) if shape else 1
            out[name] = self.vectors[i, offset:offset + size].view(shape)
            offset += size
        return out


def load_eigenvectors(path) -> EigenvectorFile:
    """Read an ``eigenvectors.pt`` written by ``flatfl hessian --save-eigenvectors``."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"eigenvector file not found: {path}")
    payload = load_tensors(path, "eigenvector file")
    if not isinstance(payload, dict) or payload.get("format") != EIGENVECTOR_FORMAT:
        raise CheckpointError(f"{path} is not a flatfl eigenvector file")
    return EigenvectorFile(
        eigenvalues=payload["eigenvalues"], residuals=payload["residuals"], vectors=payload["vectors"],
        param_names=list(payload["param_names"]), param_shapes=[tuple(s) for s in payload["param_shapes"]],
        checkpoint=payload.get("checkpoint"), round=payload.get("round"), weights_sha256=payload.get("weights_sha256"),
    )
