"""The registry of curvature estimators: one :class:`Estimator` per name and kind (``eigenvalues``, ``trace``,
``density``), carrying its function as a ``"module:function"`` path imported only when it runs
(:meth:`Estimator.load`), the kind of residuals it reports, the labels the command line and the figures print, and
its own keyword defaults. Every place that names an estimator asks here: ``flatfl hessian``'s ``--method`` /
``--trace-method`` and ``flatfl report --method`` (choices and help), :class:`~flatfl.analysis.commands.hessian_settings.
HessianSettings`' checks, the dispatch (:mod:`flatfl.analysis.estimators.by_name`), ``--per-layer``
(:func:`flatfl.analysis.estimators.per_layer.per_layer_curvature`), the PyHessian-style API
(:mod:`flatfl.analysis.model_hessian`), the result files' headers and the figures. No torch here: the command line
reads the names and labels when it starts.

Another package registers its estimators by calling :func:`register_estimator`, or by naming, in the entry-point
group ``flatfl.estimators``, a torch-free object that is an :class:`Estimator`, a list of them, or a function of no
argument that registers them. One rule for a name already taken, whichever way it comes: it is refused, in one
line naming it. :func:`register_estimator` raises that ConfigError (``replace=True`` is the caller's explicit choice
to replace); an entry point is loaded through the same call and cannot pass ``replace`` (its ``replace=True`` is
refused the same way), so a plug-in never replaces a built-in or another plug-in's estimator: it is skipped whole,
the refusal its one warning line.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from ...errors import ConfigError, unknown_name
from ...utils.plugins import loading

__all__ = ["Estimator", "KINDS", "WHICH", "DEFAULT_WHICH", "register_estimator", "unregister_estimator", "estimator",
           "estimator_names", "estimator_title", "check_which", "resolve_which", "EIGEN_ESTIMATORS", "TRACE_ESTIMATORS", "DENSITY_ESTIMATORS", "DEFAULT_EIGEN_METHOD",
           "DEFAULT_TRACE_METHOD", "DEFAULT_DENSITY_METHOD", "PLUGIN_PROBLEMS"]

# ---------------------------------------------------------------------------------------------- estimators
#: the kinds of estimator, as the registry and the error messages name them
KINDS = {"eigenvalues": "eigenvalue", "trace": "trace", "density": "density"}
#: what the residuals of an eigenvalue estimator are, as hessian.json's ``eigen.residual_kind`` says it
RESIDUAL_KINDS = ("explicit", "lanczos relation")
#: which eigenvalues an eigenvalue method can be asked for (``which=``, ``flatfl hessian --which``), and what the
#: command line calls them: the largest algebraic (descending), the smallest algebraic (ascending: the most negative
#: first), the largest in magnitude (by decreasing |lambda|)
WHICH = {"largest": "largest algebraic", "smallest": "smallest algebraic", "magnitude": "largest magnitude"}
DEFAULT_WHICH = "largest"


@dataclass(frozen=True)
class Estimator:
    """One registered estimator: its ``name`` (``--method`` / ``--trace-method``), ``kind`` (``eigenvalues``,
    ``trace`` or ``density``) and ``function``, a ``"module:function"`` path (imported by :meth:`load`) or the
    function itself. The function takes the shared arguments of its kind:

    * eigenvalues: ``fn(op, k, *, tol, seed, return_vectors, exact_residuals, **defaults) -> EigenResult``;
    * trace: ``fn(op, *, max_hvps, rtol, seed, block_size, **defaults) -> TraceResult``;
    * density: ``fn(op, *, steps, starts, seed, **defaults) -> DensityResult``;

    ``defaults``: the estimator's own keywords (passed on every call). ``residuals``: ``"explicit"`` (each
    ``||Hv - lambda v||`` computed from the vectors) or ``"lanczos relation"`` (read off a Krylov recurrence), what
    hessian.json records unless the result says otherwise. ``label``: which eigenvalues are "top" (``largest
    algebraic``, ``largest magnitude``), printed by ``flatfl hessian``; ``title``: the method's name in figures;
    ``trace_method``: the trace estimator run with it when none is asked for (None: the default one);
    ``min_budget``: the fewest products a trace estimator can work with (``--trace-hvps`` is checked against it);
    ``which``: the eigenvalues an eigenvalue method can find (names of :data:`WHICH`), the first its default; a method
    that lists more than one is called with ``which=`` (one that lists only its default is called without it)."""

    name: str
    kind: str
    function: str | Callable
    label: str = ""
    title: str = ""
    residuals: str = "explicit"
    trace_method: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    min_budget: int = 1
    which: tuple[str, ...] = (DEFAULT_WHICH,)

    def load(self) -> Callable:
        """The estimator's function (its module imported now, when it is given as ``"module:function"``)."""
        if callable(self.function):
            return self.function
        module, _, name = str(self.function).partition(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"the {KINDS[self.kind]} method {self.name!r} names {self.function!r}, which cannot be "
                              f"imported: {e}") from None


