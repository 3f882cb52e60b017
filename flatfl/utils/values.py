"""Strict typing of settings read from files and the command line.

The one rule for numbers written as text: a *float* setting accepts a string that is a plain decimal or scientific
literal (``"1e-2"``, ``"0.5"``), as a quoted value in a file or a YAML 1.1 reader would give it (flatfl reads YAML
by the 1.2 core schema, where ``lr: 1e-2`` is already a number: flatfl/train/config.py). Nothing else is
converted: a bool must be ``true``/``false`` (the string ``"no"`` is refused, not read as on or off), an integer
must be an integer (not ``2.5``, not ``"3"``), and every float must be finite.
"""
from __future__ import annotations

import math
import re
from typing import Any

from ..errors import ConfigError

_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def coerce(value: Any, kind: type, name: str) -> Any:
    """``value`` as a ``kind`` (bool, int, float or str) by the rules above; ConfigError naming ``name`` otherwise."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value.strip())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
            return value
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r}")
    if kind is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{name} must be a table, got {value!r}")
    return value


MAX_SEED = 2**32 - 1


def check_seed(value: Any, name: str = "--seed") -> int:
    """A seed: an integer in 0..2**32-1 (what numpy and torch accept everywhere); ConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ConfigError(f"{name} must be an integer in 0..{MAX_SEED}, got {value!r}")
    return value
