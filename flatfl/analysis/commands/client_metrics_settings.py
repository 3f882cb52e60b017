"""The settings of one cross-client Hessian analysis (``flatfl hessian-clients``) and their defaults, in one place:
its options, :func:`flatfl.analysis.commands.clients_command.run_client_metrics`, a grid file's ``[clients]`` section and the
reproduce presets read :class:`ClientMetricsSettings`."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError, unknown_name
from .hessian_settings import CURVATURES
from ...utils.precision import check_analysis_precision
from .settings import Settings, check_kinds
from ...utils.values import check_seed

PROTOCOLS = ("default", "fedalign")


MAX_PROBES = 100_000  # probes per client (each one Hessian-vector product)
MAX_GROUPS = 1000  # jackknife groups: one stored vector of the model's size per group and client


@dataclass(frozen=True)
class ClientMetricsSettings(Settings):
    """Every keyword of ``run_client_metrics`` but ``quiet`` and ``replace``; the field defaults are the defaults
    everywhere. ``samples`` and ``batch_size`` None: the protocol's own (all samples, 256; fedalign 640, 64)."""

    SOURCE = "the cross-client settings"

    protocol: str = "default"
    probes: int = 100
    groups: int = 10
    samples: int | None = None
    batch_size: int | None = None
    seed: int = 0
    tol: float = 1e-3
    device: str = "cpu"
    data_dir: str | None = None  # None: the folder the checkpoint recorded
    model_factory: str | None = None
    curvature: str = "hessian"  # the matrix of every client: hessian | ggn | empirical-fisher
    precision: str | None = None  # float32 | float64; None: the run's (flatfl.utils.precision)

    def validate(self) -> "ClientMetricsSettings":
        """Types and ranges, one ConfigError line for the first problem (the flag named as on the command line)."""
        if self.protocol not in PROTOCOLS:
            raise unknown_name("cross-client protocol", self.protocol, PROTOCOLS)
        least = 4 if self.protocol == "default" else 2
        if isinstance(self.probes, bool) or not isinstance(self.probes, int) or self.probes < least:
            raise ConfigError(f"--probes must be at least {least} for the {self.protocol} protocol, got {self.probes}")
        if self.probes > MAX_PROBES:
            raise ConfigError(f"--probes must be at most {MAX_PROBES}, got {self.probes}")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 2:
            raise ConfigError(f"--groups must be an integer >= 2, got {self.groups}")
        if self.groups > MAX_GROUPS:
            raise ConfigError(f"--groups must be at most {MAX_GROUPS} (one stored vector of the model's size per "
                              f"group), got {self.groups}")
        check_kinds(self, (("samples", int, True), ("batch_size", int, True), ("model_factory", str, True)))
        if self.samples is not None and self.samples <= 0:
            raise ConfigError(f"--samples must be a positive integer, got {self.samples}")
        if self.batch_size is not None and self.batch_size <= 0:
            raise ConfigError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if isinstance(self.tol, bool) or not (isinstance(self.tol, (int, float)) and 0 < self.tol < 1):
            raise ConfigError(f"--tol must be in (0, 1) (a relative tolerance), got {self.tol!r}")
        check_seed(self.seed)
        if self.curvature not in CURVATURES:
            raise unknown_name("curvature", self.curvature, CURVATURES)
        check_analysis_precision(self.precision)
        return self
