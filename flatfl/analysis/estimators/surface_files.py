"""The files of ``flatfl surface`` (docs/analysis-protocols.md §6): the resumable grid ``surface.npz`` (:class:`GridFile`),
the directions it was computed along ``directions.pt`` (:func:`save_directions`, :func:`load_saved_directions`, so
that a resumed Hessian surface skips Lanczos), ``surface.csv`` (:func:`surface_csv`) and the digests in their
fingerprint (:func:`weights_sha1`, :func:`file_sha1`)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...errors import CheckpointError, ConfigError
from ...utils.io import atomic_open, atomic_torch_save
from ...utils.torch_files import check_nesting, load_weights_only
from .directions import direction_params, flatten_direction, unflatten_direction

__all__ = ["GridFile", "GRID_FORMAT", "DIRECTIONS_FORMAT", "surface_csv", "weights_sha1", "file_sha1",
           "save_directions", "load_saved_directions", "jsonable"]

GRID_FORMAT = "flatfl-surface-grid"
DIRECTIONS_FORMAT = "flatfl-surface-directions"


@dataclass
class GridFile:
    """The (possibly partial) grid: ``loss[iy, ix]`` and ``accuracy[iy, ix]`` at ``(xs[ix], ys[iy])``, ``done``."""

    path: Path | None
    xs: np.ndarray
    ys: np.ndarray
    loss: np.ndarray
    accuracy: np.ndarray
    done: np.ndarray
    fingerprint: dict = field(default_factory=dict)
    seconds: float = 0.0

    @classmethod
    def new(cls, path, xs, fingerprint=None) -> "GridFile":
        n = len(xs)
        return cls(Path(path) if path is not None else None, np.asarray(xs, float), np.asarray(xs, float),
                   np.full((n, n), np.nan), np.full((n, n), np.nan), np.zeros((n, n), dtype=bool),
                   dict(fingerprint or {}))

    @classmethod
    def load(cls, path) -> "GridFile":
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                if str(z["format"]) != GRID_FORMAT:
                    raise ValueError("format")
                grid = cls(path, z["x"], z["y"], z["loss"], z["accuracy"], z["done"],
                           json.loads(str(z["fingerprint"])), float(z["seconds"]))
            grid.check()
            return grid
        except Exception:
            raise CheckpointError(f"{path} is not a readable flatfl surface grid; delete it or pass --force") from None

    def check(self) -> None:
        """What this module writes (ValueError otherwise): float coordinates ``x``, ``y`` of one length n; (n, n)
        float ``loss`` and ``accuracy`` and a boolean ``done``; at the points done, a finite loss and an accuracy in
        0..1 (the values of the points not done are never read)."""
        n = self.xs.shape[0] if self.xs.ndim == 1 else -1
        arrays = (self.loss, self.accuracy)
        if n < 1 or self.ys.shape != (n,) or self.done.shape != (n, n) or self.done.dtype != np.bool_ \
                or any(a.shape != (n, n) or a.dtype.kind != "f" for a in arrays) \
                or any(a.dtype.kind != "f" or not np.isfinite(a).all() for a in (self.xs, self.ys)):
            raise ValueError("layout")
        if not (np.isfinite(self.loss[self.done]).all() and np.isfinite(self.accuracy[self.done]).all()
                and ((self.accuracy[self.done] >= 0) & (self.accuracy[self.done] <= 1)).all()):
            raise ValueError("values")

    @classmethod
    def open(cls, path, xs, fingerprint: dict, force: bool = False) -> "GridFile":
        """Resume ``path`` if it holds this grid with these settings, else start a new one (``force``: always)."""
        if path is None or force or not Path(path).exists():
            return cls.new(path, xs, fingerprint)
        grid = cls.load(path)
        if grid.fingerprint != jsonable(fingerprint) or grid.xs.shape != np.shape(xs) or \
                not np.allclose(grid.xs, xs, rtol=0, atol=0):
            differing = sorted(k for k in set(grid.fingerprint) | set(jsonable(fingerprint))
                               if grid.fingerprint.get(k) != jsonable(fingerprint).get(k))
            raise ConfigError(f"{path} holds a surface with other settings ({', '.join(differing) or 'grid'}); "
                              "pass --force to start over or choose another --out")
        return grid

    def save(self) -> None:
        if self.path is None:
            return
        with atomic_open(self.path, "wb") as f:
            np.savez(f, format=np.array(GRID_FORMAT), x=self.xs, y=self.ys, loss=self.loss,
                     accuracy=self.accuracy, done=self.done, fingerprint=np.array(json.dumps(jsonable(
                         self.fingerprint), sort_keys=True)), seconds=np.array(self.seconds))

    def pending(self) -> list[int]:
        """Flat indices (``iy * N + ix``) of the points not done yet, in row-major order."""
        return [int(i) for i in np.flatnonzero(~self.done.reshape(-1))]

    def point(self, index: int) -> tuple[float, float]:
        iy, ix = divmod(index, len(self.xs))
        return float(self.xs[ix]), float(self.ys[iy])

    def record(self, index: int, loss: float, accuracy: float) -> None:
        iy, ix = divmod(index, len(self.xs))
        self.loss[iy, ix], self.accuracy[iy, ix], self.done[iy, ix] = loss, accuracy, True


def jsonable(obj):
    """``obj`` as it reads back from JSON (keys sorted, anything else as its string)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def surface_csv(result) -> str:
    """surface.csv: one row per grid point (x, y, loss, accuracy), rows in row-major order."""
    lines = ["x,y,loss,accuracy"]
    for iy, y in enumerate(result.ys):
        for ix, x in enumerate(result.xs):
            lines.append(f"{float(x)!r},{float(y)!r},{float(result.loss[iy, ix])!r},"
                         f"{float(result.accuracy[iy, ix])!r}")
    return "\n".join(lines) + "\n"


def weights_sha1(model: nn.Module) -> str:
    """sha1 of the parameters that directions move (the fingerprint of surface.npz and directions.pt)."""
    h = hashlib.sha1()
    for p in direction_params(model):
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def file_sha1(path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_directions(path: Path, pair, fingerprint: dict, info: dict, model: nn.Module) -> None:
    """directions.pt: the two directions (flat, CPU), the parameter names, and the settings they belong to."""
    atomic_torch_save({"format": DIRECTIONS_FORMAT, "fingerprint": json.dumps(jsonable(fingerprint), sort_keys=True),
                       "vectors": [flatten_direction(d).detach().cpu() for d in pair],
                       "param_names": [n for n, p in model.named_parameters() if p.requires_grad],
                       "info": json.dumps(jsonable(info))}, path)


def load_saved_directions(path: Path, fingerprint: dict, model: nn.Module):
    """Directions saved by an earlier run with the same settings (so a resumed Hessian surface skips Lanczos)."""
    if not path.is_file():
        return None
    try:
        payload = load_weights_only(path)
        check_nesting(payload, path)
    except Exception:  # damaged or not flatfl's: computed again
        return None
    if not isinstance(payload, dict) or payload.get("format") != DIRECTIONS_FORMAT or \
            payload.get("fingerprint") != json.dumps(jsonable(fingerprint), sort_keys=True):
        return None
    params = direction_params(model)
    pair = tuple(unflatten_direction(v, params) for v in payload["vectors"])
    return pair, json.loads(payload["info"])
