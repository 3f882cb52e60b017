"""PyHessian's power iteration (docs/analysis-protocols.md §2).

:func:`power_iteration` is PyHessian's ``hessian.eigenvalues`` rule, reproduced exactly to reproduce papers that
used it (MAN Table 2, docs/update-rules.md §21): per parameter a standard normal start from the seed (the same draws
as PyHessian after ``torch.manual_seed(seed)``; the parameter blocks are the operator's ``param_shapes``),
normalisation by ``||v|| + 1e-6``, at most ``max_iter`` products per eigenvalue, stop when
``|new - old| / (|old| + 1e-6) < tol`` (the value kept is the *previous* estimate, as in PyHessian), Gram-Schmidt
deflation against earlier vectors for ``top_n > 1``, results in the order found. It finds largest-magnitude
eigenvalues and stops early on slow convergence, which is why its answers can be several percent off. With its
residuals, each eigenvalue's error estimate is the residual (Bauer-Fike), never below the products' rounding
(:func:`~flatfl.analysis.estimators.eigen.rounding_floor`).
"""
from __future__ import annotations

import numpy as np
import torch

from ...errors import ConfigError
from .eigen import EigenResult, check_k, explicit_residuals, products_error_along, rounding_floor
from ..operators.linear_operator import CurvatureOperator, as_operator

__all__ = ["power_iteration"]


def power_iteration(
    op: CurvatureOperator,
    top_n: int = 1,
    *,
    max_iter: int = 100,
    tol: float = 1e-3,
    seed: int = 0,
    return_vectors: bool = False,
    residuals: bool = True,
) -> EigenResult:
    """PyHessian's power iteration with deflation, step for step (see the module docstring).

    ``residuals=True`` spends one more product per eigenvalue to report ``||H v - lambda v||``; set it False to
    use exactly PyHessian's number of products. Results are in the order found (call ``.sorted()`` to sort).
    """
    op = as_operator(op, "power_iteration")
    check_k(op, top_n)
    if max_iter < 1:
        raise ConfigError(f"max_iter must be >= 1, got {max_iter}")
    start_hvps = op.hvps
    gen = torch.Generator().manual_seed(int(seed))
    shapes = op.param_shapes
    eigenvalues, vectors, iterations, stops = [], [], [], []
    for _ in range(top_n):
        # PyHessian draws torch.randn(p.size()) parameter by parameter in the default dtype.
        v = torch.cat([torch.randn(shape, generator=gen).reshape(-1) for shape in shapes])
        v = v.to(dtype=op.dtype, device=op.device)
        v = _pyhessian_normalise(v)
        eigenvalue, stopped = None, False
        for it in range(max_iter):
            for u in vectors:  # Gram-Schmidt against the eigenvectors found so far, then normalise
                v = v - torch.dot(v, u) * u
            v = _pyhessian_normalise(v)
            Hv = op.matvec(v)
            estimate = float(torch.dot(Hv, v))  # the host's one read of a product: PyHessian's rule stops on it
            v = _pyhessian_normalise(Hv)
            if eigenvalue is None:
                eigenvalue = estimate
            elif abs(eigenvalue - estimate) / (abs(eigenvalue) + 1e-6) < tol:
                stopped = True
                break
            else:
                eigenvalue = estimate
        eigenvalues.append(eigenvalue)
        vectors.append(v)
        iterations.append(it + 1)
        stops.append(stopped)
    values = np.asarray(eigenvalues, dtype=float)
    stacked = torch.stack(vectors)
    unit = stacked / stacked.norm(dim=1, keepdim=True)
    res = explicit_residuals(op, values, unit, 1) if residuals else np.full(top_n, np.nan)
    along = products_error_along(op, unit)
    floor = rounding_floor(op, float(np.max(np.abs(values))), along)
    return EigenResult(
        eigenvalues=values,
        residuals=res,
        converged=np.asarray(stops, dtype=bool),
        hvps=op.hvps - start_hvps,
        method="power",
        eigenvectors=stacked if return_vectors else None,
        info={"which": "magnitude", "iterations": iterations, "max_iter": max_iter, "tol": tol,
              "rounding_floor": floor, **({"product_error_along": along} if along is not None else {})},
        error_bounds=np.maximum(res, floor) if residuals else None,
        residual_kind="explicit" if residuals else None,
    )


def _pyhessian_normalise(v: torch.Tensor) -> torch.Tensor:
    """``v / (||v|| + 1e-6)`` as PyHessian, computed on v's device (the host reads nothing)."""
    return v / (v.norm().to(torch.float64) + 1e-6).to(v.dtype)
