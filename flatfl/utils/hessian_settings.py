"""The settings of one Hessian analysis and their defaults, in one place.

``flatfl hessian``'s options, :func:`flatfl.analysis.hessian_run.run_hessian` (and its ``analyse``), a grid file's
``[hessian]`` / ``[spectrum]`` sections and ``flatfl report --compute-missing`` all take their defaults from
:class:`HessianSettings`. It lives here, not in ``flatfl.analysis``, because the command line reads the defaults
when it starts and must not import torch for that (``flatfl.analysis`` does)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, unknown_name
from .settings import Settings, check_kinds
from .values import check_seed

# The Hessian estimators, one line each: name -> (module of flatfl.analysis, function). The function takes the
# shared arguments (eigenvalues: ``op, k, *, tol, seed, return_vectors, exact_residuals -> EigenResult``; trace:
# ``op, *, max_hvps, rtol, seed, block_size -> TraceResult``). Names and places only, so that the command line and
# the checks below read them without torch; flatfl.analysis.estimators imports the function when it runs one.
EIGEN_ESTIMATORS = {"lanczos": ("estimators", "lanczos"), "power": ("estimators", "power")}
TRACE_ESTIMATORS = {"hutchpp": ("trace", "hutchpp_trace"), "hutchinson": ("trace", "hutchinson_trace"),
                    "pyhessian": ("estimators", "pyhessian")}
METHODS = tuple(EIGEN_ESTIMATORS)
TRACE_METHODS = tuple(TRACE_ESTIMATORS)
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

    def validate(self) -> "HessianSettings":
        """Types and ranges, one ConfigError line for the first problem (the flag named as on the command line)."""
        check_kinds(self, _KINDS)
        if self.top < 0:
            raise ConfigError(f"--top must be a non-negative integer, got {self.top!r}")
        if self.method not in METHODS:
            raise unknown_name("eigenvalue method", self.method, METHODS)
        if not 0 < self.tol < 1:
            raise ConfigError(f"--tol must be in (0, 1) (a relative tolerance), got {self.tol!r}")
        if self.trace_method is not None and self.trace_method not in TRACE_METHODS:
            raise unknown_name("trace method", self.trace_method, TRACE_METHODS)
        if self.trace_hvps < 1:
            raise ConfigError(f"--trace-hvps must be >= 1, got {self.trace_hvps}")
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
        if not (self.top or self.trace or self.density):
            raise ConfigError("nothing to compute: ask for --top K >= 1, --trace or --density")
        if self.save_eigenvectors and self.top < 1:
            raise ConfigError("--save-eigenvectors needs --top >= 1")
        return self


# bounds on the sizes a user sets, checked before anything is allocated (each stored vector has the model's size;
# --top is bounded by the parameter count once the checkpoint is read)
MAX_DENSITY_STEPS = 10_000
MAX_DENSITY_STARTS = 1000


# (field, type, None allowed); device and data_dir are checked where they are used (a torch.device, a Path)
_KINDS = (("top", int, False), ("trace", bool, False), ("density", bool, False), ("samples", int, True),
          ("batch_size", int, False), ("split", str, False), ("method", str, False), ("save_eigenvectors", bool, False),
          ("tol", float, False), ("trace_method", str, True), ("trace_hvps", int, False), ("trace_rtol", float, True),
          ("density_steps", int, False), ("density_starts", int, False), ("exact_residuals", bool, False),
          ("model_factory", str, True))



# ``flatfl train --track-hessian K``: the analysis made every K rounds, on a fixed evaluation set. Its defaults differ
# from ``flatfl hessian``'s only where the cost must stay small next to training (README, "Curvature during
# training"): a fixed sample of the training split and a shorter trace. Only these fields may be set for tracking.
# The trace is Hutchinson's, stopped (checked per block of products) once its standard error is <= 10% of |trace|,
# at most 300 products; a point that misses the target is marked unresolved in metrics.csv.
TRACKING_DEFAULTS = {"samples": 128, "batch_size": 128, "tol": 1e-2, "trace_method": "hutchinson", "trace_rtol": 0.1,
                     "trace_hvps": 300}
TRACKING_FIELDS = ("top", "trace", "samples", "batch_size", "split", "method", "seed", "tol", "trace_method",
                   "trace_hvps", "trace_rtol", "exact_residuals")


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
