"""flatfl: flatness in federated learning."""
from __future__ import annotations

__version__ = "0.1.0"


def load_checkpoint(path, device="cpu"):
    """Load a flatfl checkpoint: returns a :class:`flatfl.train.checkpoint.Checkpoint` (model in eval mode)."""
    from .train.checkpoint import load_checkpoint as _load

    return _load(path, device=device)


__all__ = ["__version__", "load_checkpoint"]
