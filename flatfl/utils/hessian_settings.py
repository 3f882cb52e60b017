"""The settings of one Hessian analysis and their defaults, in one place, and the registry of Hessian estimators.

``flatfl hessian``'s options, :func:`flatfl.analysis.hessian_run.run_hessian` (and its ``analyse``), a grid file's
``[hessian]`` / ``[spectrum]`` sections and ``flatfl report --compute-missing`` all take their defaults from
:class:`HessianSettings`. It lives here, not in ``flatfl.analysis``, because the command line reads the defaults
and the estimators' names and labels when it starts and must not import torch for that (``flatfl.analysis`` does).

The registry (:func:`register_estimator`, :func:`estimator`, :func:`estimator_names`): one :class:`Estimator` per
name and kind (``eigenvalues``, ``trace``, ``density``), carrying its function as a ``"module:function"`` path
imported only when it runs (:meth:`Estimator.load`), the kind of residuals it reports, the labels the command line
and the figures print, and its own keyword defaults. Another package registers its estimators by calling
:func:`register_estimator` (or by naming, in the entry-point group ``flatfl.estimators``, a torch-free object that
is an :class:`Estimator`, a list of them, or a function of no argument that registers them).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from ..errors import ConfigError, unknown_name
from .precision import check_analysis_precision
from .settings import Settings, check_kinds
from .values import check_seed

__all__ = ["Estimator", "KINDS", "register_estimator", "unregister_estimator", "estimator", "estimator_names", "estimator_title",
           "EIGEN_ESTIMATORS", "TRACE_ESTIMATORS", "DENSITY_ESTIMATORS", "DEFAULT_TRACE_METHOD",
           "DEFAULT_DENSITY_METHOD", "HessianSettings", "tracking_settings", "TRACKING_DEFAULTS", "TRACKING_FIELDS",
           "SPLITS", "CURVATURES", "PRODUCT_METHODS", "MAX_DENSITY_STEPS", "MAX_DENSITY_STARTS", "MAX_TOP"]

# ---------------------------------------------------------------------------------------------- estimators
#: the kinds of estimator, as the registry and the error messages name them
KINDS = {"eigenvalues": "eigenvalue", "trace": "trace", "density": "density"}
#: what the residuals of an eigenvalue estimator are, as hessian.json's ``eigen.residual_kind`` says it
RESIDUAL_KINDS = ("explicit", "lanczos relation")


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
    ``min_budget``: the fewest products a trace estimator can work with (``--trace-hvps`` is checked against it)."""

    name: str
    kind: str
    function: str | Callable
    label: str = ""
    title: str = ""
    residuals: str = "explicit"
    trace_method: str | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    min_budget: int = 1

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
DEFAULT_TRACE_METHOD = "hutchpp"
DEFAULT_DENSITY_METHOD = "slq"
ENTRY_POINT_GROUP = "flatfl.estimators"
_entry_points_loaded = False


