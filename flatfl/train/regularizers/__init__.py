"""Local regularizers, one module each, registered by name in :data:`flatfl.train.components.REGULARIZERS`.

``none`` (base), ``man`` (§16), ``asd`` (§17), ``fedalign`` (§18), ``gradaug``, ``mixup``, ``stochdepth`` (§19).
"""
from . import asd, fedalign, gradaug, man, mixup, stochdepth  # noqa: F401
from .asd import ASD
from .base import NoRegularizer, Regularizer
from .fedalign import FedAlign
from .gradaug import GradAug
from .man import MAN
from .mixup import Mixup
from .stochdepth import StochDepth

__all__ = ["ASD", "FedAlign", "GradAug", "MAN", "Mixup", "NoRegularizer", "Regularizer", "StochDepth"]
