"""FL algorithms, one module each, registered by name in :data:`flatfl.train.components.ALGORITHMS`.

A new algorithm is a new module here (subclass :class:`Algorithm`, decorate it with :func:`base.register`, give it a
``name`` and a ``display_name``): :func:`flatfl.train.catalog.load_all` imports every module of this package.
"""
from .algorithm import Algorithm, ClientResult, weighted_mean

__all__ = ["Algorithm", "ClientResult", "weighted_mean"]
