"""Local regularizers, one module each, registered by name in :data:`flatfl.train.components.REGULARIZERS`.

``none`` (base), ``man`` (§16), ``asd`` (§17), ``fedalign`` (§18), ``gradaug``, ``mixup``, ``stochdepth`` (§19). A
new regularizer is a new module here (subclass :class:`Regularizer`, ``@REGULARIZERS.register``, a ``name`` and a
``display_name``): :func:`flatfl.train.catalog.load_all` imports every module of this package.
"""
from .regularizer import NoRegularizer, Regularizer

__all__ = ["NoRegularizer", "Regularizer"]
