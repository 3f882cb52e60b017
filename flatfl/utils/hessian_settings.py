"""The settings of one Hessian analysis and their defaults, in one place.

``flatfl hessian``'s options, :func:`flatfl.analysis.hessian_run.run_hessian` (and its ``analyse``), a grid file's
``[hessian]`` / ``[spectrum]`` sections and ``flatfl report --compute-missing`` all take their defaults from
:class:`HessianSettings`. It lives here, not in ``flatfl.analysis``, because the command line reads the defaults
when it starts and must not import torch for that (``flatfl.analysis`` does)."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError
from .values import check_seed

METHODS = ("lanczos", "power")
TRACE_METHODS = ("hutchpp", "hutchinson", "pyhessian")
SPLITS = ("train", "test")


@dataclass(frozen=True)
class HessianSettings:
    """What a Hessian analysis computes and how (every keyword of ``run_hessian`` but ``quiet``); the field
    defaults are the defaults everywhere. The names are those of hessian.json's ``settings``."""

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
    density_starts: int = 1
    exact_residuals: bool = False
    data_dir: str | None = None  # None: the folder the checkpoint recorded
    model_factory: str | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_keys(cls, mapping: Mapping[str, Any], source: str = "the Hessian settings") -> None:
        """One ConfigError line naming the keys of ``mapping`` that are no setting, and the allowed ones."""
        unknown = sorted(str(k) for k in mapping if k not in cls.names())
        if unknown:
            raise ConfigError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                              f"in {source}: use {', '.join(sorted(cls.names()))}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str = "the Hessian settings") -> "HessianSettings":
        """The settings in ``mapping`` (keys: field names; missing ones take the defaults), validated; unknown keys
        are refused in one line that names them and the allowed ones."""
        cls.check_keys(mapping, source)
        settings = cls(**{str(k): v for k, v in mapping.items()})
        settings.validate()
        return settings

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "HessianSettings":
        """Types and ranges, one ConfigError line for the first problem (the flag named as on the command line)."""
        for name, kind, optional in _KINDS:
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not _is(value, kind):
                what = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}[kind]
                raise ConfigError(f"--{name.replace('_', '-')} must be {what}, got {value!r}")
        if self.top < 0:
            raise ConfigError(f"--top must be a non-negative integer, got {self.top!r}")
        if self.method not in METHODS:
            raise ConfigError(f"unknown eigenvalue method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 0 < self.tol < 1:
            raise ConfigError(f"--tol must be in (0, 1) (a relative tolerance), got {self.tol!r}")
        if self.trace_method is not None and self.trace_method not in TRACE_METHODS:
            raise ConfigError(f"unknown trace method {self.trace_method!r}; choose one of {', '.join(TRACE_METHODS)}")
        if self.trace_hvps < 1:
            raise ConfigError(f"--trace-hvps must be >= 1, got {self.trace_hvps}")
        if self.trace_rtol is not None and not self.trace_rtol > 0:
            raise ConfigError(f"--trace-rtol must be positive, got {self.trace_rtol}")
        if self.density_steps < 1 or self.density_starts < 1:
            raise ConfigError("--density-steps and --density-starts must be >= 1")
        if self.split not in SPLITS:
            raise ConfigError(f"unknown split {self.split!r}; choose one of {', '.join(SPLITS)}")
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


# (field, type, None allowed); device and data_dir are checked where they are used (a torch.device, a Path)
_KINDS = (("top", int, False), ("trace", bool, False), ("density", bool, False), ("samples", int, True),
          ("batch_size", int, False), ("split", str, False), ("method", str, False), ("save_eigenvectors", bool, False),
          ("tol", float, False), ("trace_method", str, True), ("trace_hvps", int, False), ("trace_rtol", float, True),
          ("density_steps", int, False), ("density_starts", int, False), ("exact_residuals", bool, False),
          ("model_factory", str, True))


def _is(value: Any, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real) and math.isfinite(value)
    return isinstance(value, kind)
