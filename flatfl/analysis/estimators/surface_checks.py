"""The loss surface's own checks, torch-free: the direction kinds, the grid's size and half-width, the number of
grid workers and how often the grid file is saved (what :mod:`.surface` checks when it is called, and what
``flatfl surface``'s settings check where they enter)."""
from __future__ import annotations

import math
import numbers

from ...errors import ConfigError

__all__ = ["DIRECTION_KINDS", "MAX_GRID", "MAX_RANGE", "MAX_WORKERS", "check_grid", "check_workers",
           "check_save_every"]

DIRECTION_KINDS = ("random", "hessian")


MAX_GRID = 1001  # points per axis: about 10^6 losses
MAX_RANGE = 1e4  # half-width of the square; beyond, the perturbed weights overflow float32
MAX_WORKERS = 1024  # processes evaluating the grid, each with its own copy of the model and data


def check_grid(grid, radius) -> None:
    """A ``grid x grid`` square of half-width ``radius``: an integer >= 2 and a positive finite number."""
    if isinstance(grid, bool) or not isinstance(grid, numbers.Integral) or grid < 2:
        raise ConfigError(f"--grid must be an integer >= 2 (points per axis), got {grid!r}")
    if grid > MAX_GRID:
        raise ConfigError(f"--grid must be at most {MAX_GRID} points per axis ({MAX_GRID ** 2:,} losses), got {grid}")
    if isinstance(radius, bool) or not (isinstance(radius, numbers.Real) and math.isfinite(radius) and radius > 0):
        raise ConfigError(f"--range must be a positive number, got {radius!r}")
    if radius > MAX_RANGE:
        raise ConfigError(f"--range must be at most {MAX_RANGE:g} (filter-normalised directions: 1 moves each "
                          f"filter by its own norm), got {radius!r}")


def check_workers(workers) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
    if workers > MAX_WORKERS:
        raise ConfigError(f"--workers must be at most {MAX_WORKERS} (one process each), got {workers}")


def check_save_every(save_every) -> None:
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
        raise ConfigError(f"save_every must be a positive integer, got {save_every!r}")
