"""The settings of one Hessian analysis and their defaults, in one place (:class:`HessianSettings`), and those of
curvature tracking during training (:func:`tracking_settings`).

``flatfl hessian``'s options, a grid file's ``[hessian]`` / ``[spectrum]`` sections, ``flatfl report
--compute-missing``, the reproduce presets and Python build one :class:`HessianSettings` where they start; that one
object is what :func:`flatfl.analysis.commands.hessian_command.run_hessian` and :func:`~flatfl.analysis.commands.hessian_command.compute`
take, and what hessian.json's ``settings`` records (:func:`~flatfl.analysis.commands.hessian_command.settings_record`). No torch
here: the command line reads the defaults when it starts. The estimators' names are checked against the registry
(:mod:`flatfl.analysis.estimators.registry`), the curvature's against the registry of curvature kinds
(:mod:`flatfl.analysis.operators.kinds`), whose entries give :data:`CURVATURES`, :data:`CURVATURE_TITLES` and
:data:`CURVATURE_NAMES`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError, unknown_name
from ...utils.precision import check_analysis_precision
from ...utils.values import check_seed
from ..estimators.quantities import parse_measure
from ..estimators.registry import DEFAULT_EIGEN_METHOD, DEFAULT_TRACE_METHOD, Estimator, estimator, resolve_which
from ..operators.kinds import CURVATURE_NAMES, CURVATURE_TITLES, CURVATURES, DEFAULT_CURVATURE, kind_of
from ..operators.names import PRODUCT_METHODS
from .settings import Settings, check_kinds

__all__ = ["HessianSettings", "tracking_settings", "TRACKING_DEFAULTS", "TRACKING_FIELDS", "SPLITS", "CURVATURES",
           "CURVATURE_TITLES", "CURVATURE_NAMES", "PRODUCT_METHODS", "MAX_DENSITY_STEPS", "MAX_DENSITY_STARTS",
           "MAX_TOP", "products_text", "measured_text", "eigenvalues_text", "damping_text", "BEFORE_RECORDED"]

SPLITS = ("train", "test")


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
    method: str = DEFAULT_EIGEN_METHOD
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
    curvature: str = DEFAULT_CURVATURE  # the matrix measured: a name of CURVATURES (flatfl.analysis.operators.kinds)
    products: str = "auto"  # how Hessian products are computed (flatfl.analysis.operators.products); "auto": by device
    which: str | None = None  # largest | smallest | magnitude (registry.WHICH); None: the method's own (lanczos: largest)
    smallest: int = 0  # the K smallest (most negative) eigenvalues too, beside --top's (0: none)
    measure: str | None = None  # registered quantities, by name, comma-separated (flatfl.analysis.estimators.quantities)
    damping: float = 0.0  # the matrix measured is the curvature + damping * I (flatfl.analysis.operators.combined)

    def validate(self) -> "HessianSettings":
        """Types and ranges, one ConfigError line for the first problem (the flag named as on the command line)."""
        check_kinds(self, _KINDS)
        if self.top < 0:
            raise ConfigError(f"--top must be a non-negative integer, got {self.top!r}")
        if self.top > MAX_TOP:
            raise ConfigError(f"--top must be at most {MAX_TOP:,} (one stored vector per eigenvalue), got {self.top}")
        estimator("eigenvalues", self.method)  # the registry at run time: a method registered by now passes
        if not 0 <= self.smallest <= MAX_TOP:
            raise ConfigError(f"--smallest must be an integer from 0 to {MAX_TOP:,}, got {self.smallest!r}")
        if self.smallest and self.top and self.resolved_which == "smallest":
            raise ConfigError("--smallest with --which smallest: --top already finds the smallest eigenvalues; "
                              "give one of the two")
        resolve_which(self.method, self.which)  # a name of WHICH that the method can find
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
        if not 0 <= self.damping <= MAX_DAMPING:
            raise ConfigError(f"--damping must be from 0 to {MAX_DAMPING:g} (the matrix measured is the curvature + "
                              f"damping * I; beyond it the curvature is lost to rounding), got {self.damping!r}")
        kind = kind_of(self.curvature)  # a registered curvature (the registry of flatfl.analysis.operators.kinds)
        if self.products not in PRODUCT_METHODS:
            raise unknown_name("product method", self.products, PRODUCT_METHODS)
        kind.check_products(self.products)
        quantities = self.quantities  # registered names, each once
        if not (self.top or self.smallest or self.trace or self.density or self.per_layer or quantities):
            raise ConfigError("nothing to compute: ask for --top K >= 1, --smallest K >= 1, --trace, --density, "
                              "--per-layer or --measure")
        if self.save_eigenvectors and self.top < 1:
            raise ConfigError("--save-eigenvectors needs --top >= 1")
        check_analysis_precision(self.precision)
        return self

    @property
    def quantities(self) -> tuple[str, ...]:
        """The registered quantities ``measure`` names, in the registry's order (one ConfigError line for an unknown
        name or one given twice)."""
        return parse_measure(self.measure)

    @property
    def resolved_trace_method(self) -> str:
        """The trace estimator that runs: ``trace_method``, else the eigenvalue method's own (power: PyHessian's
        rule), else :data:`DEFAULT_TRACE_METHOD`."""
        if self.trace_method is not None:
            return self.trace_method
        return estimator("eigenvalues", self.method).trace_method or DEFAULT_TRACE_METHOD

    @property
    def smallest_method(self) -> str:
        """The estimator of the ``smallest`` eigenvalues: ``method`` where it can find the smallest, else
        :data:`DEFAULT_EIGEN_METHOD` (power iteration finds only the largest in magnitude)."""
        return self.method if "smallest" in estimator("eigenvalues", self.method).which else DEFAULT_EIGEN_METHOD

    @property
    def resolved_which(self) -> str:
        """The eigenvalues ``--top`` finds: ``which``, else the eigenvalue method's own (lanczos: the largest
        algebraic; power: the largest in magnitude)."""
        return resolve_which(self.method, self.which)

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
#: the largest damping: the curvature + 1e12 I keeps O(1) curvature to about 1e-4 in float64 (none in float32)
MAX_DAMPING = 1e12
#: settings a result file written before they existed did not record, and what it computed without them (compared
#: where an analysis folder is reused, and where a report asks for settings: flatfl.run_layout.settings_match)
BEFORE_RECORDED = {"curvature": "hessian", "products": "auto", "smallest": 0, "measure": None, "damping": 0.0}


# (field, type, None allowed); device and data_dir are checked where they are used (a torch.device, a Path)
_KINDS = (("top", int, False), ("trace", bool, False), ("density", bool, False), ("samples", int, True),
          ("batch_size", int, False), ("split", str, False), ("method", str, False), ("save_eigenvectors", bool, False),
          ("tol", float, False), ("trace_method", str, True), ("trace_hvps", int, False), ("trace_rtol", float, True),
          ("density_steps", int, False), ("density_starts", int, False), ("exact_residuals", bool, False),
          ("model_factory", str, True), ("per_layer", bool, False), ("per_layer_top", int, False),
          ("loss", str, True), ("curvature", str, False), ("products", str, False), ("which", str, True),
          ("smallest", int, False), ("measure", str, True), ("damping", float, False))


def products_text(products: dict | None) -> str:
    """How a result's products were computed, as its lines and figures say it (hessian.json's ``products``): 'exact
    products (double-backward)', 'finite-difference products (stated relative error 0.00014)'; '' when the result
    records none (an explicit matrix, a function)."""
    if not isinstance(products, dict) or not products.get("method"):
        return ""
    method, error = products["method"], products.get("relative_error")
    if method == "finite-difference":
        stated = "" if error is None else f" (stated relative error {error:.2g})"
        return f"finite-difference products{stated}"
    return f"exact products ({method})"


def damping_text(damping) -> str:
    """' + 0.001 I' for a damped curvature (``--damping``), '' without."""
    return f" + {damping:g} I" if isinstance(damping, (int, float)) and not isinstance(damping, bool) and damping \
        else ""


def measured_text(curvature: str | None, products: dict | None = None, precision: str | None = None,
                  damping: float = 0.0) -> str:
    """What a result measured, in a few words: 'GGN, exact products (jvp-vjp), float32', 'Hessian + 0.0005 I, ...'
    (the curvature and its damping, how its products were computed, the floating type they ran in; each only where
    known)."""
    parts = [CURVATURE_TITLES.get(curvature, str(curvature)) + damping_text(damping)] if curvature else []
    for part in (products_text(products), precision):
        if part:
            parts.append(part)
    return ", ".join(parts)


def eigenvalues_text(which: str | None, count: int = 1) -> str:
    """How result lines name the eigenvalues ``which`` asks for: 'top eigenvalue' (the largest), 'smallest
    eigenvalue', 'largest-magnitude eigenvalue'; plural for ``count`` > 1."""
    s = "s" if count != 1 else ""
    return {"smallest": f"smallest eigenvalue{s}", "magnitude": f"largest-magnitude eigenvalue{s}"}.get(
        which, f"top eigenvalue{s}")


