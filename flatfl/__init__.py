"""flatfl: flatness in federated learning."""
from __future__ import annotations

from .version import __version__


def load_checkpoint(path, device="cpu", *, model=None, model_factory=None, which="server", data_dir=None,
                    precision=None):
    """Load a flatfl checkpoint: returns a :class:`flatfl.checkpoint.Checkpoint` (model in eval mode).

    ``model``: your own network (an ``nn.Module`` of the trained architecture; the weights are loaded into it), or
    ``model_factory="module:function"``; ``which``: "server" or "all" (the average of all clients' models);
    ``precision``: "float32" or "float64", the model's and its batches' floating type (default: the run's)."""
    from .checkpoint import load_checkpoint as load

    return load(path, device=device, which=which, data_dir=data_dir, model=model, model_factory=model_factory,
                precision=precision)


__all__ = ["__version__", "load_checkpoint"]