def register_estimator(name: str, kind: str, function: str | Callable, *, label: str = "", title: str = "",
                       residuals: str = "explicit", trace_method: str | None = None,
                       defaults: Mapping[str, Any] | None = None, replace: bool = False,
                       min_budget: int = 1) -> Estimator:
    """Register an estimator (see :class:`Estimator` for the fields) and return its entry. A name already taken
    in that kind is a ConfigError unless ``replace``. No import happens here: ``function`` as
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
    if name in _REGISTRY[kind] and not replace:
        raise ConfigError(f"a {KINDS[kind]} method called {name!r} is already registered (pass replace=True to "
                          "replace it)")
    if isinstance(min_budget, bool) or not isinstance(min_budget, int) or min_budget < 1:
        raise ConfigError(f"estimator {name!r}: min_budget must be an integer >= 1, got {min_budget!r}")
    entry = Estimator(name, kind, function, label=label, title=title or name, residuals=residuals,
                      trace_method=trace_method, defaults=MappingProxyType(dict(defaults or {})),
                      min_budget=min_budget)
    _REGISTRY[kind][name] = entry
    return entry


def unregister_estimator(name: str, kind: str) -> None:
    """Remove a registered estimator (a KeyError-free no-op when there is none of that name)."""
    _REGISTRY[kind].pop(name, None)


#: one line per plug-in entry point that was skipped (what the warning on stderr said), for a caller to read
PLUGIN_PROBLEMS: list[str] = []


def _plugin_name(point) -> str:
    """'the estimator plug-in NAME = VALUE of DIST VERSION': an entry point as its warning names it."""
    dist = getattr(point, "dist", None)
    meta = getattr(dist, "metadata", None)
    owner = f" of the distribution {meta['Name']} {getattr(dist, 'version', '')}".rstrip() if meta else ""
    return f"the estimator plug-in {point.name} = {point.value}{owner} (entry-point group {ENTRY_POINT_GROUP})"


def _register_found(found) -> None:
    """Register what an entry point gave: an Estimator, a list of them, or a function of no argument that
    registers them (each checked as :func:`register_estimator` checks; a name already taken is refused)."""
    for item in (found if isinstance(found, (list, tuple)) else [found]):
        if isinstance(item, Estimator):
            register_estimator(item.name, item.kind, item.function, label=item.label, title=item.title,
                               residuals=item.residuals, trace_method=item.trace_method, defaults=item.defaults,
                               min_budget=item.min_budget)
        elif callable(item):
            item()
        else:
            raise ConfigError(f"it gave a {type(item).__name__}, not an Estimator, a list of them or a function "
                              "that registers them")


def _load_entry_points() -> None:
    """The estimators other packages declare in the entry-point group ``flatfl.estimators`` (once, when a name is
    first asked for). Each loads in isolation: one that cannot be imported, raises (SystemExit included), gives
    something else than estimators, names an unknown kind or a name already taken is skipped whole (what it
    registered before failing is taken back), with one warning line on stderr naming its distribution and entry
    point; the others and every command go on. Ctrl-C while one loads is an interruption naming it."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    import sys
    from importlib.metadata import entry_points

    try:
        points = list(entry_points(group=ENTRY_POINT_GROUP))
    except Exception as e:  # noqa: BLE001 - unreadable installed metadata: no plug-ins, one warning
        points = []
        PLUGIN_PROBLEMS.append(f"the installed packages' entry points cannot be read ({type(e).__name__}: {e})")
        sys.stderr.write(f"flatfl: warning: {PLUGIN_PROBLEMS[-1]}\n")
    for point in points:
        before = {kind: dict(entries) for kind, entries in _REGISTRY.items()}
        try:
            _register_found(point.load())
        except KeyboardInterrupt as e:
            e.hint = f"while loading {_plugin_name(point)}; nothing was written"
            raise
        except BaseException as e:  # noqa: BLE001 - a broken plug-in is skipped with one line, never fatal
            for kind, entries in before.items():
                _REGISTRY[kind].clear()
                _REGISTRY[kind].update(entries)
            if isinstance(e, SystemExit):
                why = f"it called sys.exit({e.code!r}) while loading"
            elif isinstance(e, ConfigError):
                why = str(e)
            else:
                why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            PLUGIN_PROBLEMS.append(f"{_plugin_name(point)} is skipped: {why}")
            sys.stderr.write(f"flatfl: warning: {PLUGIN_PROBLEMS[-1]}\n")


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


register_estimator("lanczos", "eigenvalues", "flatfl.analysis.estimators:lanczos", label="largest algebraic",
                   title="Lanczos", residuals="lanczos relation")
register_estimator("power", "eigenvalues", "flatfl.analysis.estimators:power", label="largest magnitude",
                   title="power iteration", trace_method="pyhessian", defaults={"max_iter": 100})
register_estimator("hutchpp", "trace", "flatfl.analysis.trace:hutchpp_trace", title="Hutch++",
                   min_budget=2)  # a sketch of one vector and one probe of the rest
register_estimator("hutchinson", "trace", "flatfl.analysis.trace:hutchinson_trace", title="Hutchinson")
register_estimator("pyhessian", "trace", "flatfl.analysis.estimators:pyhessian", title="PyHessian's rule")
register_estimator("slq", "density", "flatfl.analysis.density:spectral_density",
                   title="stochastic Lanczos quadrature")
SPLITS = ("train", "test")
#: the curvature matrices an analysis measures (flatfl.analysis.curvatures): the Hessian, the generalized
#: Gauss-Newton matrix, the empirical Fisher
CURVATURES = ("hessian", "ggn", "empirical-fisher")
#: how Hessian-vector products are computed (flatfl.analysis.products); "auto": by device
PRODUCT_METHODS = ("auto", "double-backward", "forward-over-reverse", "finite-difference")


def estimator_title(kind: str, name) -> str:
    """The name figures give the estimator ``name`` of ``kind`` (its registered ``title``; a name the registry does
    not hold, such as a result's ``dense``, as it is)."""
    entry = _REGISTRY[kind].get(name)
    return entry.title if entry is not None else str(name)


