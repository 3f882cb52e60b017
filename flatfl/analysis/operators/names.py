"""The names of what an operator computes, torch-free (the command line and the settings read them without
importing torch): the curvatures, their short and full names (live views of the registry of curvature kinds,
:mod:`.kinds`), and the ways of computing a product."""
from __future__ import annotations

from .kinds import CURVATURE_NAMES, CURVATURE_TITLES, CURVATURES

__all__ = ["CURVATURES", "CURVATURE_TITLES", "CURVATURE_NAMES", "PRODUCT_METHODS"]

#: how Hessian-vector products are computed (flatfl.analysis.operators.products); "auto": by device
PRODUCT_METHODS = ("auto", "double-backward", "forward-over-reverse", "finite-difference")
