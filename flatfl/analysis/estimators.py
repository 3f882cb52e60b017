"""The Hessian estimators by name, from the registry of :mod:`flatfl.utils.hessian_settings` (one
:class:`~flatfl.utils.hessian_settings.Estimator` per name: the command line's help and labels, the settings' checks,
the figures and the dispatch here all read it). A new estimator is a function of its kind's shared signature plus
one :func:`~flatfl.utils.hessian_settings.register_estimator` call, inside flatfl or in another package.

* :func:`eigen_estimator`, :func:`trace_estimator`: the function of a name (a ConfigError line for an unknown one);
* :func:`estimate_eigenvalues`, :func:`estimate_trace`, :func:`estimate_density`: run one by name, with its
  registered defaults;
* :func:`lanczos`, :func:`power`, :func:`pyhessian`: the built-in estimators whose own functions take other
  arguments, in the shared signature."""
from __future__ import annotations

from ..utils.hessian_settings import DEFAULT_DENSITY_METHOD, estimator
from .density import DensityResult
from .eigen import EigenResult, top_eigenvalues
from .linear_operator import CurvatureOperator, as_operator
from .power import power_iteration
from .trace import TraceResult, pyhessian_trace

__all__ = ["eigen_estimator", "trace_estimator", "estimate_eigenvalues", "estimate_trace", "estimate_density",
           "lanczos", "power", "pyhessian"]


def eigen_estimator(name: str):
    """The eigenvalue estimator called ``name``: ``fn(op, k, *, tol, seed, return_vectors, exact_residuals)``."""
    return estimator("eigenvalues", name).load()


def trace_estimator(name: str):
    """The trace estimator called ``name``: ``fn(op, *, max_hvps, rtol, seed, block_size)``."""
    return estimator("trace", name).load()


def estimate_eigenvalues(op: CurvatureOperator, method: str = "lanczos", k: int = 1, *, tol: float = 1e-3,
                         seed: int = 0, return_vectors: bool = False, exact_residuals: bool = False) -> EigenResult:
    """The ``k`` largest eigenvalues of ``op`` by the estimator called ``method``, descending."""
    entry = estimator("eigenvalues", method)
    return entry.load()(as_operator(op, f"the {method} method"), k, tol=tol, seed=seed,
                        return_vectors=return_vectors, exact_residuals=exact_residuals, **entry.defaults)


def estimate_trace(op: CurvatureOperator, method: str = "hutchpp", *, max_hvps: int = 100,
                   rtol: float | None = 1e-2, seed: int = 0, block_size: int | None = None) -> TraceResult:
    """The trace by the estimator called ``method``: ``hutchpp`` (default), ``hutchinson`` or ``pyhessian`` (budget =
    PyHessian's max_iter), or any registered one."""
    entry = estimator("trace", method)
    return entry.load()(as_operator(op, f"the {method} trace method"), max_hvps=max_hvps, rtol=rtol, seed=seed,
                        block_size=block_size, **entry.defaults)


def estimate_density(op: CurvatureOperator, method: str = DEFAULT_DENSITY_METHOD, *, steps: int = 100,
                     starts: int = 1, seed: int = 0) -> DensityResult:
    """The spectral density by the estimator called ``method`` (``slq``: stochastic Lanczos quadrature)."""
    entry = estimator("density", method)
    return entry.load()(as_operator(op, f"the {method} density method"), steps=steps, starts=starts, seed=seed,
                        **entry.defaults)


def lanczos(op: CurvatureOperator, k: int, *, tol: float, seed: int, return_vectors: bool,
            exact_residuals: bool) -> EigenResult:
    """Thick-restart block Lanczos (:func:`~flatfl.analysis.eigen.top_eigenvalues`)."""
    return top_eigenvalues(op, k, tol=tol, seed=seed, return_vectors=return_vectors, exact_residuals=exact_residuals)


def power(op: CurvatureOperator, k: int, *, tol: float, seed: int, return_vectors: bool, exact_residuals: bool,
          max_iter: int = 100) -> EigenResult:
    """PyHessian's power iteration (:func:`~flatfl.analysis.power.power_iteration`, at most ``max_iter`` steps per
    eigenvalue), sorted descending; its residuals are always explicit."""
    return power_iteration(op, k, max_iter=max_iter, tol=tol, seed=seed, return_vectors=return_vectors).sorted()


def pyhessian(op: CurvatureOperator, *, max_hvps: int, rtol: float | None, seed: int,
              block_size: int | None = None) -> TraceResult:
    """PyHessian's trace rule (:func:`~flatfl.analysis.trace.pyhessian_trace`); the budget is its ``max_iter``."""
    return pyhessian_trace(op, max_iter=max_hvps, seed=seed)