@dataclass(frozen=True)
class HessianSettings(Settings):
    """What a Hessian analysis computes and how (every keyword of ``run_hessian`` but ``quiet``); the field
    defaults are the defaults everywhere. The names are those of hessian.json's ``settings``."""

    SOURCE = "the Hessian settings"

    top: int = 1
    trace: bool = True
    density: bool = False
    samples: int | None = None  # None: the whole split
    batch_size: int = 256
    split: str = "train"
    method: str = "lanczos"
    seed: int = 0
    device: str = "cpu"
    save_eigenvectors: bool = False
    tol: float = 1e-3
    trace_method: str | None = None  # None: hutchpp, or pyhessian with method 'power'
    trace_hvps: int = 100
    trace_rtol: float | None = 1e-2
    density_steps: int = 100
    density_starts: int = 4  # SLQ starts averaged (one start's quadrature is a spiky, noisy density)
    exact_residuals: bool = False
    data_dir: str | None = None  # None: the folder the checkpoint recorded
    model_factory: str | None = None
    precision: str | None = None  # float32 | float64; None: the run's (flatfl.utils.precision)
    per_layer: bool = False  # each module's Hessian block too (per_layer.csv, figures, hessian.json's per_layer)
    per_layer_top: int = 1  # top eigenvalues per block
    loss: str | None = None  # "module:function", loss(model, batch) -> scalar, instead of cross-entropy
    curvature: str = "hessian"  # the matrix measured: hessian | ggn | empirical-fisher (flatfl.analysis.curvatures)
    products: str = "auto"  # how Hessian products are computed (flatfl.analysis.products); "auto": by device

    def validate(self) -> "HessianSettings":
        """Types and ranges, one ConfigError line for the first problem (the flag named as on the command line)."""
        check_kinds(self, _KINDS)
        if self.top < 0:
            raise ConfigError(f"--top must be a non-negative integer, got {self.top!r}")
        if self.top > MAX_TOP:
            raise ConfigError(f"--top must be at most {MAX_TOP:,} (one stored vector per eigenvalue), got {self.top}")
        estimator("eigenvalues", self.method)  # the registry at run time: a method registered by now passes
        if not 0 < self.tol < 1:
            raise ConfigError(f"--tol must be in (0, 1) (a relative tolerance), got {self.tol!r}")
        if self.trace_method is not None:
            estimator("trace", self.trace_method)
        if self.trace_hvps < 1:
            raise ConfigError(f"--trace-hvps must be >= 1, got {self.trace_hvps}")
        need, why = 1, ""
        if self.trace and estimator("trace", self.resolved_trace_method).min_budget > need:
            need = estimator("trace", self.resolved_trace_method).min_budget
            why = f" (the {self.resolved_trace_method} trace needs {need} products at least)"
        if self.per_layer and estimator("trace", DEFAULT_TRACE_METHOD).min_budget > need:
            need = estimator("trace", DEFAULT_TRACE_METHOD).min_budget  # each block's trace: Hutch++
            why = f" (--per-layer estimates each block's trace by {DEFAULT_TRACE_METHOD}, which needs {need} at least)"
        if self.trace_hvps < need:
            raise ConfigError(f"--trace-hvps must be >= {need}{why}, got {self.trace_hvps}")
        if self.trace_rtol is not None and not self.trace_rtol > 0:
            raise ConfigError(f"--trace-rtol must be positive, got {self.trace_rtol}")
        if self.density_steps < 1 or self.density_starts < 1:
            raise ConfigError("--density-steps and --density-starts must be >= 1")
        if self.density_starts > MAX_DENSITY_STARTS:
            raise ConfigError(f"--density-starts must be at most {MAX_DENSITY_STARTS}, got {self.density_starts}")
        if self.density_steps > MAX_DENSITY_STEPS:
            raise ConfigError(f"--density-steps must be at most {MAX_DENSITY_STEPS} (one stored Lanczos vector per "
                              f"step), got {self.density_steps}")
        if self.split not in SPLITS:
            raise unknown_name("split", self.split, SPLITS)
        if self.samples is not None and self.samples <= 0:
            raise ConfigError(f"--samples must be a positive integer, got {self.samples}")
        if self.batch_size <= 0:
            raise ConfigError(f"--batch-size must be a positive integer, got {self.batch_size}")
        check_seed(self.seed)
        if self.per_layer_top < 1:
            raise ConfigError(f"--per-layer-top must be a positive integer, got {self.per_layer_top}")
        if self.per_layer_top > MAX_TOP:
            raise ConfigError(f"--per-layer-top must be at most {MAX_TOP:,} (one stored vector per eigenvalue), "
                              f"got {self.per_layer_top}")
        if self.loss is not None and (":" not in self.loss or not all(self.loss.rpartition(":")[::2])):
            raise ConfigError(f"--loss must be 'module:function' or 'path/to/file.py:function' (a function "
                              f"loss(model, batch) -> scalar), got {self.loss!r}")
        if self.curvature not in CURVATURES:
            raise unknown_name("curvature", self.curvature, CURVATURES)
        if self.products not in PRODUCT_METHODS:
            raise unknown_name("product method", self.products, PRODUCT_METHODS)
        if self.curvature != "hessian" and self.products != "auto":
            raise ConfigError(f"--products {self.products} chooses how Hessian products are computed; the "
                              f"{self.curvature} curvature has products of its own: leave --products at auto")
        if not (self.top or self.trace or self.density or self.per_layer):
            raise ConfigError("nothing to compute: ask for --top K >= 1, --trace, --density or --per-layer")
        if self.save_eigenvectors and self.top < 1:
            raise ConfigError("--save-eigenvectors needs --top >= 1")
        check_analysis_precision(self.precision)
        return self

    @property
    def resolved_trace_method(self) -> str:
        """The trace estimator that runs: ``trace_method``, else the eigenvalue method's own (power: PyHessian's
        rule), else :data:`DEFAULT_TRACE_METHOD`."""
        if self.trace_method is not None:
            return self.trace_method
        return estimator("eigenvalues", self.method).trace_method or DEFAULT_TRACE_METHOD

    @property
    def eigen(self) -> Estimator:
        """The registry's entry of ``method``."""
        return estimator("eigenvalues", self.method)


