"""The Hessian estimators by name: :data:`flatfl.utils.hessian_settings.EIGEN_ESTIMATORS` and
:data:`~flatfl.utils.hessian_settings.TRACE_ESTIMATORS` (one line each; the command line's help, the settings'
checks and the dispatch here all read them). A new estimator is its module in ``flatfl/analysis/`` with a function
of the shared signature, plus its line there.

* :func:`eigen_estimator`, :func:`trace_estimator`: the function of a name (a ConfigError line for an unknown one);
* :func:`estimate_eigenvalues`, :func:`estimate_trace`: run one by name;
* :func:`lanczos`, :func:`power`, :func:`pyhessian`: the built-in estimators whose own functions take other
  arguments, in the shared signature."""
from __future__ import annotations

import importlib

from ..errors import ConfigError, unknown_name
from ..utils.hessian_settings import EIGEN_ESTIMATORS, TRACE_ESTIMATORS
from .eigen import EigenResult, power_iteration, top_eigenvalues
from .trace import TraceResult, pyhessian_trace

__all__ = ["eigen_estimator", "trace_estimator", "estimate_eigenvalues", "estimate_trace", "lanczos", "power",
           "pyhessian"]


def _resolve(table: dict, name: str, what: str):
    if name not in table:
        raise unknown_name(f"{what} method", name, table)
    module, function = table[name]
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def eigen_estimator(name: str):
    """The eigenvalue estimator called ``name``: ``fn(op, k, *, tol, seed, return_vectors, exact_residuals)``."""
    return _resolve(EIGEN_ESTIMATORS, name, "eigenvalue")


def trace_estimator(name: str):
    """The trace estimator called ``name``: ``fn(op, *, max_hvps, rtol, seed, block_size)``."""
    return _resolve(TRACE_ESTIMATORS, name, "trace")


def estimate_eigenvalues(op, method: str = "lanczos", k: int = 1, *, tol: float = 1e-3, seed: int = 0,
                         return_vectors: bool = False, exact_residuals: bool = False) -> EigenResult:
    """The ``k`` largest eigenvalues of ``op`` by the estimator called ``method``, descending."""
    return eigen_estimator(method)(op, k, tol=tol, seed=seed, return_vectors=return_vectors,
                                   exact_residuals=exact_residuals)


def estimate_trace(op, method: str = "hutchpp", *, max_hvps: int = 100, rtol: float | None = 1e-2, seed: int = 0,
                   block_size: int | None = None) -> TraceResult:
    """Dispatch by name: ``hutchpp`` (default), ``hutchinson`` or ``pyhessian`` (budget = PyHessian's max_iter)."""
    return trace_estimator(method)(op, max_hvps=max_hvps, rtol=rtol, seed=seed, block_size=block_size)


def lanczos(op, k: int, *, tol: float, seed: int, return_vectors: bool, exact_residuals: bool) -> EigenResult:
    """Thick-restart block Lanczos (:func:`~flatfl.analysis.eigen.top_eigenvalues`)."""
    return top_eigenvalues(op, k, tol=tol, seed=seed, return_vectors=return_vectors, exact_residuals=exact_residuals)


def power(op, k: int, *, tol: float, seed: int, return_vectors: bool, exact_residuals: bool) -> EigenResult:
    """PyHessian's power iteration (:func:`~flatfl.analysis.eigen.power_iteration`, at most 100 steps per
    eigenvalue), sorted descending; its residuals are always explicit."""
    return power_iteration(op, k, max_iter=100, tol=tol, seed=seed, return_vectors=return_vectors).sorted()


def pyhessian(op, *, max_hvps: int, rtol: float | None, seed: int, block_size: int | None = None) -> TraceResult:
    """PyHessian's trace rule (:func:`~flatfl.analysis.trace.pyhessian_trace`); the budget is its ``max_iter``."""
    return pyhessian_trace(op, max_iter=max_hvps, seed=seed)