_REGISTRY: dict[str, dict[str, Estimator]] = {kind: {} for kind in KINDS}
#: the registered estimators of each kind, name -> :class:`Estimator` (read-only views of the registry)
EIGEN_ESTIMATORS: Mapping[str, Estimator] = MappingProxyType(_REGISTRY["eigenvalues"])
TRACE_ESTIMATORS: Mapping[str, Estimator] = MappingProxyType(_REGISTRY["trace"])
DENSITY_ESTIMATORS: Mapping[str, Estimator] = MappingProxyType(_REGISTRY["density"])
#: the estimator of each kind that runs when none is named
DEFAULT_EIGEN_METHOD = "lanczos"
DEFAULT_TRACE_METHOD = "hutchpp"
DEFAULT_DENSITY_METHOD = "slq"
ENTRY_POINT_GROUP = "flatfl.estimators"
_entry_points_loaded = False


def register_estimator(name: str, kind: str, function: str | Callable, *, label: str = "", title: str = "",
                       residuals: str = "explicit", trace_method: str | None = None,
                       defaults: Mapping[str, Any] | None = None, replace: bool = False,
                       min_budget: int = 1, which: tuple[str, ...] = (DEFAULT_WHICH,)) -> Estimator:
    """Register an estimator (see :class:`Estimator` for the fields) and return its entry. A name already taken
    in that kind is a ConfigError unless ``replace``; while an entry point loads, ``replace`` is refused too (the
    module docstring's one rule for a taken name). No import happens here: ``function`` as
    ``"module:function"`` is imported when the estimator first runs."""
    if kind not in KINDS:
        raise unknown_name("estimator kind", kind, KINDS)
    if not isinstance(name, str) or not name or name != name.strip() or name.startswith("-"):
        raise ConfigError(f"an estimator's name must be a non-empty word, got {name!r}")
    if not callable(function) and (not isinstance(function, str) or ":" not in function):
        raise ConfigError(f"estimator {name!r}: give its function, or its path as 'module:function', got "
                          f"{function!r}")
    if residuals not in RESIDUAL_KINDS:
        raise unknown_name("residual kind", residuals, RESIDUAL_KINDS)
    plugin = loading(ENTRY_POINT_GROUP)  # an entry point being loaded: it cannot replace
    if name in _REGISTRY[kind] and (not replace or plugin is not None):
        how = "a plug-in cannot replace it" if plugin is not None else "pass replace=True to replace it"
        article = "an" if KINDS[kind][0] in "aeiou" else "a"
        raise ConfigError(f"{article} {KINDS[kind]} method called {name!r} is already registered ({how})")
    if isinstance(min_budget, bool) or not isinstance(min_budget, int) or min_budget < 1:
        raise ConfigError(f"estimator {name!r}: min_budget must be an integer >= 1, got {min_budget!r}")
    if isinstance(which, str) or not isinstance(which, (tuple, list)) or not which or \
            any(not isinstance(w, str) or w not in WHICH for w in which) or len(set(which)) != len(which):
        raise ConfigError(f"estimator {name!r}: which must list distinct names of {', '.join(WHICH)} (its default "
                          f"first), got {which!r}")
    entry = Estimator(name, kind, function, label=label, title=title or name, residuals=residuals,
                      trace_method=trace_method, defaults=MappingProxyType(dict(defaults or {})),
                      min_budget=min_budget, which=tuple(which))
    _REGISTRY[kind][name] = entry
    return entry


def unregister_estimator(name: str, kind: str) -> None:
    """Remove a registered estimator (a KeyError-free no-op when there is none of that name)."""
    _REGISTRY[kind].pop(name, None)


#: one line per plug-in entry point that was skipped (what the warning on stderr said), for a caller to read
PLUGIN_PROBLEMS: list[str] = []