# bounds on the sizes a user sets, checked before anything is allocated (each stored vector has the model's size;
# --top is bounded by the parameter count once the checkpoint is read, and before it by MAX_TOP: a metrics column
# and a CSV column are named per eigenvalue before any model is built)
MAX_TOP = 100_000
MAX_DENSITY_STEPS = 10_000
MAX_DENSITY_STARTS = 1000


# (field, type, None allowed); device and data_dir are checked where they are used (a torch.device, a Path)
_KINDS = (("top", int, False), ("trace", bool, False), ("density", bool, False), ("samples", int, True),
          ("batch_size", int, False), ("split", str, False), ("method", str, False), ("save_eigenvectors", bool, False),
          ("tol", float, False), ("trace_method", str, True), ("trace_hvps", int, False), ("trace_rtol", float, True),
          ("density_steps", int, False), ("density_starts", int, False), ("exact_residuals", bool, False),
          ("model_factory", str, True), ("per_layer", bool, False), ("per_layer_top", int, False),
          ("loss", str, True), ("curvature", str, False), ("products", str, False))



# ``flatfl train --track-hessian K``: the analysis made every K rounds, on a fixed evaluation set. Its defaults differ
# from ``flatfl hessian``'s only where the cost must stay small next to training (README, "Curvature during
# training"): a fixed sample of the training split and a shorter trace. Only these fields may be set for tracking.
# The trace is Hutchinson's, stopped (checked per block of products) once its standard error is <= 10% of |trace|,
# at most 300 products; a point that misses the target is marked unresolved in metrics.csv.
TRACKING_DEFAULTS = {"samples": 128, "batch_size": 128, "tol": 1e-2, "trace_method": "hutchinson", "trace_rtol": 0.1,
                     "trace_hvps": 300}
TRACKING_FIELDS = ("top", "trace", "samples", "batch_size", "split", "method", "seed", "tol", "trace_method",
                   "trace_hvps", "trace_rtol", "exact_residuals", "curvature")


def tracking_settings(overrides: dict | None = None, device: str = "cpu") -> HessianSettings:
    """The Hessian settings of curvature tracking: :data:`TRACKING_DEFAULTS` with ``overrides`` (a run config's
    ``track_hessian_settings``), validated; ConfigError on an unknown or ill-typed key."""
    overrides = dict(overrides or {})
    unknown = sorted(str(k) for k in overrides if k not in TRACKING_FIELDS)
    if unknown:
        raise ConfigError(f"unknown curvature-tracking setting {unknown[0]!r}; choose from {', '.join(TRACKING_FIELDS)}")
    try:
        settings = HessianSettings(**{**TRACKING_DEFAULTS, **overrides, "device": device}).validate()
    except ConfigError as e:  # named as given: --track-top / --track-samples on the command line
        message = str(e).replace("--top ", "--track-top ").replace("--samples ", "--track-samples ")
        raise ConfigError(f"curvature tracking (--track-hessian): {message}") from None
    if not (settings.top or settings.trace):
        raise ConfigError("curvature tracking needs top >= 1 or trace")
    return settings
