"""What the typed settings of the analyses share (:class:`~flatfl.analysis.commands.hessian_settings.HessianSettings`,
:class:`~flatfl.analysis.commands.client_metrics_settings.ClientMetricsSettings`,
:class:`~flatfl.analysis.commands.surface_settings.SurfaceSettings`): frozen dataclasses whose field defaults are the defaults of
the command line, the grid files, the presets and the functions; unknown keys refused in one line; types checked
with the flag named as on the command line. No torch here: the command line reads the defaults when it starts."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from ...errors import ConfigError, unknown_name

__all__ = ["Settings", "is_kind", "check_kinds"]


class Settings:
    """Mixin of a frozen settings dataclass; ``SOURCE`` names it in messages."""

    SOURCE = "the settings"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def check_keys(cls, mapping: Mapping[str, Any], source: str | None = None) -> None:
        """One ConfigError line naming the keys of ``mapping`` that are no setting, and the allowed ones."""
        unknown = sorted(str(k) for k in mapping if k not in cls.names())
        if len(unknown) == 1:
            raise unknown_name("option", unknown[0], sorted(cls.names()), where=f"in {source or cls.SOURCE}",
                               fallback=f"unknown option {unknown[0]!r} in {source or cls.SOURCE}: use "
                                        f"{', '.join(sorted(cls.names()))}")
        if unknown:
            raise ConfigError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                              f"in {source or cls.SOURCE}: use {', '.join(sorted(cls.names()))}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str | None = None):
        """The settings in ``mapping`` (keys: field names; missing ones take the defaults), validated; unknown keys
        are refused in one line that names them and the allowed ones."""
        cls.check_keys(mapping, source)
        settings = cls(**{str(k): v for k, v in mapping.items()})
        settings.validate()
        return settings

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self):  # pragma: no cover - every settings class has its own
        raise NotImplementedError


def check_kinds(settings, kinds) -> None:
    """``kinds``: (field, type, None allowed); the first field of another type is a ConfigError line."""
    for name, kind, optional in kinds:
        value = getattr(settings, name)
        if value is None and optional:
            continue
        if not is_kind(value, kind):
            what = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}[kind]
            raise ConfigError(f"--{name.replace('_', '-')} must be {what}, got {value!r}")


def is_kind(value: Any, kind: type) -> bool:
    """``value`` is a ``kind`` (bool, int, float: finite, str); a bool is no number."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real) and math.isfinite(value)
    return isinstance(value, kind)
