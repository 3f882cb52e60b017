"""The names of what an operator computes, torch-free (the command line and the settings read them without
importing torch): the curvatures, their short and full names, and the ways of computing a product."""
from __future__ import annotations

__all__ = ["CURVATURES", "CURVATURE_TITLES", "CURVATURE_NAMES", "PRODUCT_METHODS"]

#: the curvature matrices an analysis measures (flatfl.analysis.operators.curvatures): the Hessian, the generalized
#: Gauss-Newton matrix, the empirical Fisher
CURVATURES = ("hessian", "ggn", "empirical-fisher")
#: each curvature's short name, as figures label their axes ("GGN eigenvalue λ") and result lines name it
CURVATURE_TITLES = {"hessian": "Hessian", "ggn": "GGN", "empirical-fisher": "empirical Fisher"}
#: each curvature's name in full, as the command line's first lines say it ("top eigenvalues of the ...")
CURVATURE_NAMES = {"hessian": "Hessian", "ggn": "Gauss-Newton matrix", "empirical-fisher": "empirical Fisher"}
#: how Hessian-vector products are computed (flatfl.analysis.operators.products); "auto": by device
PRODUCT_METHODS = ("auto", "double-backward", "forward-over-reverse", "finite-difference")
