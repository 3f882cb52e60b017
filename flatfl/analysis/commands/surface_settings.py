"""The settings of one loss surface (``flatfl surface``) and their defaults, in one place: its options,
:func:`flatfl.analysis.commands.surface_command.run_surface`, a grid file's ``[surface]`` section and the reproduce presets read
:class:`SurfaceSettings`."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError, unknown_name
from ..estimators.surface_checks import DIRECTION_KINDS, check_grid, check_save_every, check_workers
from ...utils.precision import check_analysis_precision
from .settings import Settings, check_kinds
from ...utils.values import check_seed

SPLITS = ("train", "test")


@dataclass(frozen=True)
class SurfaceSettings(Settings):
    """Every keyword of ``run_surface`` but ``quiet``; the field defaults are the defaults everywhere."""

    SOURCE = "the surface settings"

    directions: str = "random"
    grid: int = 21
    range: float = 1.0  # the half-width R of the square linspace(-R, R, grid)^2
    samples: int | None = None  # None: the whole split
    workers: int = 1
    batch_size: int = 256
    split: str = "train"
    seed: int = 0
    include_bn_bias: bool = False
    eigenvectors: str | None = None  # an eigenvectors.pt of flatfl hessian --save-eigenvectors
    tol: float = 1e-3
    device: str = "cpu"
    data_dir: str | None = None  # None: the folder the checkpoint recorded
    force: bool = False
    save_every: int = 8
    model_factory: str | None = None
    precision: str | None = None  # float32 | float64; None: the run's (flatfl.utils.precision)

    def validate(self) -> "SurfaceSettings":
        """Types and ranges, one ConfigError line for the first problem (the flag named as on the command line)."""
        if self.directions not in DIRECTION_KINDS:
            raise unknown_name("direction kind", self.directions, DIRECTION_KINDS)
        check_grid(self.grid, self.range)
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int)
                                         or self.samples <= 0):
            raise ConfigError(f"--samples must be a positive integer, got {self.samples!r}")
        check_workers(self.workers)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size <= 0:
            raise ConfigError(f"--batch-size must be a positive integer, got {self.batch_size!r}")
        if self.split not in SPLITS:
            raise unknown_name("split", self.split, SPLITS)
        if self.eigenvectors is not None and self.directions != "hessian":
            raise ConfigError("--eigenvectors needs --directions hessian")
        check_seed(self.seed)
        if isinstance(self.tol, bool) or not (isinstance(self.tol, (int, float)) and 0 < self.tol < 1):
            raise ConfigError(f"--tol must be in (0, 1) (a relative tolerance), got {self.tol!r}")
        check_kinds(self, (("include_bn_bias", bool, False), ("force", bool, False), ("model_factory", str, True)))
        check_save_every(self.save_every)
        check_analysis_precision(self.precision)
        return self
