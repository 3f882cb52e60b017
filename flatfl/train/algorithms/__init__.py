"""FL algorithms, one module each, registered by name in :data:`flatfl.train.components.ALGORITHMS`."""
from . import fedavg, fedprox  # noqa: F401
from .base import Algorithm, ClientResult, weighted_mean

__all__ = ["Algorithm", "ClientResult", "weighted_mean"]
