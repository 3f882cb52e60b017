"""FL algorithms, one module each, registered by name in :data:`flatfl.train.components.ALGORITHMS`."""
from . import (fedavg, fedcm, feddc, feddisco, feddyn, fedntd, fedprox, fedrobust, fedsam, fedspeed,  # noqa: F401
               mimelite, mofedsam, moon, scaffold)
from .base import Algorithm, ClientResult, weighted_mean

__all__ = ["Algorithm", "ClientResult", "weighted_mean"]