# ``flatfl train --track-hessian K``: the analysis made every K rounds, on a fixed evaluation set. Its defaults differ
# from ``flatfl hessian``'s only where the cost must stay small next to training (README, "Curvature during
# training"): a fixed sample of the training split and a shorter trace. Only these fields may be set for tracking.
# The trace is Hutchinson's, stopped (checked per block of products) once its standard error is <= 10% of |trace|,
# at most 300 products; a point that misses the target is marked unresolved in metrics.csv.
TRACKING_DEFAULTS = {"samples": 128, "batch_size": 128, "tol": 1e-2, "trace_method": "hutchinson", "trace_rtol": 0.1,
                     "trace_hvps": 300}
TRACKING_FIELDS = ("top", "trace", "samples", "batch_size", "split", "method", "seed", "tol", "trace_method",
                   "trace_hvps", "trace_rtol", "exact_residuals", "curvature", "measure")


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
        message = str(e).replace("--top ", "--track-top ").replace("--samples ", "--track-samples ") \
            .replace("--measure ", "--track-measure ")
        raise ConfigError(f"curvature tracking (--track-hessian): {message}") from None
    if not (settings.top or settings.trace or settings.quantities):
        raise ConfigError("curvature tracking needs top >= 1, trace or a measured quantity")
    return settings
