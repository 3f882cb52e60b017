"""The Hessian estimators by name, from the registry of :mod:`flatfl.analysis.estimators.registry` (one
:class:`~flatfl.analysis.estimators.registry.Estimator` per name: the command line's help and labels, the settings' checks,
the figures and the dispatch here all read it). A new estimator is a function of its kind's shared signature plus
one :func:`~flatfl.analysis.estimators.registry.register_estimator` call, inside flatfl or in another package.

* :func:`eigen_estimator`, :func:`trace_estimator`: the function of a name (a ConfigError line for an unknown one);
* :func:`estimate_eigenvalues`, :func:`estimate_trace`, :func:`estimate_density`: run one by name, with its
  registered defaults;
* :func:`lanczos`, :func:`power`, :func:`pyhessian`: the built-in estimators whose own functions take other
  arguments, in the shared signature."""
from __future__ import annotations

import numpy as np

from ...errors import ConfigError, FlatflError, raised_in
from .registry import DEFAULT_DENSITY_METHOD, DEFAULT_WHICH, KINDS, Estimator, estimator, resolve_which
from .density import DensityResult
from .eigen import EigenResult, top_eigenvalues
from ..operators.linear_operator import CurvatureOperator, as_operator
from .power import power_iteration
from .trace import TraceResult, pyhessian_trace

__all__ = ["eigen_estimator", "trace_estimator", "estimate_eigenvalues", "estimate_trace", "estimate_density",
           "lanczos", "power", "pyhessian"]


def eigen_estimator(name: str):
    """The eigenvalue estimator called ``name``: ``fn(op, k, *, tol, seed, return_vectors, exact_residuals)`` (and
    ``which`` where its registry entry lists more than its default)."""
    return estimator("eigenvalues", name).load()


def trace_estimator(name: str):
    """The trace estimator called ``name``: ``fn(op, *, max_hvps, rtol, seed, block_size)``."""
    return estimator("trace", name).load()


#: what each kind of estimator must return, and the numbers of it that must be finite
_RESULTS = {"eigenvalues": (EigenResult, lambda r: [r.eigenvalues]),
            "trace": (TraceResult, lambda r: [r.estimate]),
            "density": (DensityResult, lambda r: [*r.nodes, *r.weights])}


def _run(entry: Estimator, *args, **kwargs):
    """Run a registered estimator and check what it returns: a result of its kind whose values are all finite.
    A plug-in's own failure (an exception that is not flatfl's one line, sys.exit) is one ConfigError naming it."""
    source = entry.function if isinstance(entry.function, str) else getattr(entry.function, "__qualname__", "?")
    what = f"the {KINDS[entry.kind]} method {entry.name!r} ({source})"
    try:
        result = entry.load()(*args, **kwargs, **entry.defaults)
    except (FlatflError, KeyboardInterrupt, MemoryError):
        raise
    except BaseException as e:
        origin = raised_in(e)
        builtin = isinstance(entry.function, str) and entry.function.startswith("flatfl.")
        if origin is None or not isinstance(e, (SystemExit, Exception)) or builtin and not isinstance(e, SystemExit):
            raise  # flatfl's own code and estimators: their errors are flatfl's (one line at the command line)
        did = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else \
            f"raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        raise ConfigError(f"while {what} ran, {origin} {did}") from None
    kind, values = _RESULTS[entry.kind]
    if not isinstance(result, kind):
        raise ConfigError(f"{what} returned a {type(result).__name__}, not a {kind.__name__}")
    try:
        finite = all(np.all(np.isfinite(np.asarray(v, dtype=float))) for v in values(result))
    except (TypeError, ValueError):
        finite = False
    if not finite:
        raise ConfigError(f"{what} returned values that are not finite numbers ({result.__class__.__name__}: "
                          f"{', '.join(str(v)[:60] for v in values(result))[:160]}); nothing is written")
    return result


def estimate_eigenvalues(op: CurvatureOperator, method: str = "lanczos", k: int = 1, *, which: str | None = None,
                         tol: float = 1e-3, seed: int = 0, return_vectors: bool = False,
                         exact_residuals: bool = False, **lanczos_options) -> EigenResult:
    """The ``k`` eigenvalues of ``op`` that ``which`` asks for (``largest``: descending; ``smallest``: ascending;
    ``magnitude``: by decreasing ``|lambda|``; None: the method's own, :func:`resolve_which`) by the estimator called
    ``method``. ``info["which"]`` of the result says which they are. ``lanczos_options``: ``quadrature_steps`` (an
    int or None), for flatfl's own Lanczos only (:func:`shares_a_start`; another method ignores it)."""
    unknown = sorted(set(lanczos_options) - {"quadrature_steps"})
    if unknown:
        raise ConfigError(f"estimate_eigenvalues got an unknown option {unknown[0]!r}")
    entry = estimator("eigenvalues", method)
    which = resolve_which(method, which)
    extra = {"which": which} if len(entry.which) > 1 else {}
    steps = lanczos_options.get("quadrature_steps")
    if steps is not None and shares_a_start(method):
        extra["quadrature_steps"] = int(steps)
    result = _run(entry, as_operator(op, f"the {method} method"), k, tol=tol, seed=seed,
                  return_vectors=return_vectors, exact_residuals=exact_residuals, **extra)
    result.info.setdefault("which", which)
    return result