def _register_found(found) -> None:
    """Register what an entry point gave: an Estimator, a list of them, or a function of no argument that
    registers them (each checked as :func:`register_estimator` checks; a name already taken is refused)."""
    from ...utils.plugins import register_each

    register_each(found, Estimator, lambda item: register_estimator(
        item.name, item.kind, item.function, label=item.label, title=item.title, residuals=item.residuals,
        trace_method=item.trace_method, defaults=item.defaults, min_budget=item.min_budget, which=item.which),
        "an Estimator")


def _load_entry_points() -> None:
    """The estimators other packages declare in the entry-point group ``flatfl.estimators`` (once, when a name is
    first asked for), each in isolation (:func:`flatfl.utils.plugins.load_entry_points`): one that cannot be
    imported, raises, gives something else than estimators, names an unknown kind or a name already taken is
    skipped whole with one warning line on stderr naming its distribution and entry point."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from ...utils.plugins import load_entry_points

    load_entry_points(ENTRY_POINT_GROUP, "estimator", _register_found, _REGISTRY, PLUGIN_PROBLEMS)


def estimator_names(kind: str) -> tuple[str, ...]:
    """The registered names of ``kind``, in registration order (entry points included)."""
    _load_entry_points()
    return tuple(_REGISTRY[kind])


def estimator(kind: str, name: str) -> Estimator:
    """The registered estimator ``name`` of ``kind``; ConfigError ``unknown eigenvalue method 'x': ...``."""
    if name in _REGISTRY[kind]:  # registered already (a built-in): no plug-in is loaded for it
        return _REGISTRY[kind][name]
    names = estimator_names(kind)
    if name not in _REGISTRY[kind]:
        raise unknown_name(f"{KINDS[kind]} method", name, names)
    return _REGISTRY[kind][name]


register_estimator("lanczos", "eigenvalues", "flatfl.analysis.estimators.by_name:lanczos", label="largest algebraic",
                   title="Lanczos", residuals="lanczos relation", which=("largest", "smallest", "magnitude"))
register_estimator("power", "eigenvalues", "flatfl.analysis.estimators.by_name:power", label="largest magnitude",
                   title="power iteration", trace_method="pyhessian", defaults={"max_iter": 100},
                   which=("magnitude",))
register_estimator("hutchpp", "trace", "flatfl.analysis.estimators.trace:hutchpp_trace", title="Hutch++",
                   min_budget=2)  # a sketch of one vector and one probe of the rest
register_estimator("hutchinson", "trace", "flatfl.analysis.estimators.trace:hutchinson_trace", title="Hutchinson")
register_estimator("exact", "trace", "flatfl.analysis.estimators.trace:exact_trace", title="exact")
register_estimator("pyhessian", "trace", "flatfl.analysis.estimators.by_name:pyhessian", title="PyHessian's rule")
register_estimator("slq", "density", "flatfl.analysis.estimators.density:spectral_density",
                   title="stochastic Lanczos quadrature")


def check_which(which) -> str:
    """``which`` names eigenvalues an estimator can be asked for (:data:`WHICH`: ``largest``, ``smallest``,
    ``magnitude``); a ConfigError line otherwise."""
    if not isinstance(which, str) or which not in WHICH:
        raise unknown_name("choice of eigenvalues (which)", which, WHICH)
    return which


def resolve_which(method: str, which: str | None = None) -> str:
    """The eigenvalues the eigenvalue method ``method`` finds when asked for ``which``: ``which`` itself when the
    method can find them, its default (the first of its :attr:`Estimator.which`) for None; one ConfigError line for
    an unknown ``which`` or one the method cannot find (naming the methods that can)."""
    entry = estimator("eigenvalues", method)
    if which is None:
        return entry.which[0]
    if check_which(which) not in entry.which:
        able = [n for n in estimator_names("eigenvalues") if which in _REGISTRY["eigenvalues"][n].which]
        finds = " or ".join(f"the {WHICH[w]}" for w in entry.which)
        raise ConfigError(f"the {method} eigenvalue method finds {finds} eigenvalues only, not the {WHICH[which]} "
                          f"(which {which!r}): use the method {' or '.join(map(repr, able)) or 'lanczos'} for them")
    return which


def estimator_title(kind: str, name) -> str:
    """The name figures give the estimator ``name`` of ``kind`` (its registered ``title``; a name the registry does
    not hold, such as a result's ``dense``, as it is)."""
    entry = _REGISTRY[kind].get(name)
    return entry.title if entry is not None else str(name)