def estimate_trace(op: CurvatureOperator, method: str = "hutchpp", *, max_hvps: int = 100,
                   rtol: float | None = 1e-2, seed: int = 0, block_size: int | None = None) -> TraceResult:
    """The trace by the estimator called ``method``: ``hutchpp`` (default), ``hutchinson`` or ``pyhessian`` (budget =
    PyHessian's max_iter), or any registered one."""
    entry = estimator("trace", method)
    if isinstance(max_hvps, bool) or not isinstance(max_hvps, (int, np.integer)) or max_hvps < entry.min_budget:
        raise ConfigError(f"the {method} trace method needs a budget max_hvps of at least {entry.min_budget} "
                          f"products (an integer), got {max_hvps!r}")
    return _run(entry, as_operator(op, f"the {method} trace method"), max_hvps=max_hvps, rtol=rtol, seed=seed,
                block_size=block_size)


def estimate_density(op: CurvatureOperator, method: str = DEFAULT_DENSITY_METHOD, *, steps: int = 100,
                     starts: int = 1, seed: int = 0, given=()) -> DensityResult:
    """The spectral density by the estimator called ``method`` (``slq``: stochastic Lanczos quadrature). ``given``:
    quadratures of starts already run (an eigenvalue run's, :attr:`EigenResult.quadrature`), for flatfl's own SLQ
    only."""
    entry = estimator("density", method)
    extra = {"given": list(given)} if given and entry.function == _BUILT_IN["density"] else {}
    return _run(entry, as_operator(op, f"the {method} density method"), steps=steps, starts=starts, seed=seed,
                **extra)


#: flatfl's own Lanczos and SLQ, which can share a start (:func:`shares_a_start`)
_BUILT_IN = {"eigenvalues": "flatfl.analysis.estimators.by_name:lanczos",
             "density": "flatfl.analysis.estimators.density:spectral_density"}


def shares_a_start(method: str, density_method: str = DEFAULT_DENSITY_METHOD) -> bool:
    """Whether the eigenvalue method ``method`` and the density method are flatfl's own Lanczos and SLQ (not a
    plug-in's replacement), so that the density can take the Lanczos run's start as one of its own: the first steps
    of a single-vector Lanczos run from a random start are what an SLQ start computes."""
    return (estimator("eigenvalues", method).function == _BUILT_IN["eigenvalues"]
            and estimator("density", density_method).function == _BUILT_IN["density"])


def lanczos(op: CurvatureOperator, k: int, *, tol: float, seed: int, return_vectors: bool,
            exact_residuals: bool, which: str = DEFAULT_WHICH, quadrature_steps: int | None = None) -> EigenResult:
    """Thick-restart block Lanczos (:func:`~flatfl.analysis.estimators.eigen.top_eigenvalues`)."""
    return top_eigenvalues(op, k, which=which, tol=tol, seed=seed, return_vectors=return_vectors,
                           exact_residuals=exact_residuals, quadrature_steps=quadrature_steps)


def power(op: CurvatureOperator, k: int, *, tol: float, seed: int, return_vectors: bool, exact_residuals: bool,
          max_iter: int = 100) -> EigenResult:
    """PyHessian's power iteration (:func:`~flatfl.analysis.estimators.power.power_iteration`, at most ``max_iter`` steps per
    eigenvalue: the largest in magnitude), sorted descending; its residuals are always explicit."""
    return power_iteration(op, k, max_iter=max_iter, tol=tol, seed=seed, return_vectors=return_vectors).sorted()


def pyhessian(op: CurvatureOperator, *, max_hvps: int, rtol: float | None, seed: int,
              block_size: int | None = None) -> TraceResult:
    """PyHessian's trace rule (:func:`~flatfl.analysis.estimators.trace.pyhessian_trace`); the budget is its ``max_iter``."""
    return pyhessian_trace(op, max_iter=max_hvps, seed=seed)
