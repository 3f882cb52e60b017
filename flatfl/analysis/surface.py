"""2-D loss surfaces around a model (spec/analysis.md §6; Li et al. 2018; MAN Fig. 1; FedAlign Fig. 1).

The loss and accuracy of ``theta + x d1 + y d2`` at every point of the square grid ``x, y in linspace(-R, R, N)``,
over a fixed evaluation set, the model in eval mode (BatchNorm running statistics, no dropout), no augmentation.
Directions come from :mod:`flatfl.analysis.directions` (filter-normalised random, or the top-2 Hessian
eigenvectors).

How a point is evaluated (:class:`SurfaceEvaluator`): the model's own parameters are overwritten in place with
foreach ops (``theta`` copied in, then ``x d1`` and ``y d2`` added), and the evaluation set, kept on the device as
tensors, is run under ``torch.inference_mode``. Nothing is rebuilt or reloaded per point (loss-landscape builds and
loads a perturbed state dict for every point); the original weights are restored at the end.

Grid file (resume): :class:`GridFile` is an ``.npz`` with the coordinates, the loss and accuracy grids, a done-mask
and a fingerprint of the settings. It is rewritten atomically every ``save_every`` points, so a killed run loses at
most that many points; running again with the same settings evaluates only the points not done.

Workers: with ``workers > 1`` the pending points are split into chunks and spread over a local process pool
(``fork`` where the platform has it, else ``spawn``, which needs a picklable model and loss function); each worker
holds its own copy of the model and runs torch on ``max(1, threads // workers)`` threads. Small convolutional
networks scale poorly over intra-op threads on a few cores, so separate processes use the cores better than one
process with more threads. Measured with ``benchmarks/surface_speed.py`` on a 2-core machine shared with other
jobs (load average 7-8): digits-cnn, 512 inputs, 81 points: 9.2 points/s in one process at 2 threads, 62.6 at
1 thread, 60.9 with 2 workers of 1 thread; MAN CIFAR CNN, 128 inputs: 1.78, 3.61 and 3.20 points/s. Workers beat
one process at torch's default threads (6.6x, 1.8x) but not one single-threaded process when no core is idle.

Python API: :func:`loss_surface` on any model; :func:`run_surface` is what ``flatfl surface`` does for a checkpoint.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import multiprocessing
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..utils.device import resolve_device
from ..utils.lock import locks_output
from ..utils.io import atomic_open, atomic_torch_save, atomic_write_many, json_safe
from .directions import (
    direction_params,
    directions_from_eigenvector_file,
    flatten_direction,
    hessian_directions,
    random_directions,
    unflatten_direction,
)

__all__ = ["SurfaceEvaluator", "SurfaceResult", "GridFile", "loss_surface", "run_surface", "grid_coordinates",
           "DIRECTION_KINDS"]

DIRECTION_KINDS = ("random", "hessian")
SPLITS = ("train", "test")
GRID_FORMAT = "flatfl-surface-grid"
DIRECTIONS_FORMAT = "flatfl-surface-directions"


# ---------------------------------------------------------------------------------------------- evaluation
class SurfaceEvaluator:
    """Loss and accuracy of ``model`` at ``theta + x d1 + y d2``, perturbing its parameters in place.

    ``batches``: ``(inputs, targets)`` pairs; ``loss_fn(outputs, targets)`` is the mean loss of a batch (default
    cross-entropy); the loss is the sample-weighted mean over batches. The accuracy is the fraction of argmax hits
    when the outputs are (batch, classes) scores and the targets integer labels, else NaN.
    """

    def __init__(self, model: nn.Module, batches, directions, loss_fn: Callable | None = None) -> None:
        self.model = model
        self.params = direction_params(model)
        if len(directions) != 2:
            raise ConfigError(f"a surface needs 2 directions, got {len(directions)}")
        device = self.params[0].device
        self.directions = []
        for d in directions:
            if len(d) != len(self.params) or any(tuple(t.shape) != tuple(p.shape) for t, p in zip(d, self.params)):
                raise ConfigError("a direction must have one tensor per model parameter, with the parameter's shape")
            self.directions.append([t.detach().to(dtype=p.dtype, device=p.device) for t, p in zip(d, self.params)])
        self.theta = [p.detach().clone() for p in self.params]
        self.loss_fn = loss_fn if loss_fn is not None else F.cross_entropy
        self.batches = []
        for batch in batches:
            try:
                inputs, targets = batch
            except (TypeError, ValueError):
                raise ConfigError("every batch must be an (inputs, targets) pair") from None
            self.batches.append((_to(inputs, device), _to(targets, device)))
        if not self.batches:
            raise ConfigError("the evaluation set is empty: give at least one batch")
        sizes = [len(t) for _, t in self.batches]
        self.num_samples = int(sum(sizes))
        if min(sizes) <= 0:
            raise ConfigError("the evaluation set contains an empty batch")
        self.weights = [n / self.num_samples for n in sizes]
        self.evaluations = 0

    @torch.no_grad()
    def set_point(self, x: float, y: float) -> None:
        """Parameters <- theta + x d1 + y d2 (foreach ops, in place)."""
        torch._foreach_copy_(self.params, self.theta)
        if x != 0.0:
            torch._foreach_add_(self.params, self.directions[0], alpha=float(x))
        if y != 0.0:
            torch._foreach_add_(self.params, self.directions[1], alpha=float(y))

    @torch.no_grad()
    def restore(self) -> None:
        torch._foreach_copy_(self.params, self.theta)

    def evaluate(self, x: float, y: float) -> tuple[float, float]:
        """(mean loss, accuracy) at the grid point (x, y); the model is left perturbed (call :meth:`restore`)."""
        self.set_point(x, y)
        modes = [m.training for m in self.model.modules()]
        self.model.eval()
        total, correct, classify = 0.0, 0, True
        try:
            with torch.inference_mode():
                for (inputs, targets), weight in zip(self.batches, self.weights):
                    outputs = self.model(inputs)
                    total += weight * float(self.loss_fn(outputs, targets))
                    if classify and isinstance(outputs, torch.Tensor) and outputs.dim() == 2 and \
                            isinstance(targets, torch.Tensor) and targets.dim() == 1 and \
                            not targets.is_floating_point() and outputs.shape[0] == targets.shape[0]:
                        correct += int((outputs.argmax(dim=1) == targets).sum())
                    else:
                        classify = False
        finally:
            for m, mode in zip(self.model.modules(), modes):
                m.training = mode
        self.evaluations += 1
        return total, (correct / self.num_samples if classify else math.nan)


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(t, device) for t in x)
    return x


# ---------------------------------------------------------------------------------------------- grid file
def grid_coordinates(grid: int, radius: float) -> np.ndarray:
    """``linspace(-radius, radius, grid)``, the coordinates along each axis."""
    _check_grid(grid, radius)
    return np.linspace(-float(radius), float(radius), int(grid))


def _check_grid(grid, radius) -> None:
    if isinstance(grid, bool) or not isinstance(grid, (int, np.integer)) or grid < 2:
        raise ConfigError(f"--grid must be an integer >= 2 (points per axis), got {grid!r}")
    if not (isinstance(radius, (int, float, np.floating)) and math.isfinite(radius) and radius > 0):
        raise ConfigError(f"--range must be a positive number, got {radius!r}")


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
                return cls(path, z["x"], z["y"], z["loss"], z["accuracy"], z["done"].astype(bool),
                           json.loads(str(z["fingerprint"])), float(z["seconds"]))
        except Exception:
            raise CheckpointError(f"{path} is not a readable flatfl surface grid; delete it or pass --force") from None

    @classmethod
    def open(cls, path, xs, fingerprint: dict, force: bool = False) -> "GridFile":
        """Resume ``path`` if it holds this grid with these settings, else start a new one (``force``: always)."""
        if path is None or force or not Path(path).exists():
            return cls.new(path, xs, fingerprint)
        grid = cls.load(path)
        if grid.fingerprint != _jsonable(fingerprint) or grid.xs.shape != np.shape(xs) or \
                not np.allclose(grid.xs, xs, rtol=0, atol=0):
            differing = sorted(k for k in set(grid.fingerprint) | set(_jsonable(fingerprint))
                               if grid.fingerprint.get(k) != _jsonable(fingerprint).get(k))
            raise ConfigError(f"{path} holds a surface with other settings ({', '.join(differing) or 'grid'}); "
                              "pass --force to start over or choose another --out")
        return grid

    def save(self) -> None:
        if self.path is None:
            return
        with atomic_open(self.path, "wb") as f:
            np.savez(f, format=np.array(GRID_FORMAT), x=self.xs, y=self.ys, loss=self.loss,
                     accuracy=self.accuracy, done=self.done, fingerprint=np.array(json.dumps(_jsonable(
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


def _jsonable(obj):
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


@dataclass
class SurfaceResult:
    """A finished (or interrupted) surface: coordinates, ``loss[iy, ix]``, ``accuracy[iy, ix]``, ``done``."""

    xs: np.ndarray
    ys: np.ndarray
    loss: np.ndarray
    accuracy: np.ndarray
    done: np.ndarray
    computed: int  # points evaluated by this call (resumed points excluded)
    seconds: float  # wall time of this call
    total_seconds: float  # evaluation time summed over every call that filled this grid
    workers: int

    @property
    def complete(self) -> bool:
        return bool(self.done.all())


# ---------------------------------------------------------------------------------------------- workers
_WORKER: SurfaceEvaluator | None = None


def _init_worker(model, batches, directions, loss_fn, threads) -> None:
    global _WORKER
    torch.set_num_threads(int(threads))
    _WORKER = SurfaceEvaluator(model, batches, directions, loss_fn)


def _evaluate_chunk(points):
    out = []
    for index, x, y in points:
        loss, acc = _WORKER.evaluate(x, y)
        out.append((index, loss, acc))
    return out


def _start_method(requested: str | None) -> str:
    methods = multiprocessing.get_all_start_methods()
    if requested is not None:
        if requested not in methods:
            raise ConfigError(f"start method {requested!r} is not available here; choose one of {', '.join(methods)}")
        return requested
    return "fork" if "fork" in methods else "spawn"


def loss_surface(
    model: nn.Module,
    batches,
    directions: Sequence[Sequence[torch.Tensor]],
    grid: int = 21,
    range: float = 1.0,  # noqa: A002 - the name the issue gives this argument
    *,
    loss_fn: Callable | None = None,
    workers: int = 1,
    grid_file=None,
    fingerprint: dict | None = None,
    force: bool = False,
    save_every: int = 8,
    start_method: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SurfaceResult:
    """Loss and accuracy on the ``grid x grid`` square ``linspace(-range, range, grid)^2`` around ``model``.

    ``directions``: two lists of tensors shaped like the model's parameters (see :mod:`.directions`).
    ``grid_file``: an ``.npz`` path to resume from and save to every ``save_every`` points (atomically);
    ``fingerprint``: the settings stored in it (a file with other settings is refused unless ``force``).
    ``workers``: local processes (CPU models). ``progress(done, total)`` is called after each recorded point.
    The model's parameters are restored before returning.
    """
    radius = range
    _check_grid(grid, radius)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
    if not isinstance(save_every, int) or save_every < 1:
        raise ConfigError(f"save_every must be a positive integer, got {save_every!r}")
    xs = grid_coordinates(grid, radius)
    evaluator = SurfaceEvaluator(model, batches, directions, loss_fn)
    if workers > 1 and evaluator.params[0].device.type != "cpu":
        raise ConfigError("--workers > 1 runs on the CPU only; use one worker on an accelerator")
    state = GridFile.open(grid_file, xs, fingerprint or {}, force=force)
    pending = state.pending()
    total = int(state.done.size)
    start = time.perf_counter()
    computed, since_save = 0, 0
    seconds_before = state.seconds

    def record(index, loss, acc):
        nonlocal computed, since_save
        state.record(index, loss, acc)
        computed += 1
        since_save += 1
        state.seconds = seconds_before + time.perf_counter() - start
        if since_save >= save_every:
            state.save()
            since_save = 0
        if progress is not None:
            progress(int(state.done.sum()), total)

    if grid_file is not None and not Path(grid_file).exists():
        state.save()
    try:
        if pending and workers == 1:
            try:
                for index in pending:
                    x, y = state.point(index)
                    record(index, *evaluator.evaluate(x, y))
            finally:
                evaluator.restore()
        elif pending:
            threads = max(1, torch.get_num_threads() // workers)
            ctx = multiprocessing.get_context(_start_method(start_method))
            chunk = max(1, min(save_every, math.ceil(len(pending) / (workers * 4))))
            chunks = [[(i, *state.point(i)) for i in pending[a:a + chunk]]
                      for a in np.arange(0, len(pending), chunk).tolist()]
            with ctx.Pool(workers, initializer=_init_worker,
                          initargs=(model, evaluator.batches, evaluator.directions, loss_fn, threads)) as pool:
                for results in pool.imap_unordered(_evaluate_chunk, chunks):
                    for index, loss, acc in results:
                        record(index, loss, acc)
    except KeyboardInterrupt:
        state.save()  # keep what was finished; a rerun resumes from here
        raise
    state.seconds = seconds_before + time.perf_counter() - start
    if since_save or not pending:
        state.save()
    return SurfaceResult(state.xs, state.ys, state.loss, state.accuracy, state.done, computed,
                         time.perf_counter() - start, state.seconds, workers)


# ---------------------------------------------------------------------------------------------- figures
def _render(draw, fmt: str, size=(5.2, 4.2), projection=None) -> bytes:
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=150)
    ax = fig.add_subplot(1, 1, 1, projection=projection)
    draw(fig, ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    return buf.getvalue()


def _levels(loss: np.ndarray, count: int = 25) -> np.ndarray:
    low, high = float(np.nanmin(loss)), float(np.nanmax(loss))
    if not high > low:
        return np.array([low - 1e-12, high + 1e-12])
    if low > 0 and high / low > 20:  # losses spanning decades: geometric levels show the basin
        return np.geomspace(low, high, count)
    return np.linspace(low, high, count)


def render_figures(result: SurfaceResult, title: str, labels=("direction 1", "direction 2")) -> dict[str, bytes]:
    """Contour (as MAN Fig. 1) and 3-D surface (as FedAlign Fig. 1) figures, PNG and PDF, as bytes."""
    X, Y = np.meshgrid(result.xs, result.ys)
    Z = result.loss

    def contour(fig, ax):
        filled = ax.contourf(X, Y, Z, levels=_levels(Z), cmap="viridis")
        lines = ax.contour(X, Y, Z, levels=_levels(Z), colors="k", linewidths=0.4)
        ax.clabel(lines, lines.levels[::4], inline=True, fontsize=6, fmt="%.3g")
        fig.colorbar(filled, ax=ax, label="loss")
        ax.plot([0], [0], marker="*", color="w", markeredgecolor="k", markersize=9)
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        ax.set_aspect("equal")
        ax.set_title(title, fontsize=8)

    def surface(fig, ax):
        from matplotlib.ticker import MaxNLocator

        ax.plot_surface(X, Y, Z, rstride=1, cstride=1, cmap="viridis", edgecolor="none")
        ax.xaxis.set_major_locator(MaxNLocator(5))
        ax.yaxis.set_major_locator(MaxNLocator(5))
        ax.set_xlabel(labels[0])
        ax.set_ylabel(labels[1])
        ax.set_zlabel("loss")
        ax.view_init(elev=25.0, azim=-60.0)
        ax.set_title(title, fontsize=8)

    files = {}
    for fmt in ("png", "pdf"):
        files[f"surface_contour.{fmt}"] = _render(contour, fmt)
        files[f"surface_3d.{fmt}"] = _render(surface, fmt, size=(5.6, 4.6), projection="3d")
    return files


def surface_csv(result: SurfaceResult) -> str:
    lines = ["x,y,loss,accuracy"]
    for iy, y in enumerate(result.ys):
        for ix, x in enumerate(result.xs):
            lines.append(f"{float(x)!r},{float(y)!r},{float(result.loss[iy, ix])!r},"
                         f"{float(result.accuracy[iy, ix])!r}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- the command
def _weights_digest(model: nn.Module) -> str:
    h = hashlib.sha1()
    for p in direction_params(model):
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _file_digest(path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _validate(directions, grid, radius, samples, workers, batch_size, split, eigenvectors) -> None:
    if directions not in DIRECTION_KINDS:
        raise ConfigError(f"unknown direction kind {directions!r}; choose one of {', '.join(DIRECTION_KINDS)}")
    _check_grid(grid, radius)
    if samples is not None and (not isinstance(samples, int) or samples <= 0):
        raise ConfigError(f"--samples must be a positive integer, got {samples!r}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"--workers must be a positive integer, got {workers!r}")
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ConfigError(f"--batch-size must be a positive integer, got {batch_size!r}")
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if eigenvectors is not None and directions != "hessian":
        raise ConfigError("--eigenvectors needs --directions hessian")


def _load_saved_directions(path: Path, fingerprint: dict, model: nn.Module):
    """Directions saved by an earlier run with the same settings (so a resumed Hessian surface skips Lanczos)."""
    if not path.is_file():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return None
    if not isinstance(payload, dict) or payload.get("format") != DIRECTIONS_FORMAT or \
            payload.get("fingerprint") != json.dumps(_jsonable(fingerprint), sort_keys=True):
        return None
    params = direction_params(model)
    pair = tuple(unflatten_direction(v, params) for v in payload["vectors"])
    return pair, json.loads(payload["info"])


@locks_output
def run_surface(
    checkpoint,
    out,
    *,
    directions: str = "random",
    grid: int = 21,
    range: float = 1.0,  # noqa: A002
    samples: int | None = None,
    workers: int = 1,
    batch_size: int = 256,
    split: str = "train",
    seed: int = 0,
    include_bn_bias: bool = False,
    eigenvectors=None,
    tol: float = 1e-3,
    device: str = "cpu",
    data_dir=None,
    force: bool = False,
    save_every: int = 8,
    quiet: bool = False,
    model_factory: str | None = None,
) -> dict:
    """What ``flatfl surface`` does: checkpoint in; ``surface.npz`` (the resumable grid), ``surface.csv``,
    ``surface.json``, ``directions.pt`` and contour / 3-D figures (PNG, PDF) out. Bad input writes nothing."""
    radius = range
    _validate(directions, grid, radius, samples, workers, batch_size, split, eigenvectors)
    from ..utils.values import check_seed

    check_seed(seed)
    if isinstance(tol, bool) or not (isinstance(tol, (int, float)) and 0 < tol < 1):
        raise ConfigError(f"--tol must be in (0, 1) (a relative tolerance), got {tol!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")

    dev = resolve_device(device)
    if workers > 1 and dev.type != "cpu":
        raise ConfigError("--workers > 1 runs on the CPU only; use one worker on an accelerator")
    if eigenvectors is not None and not Path(eigenvectors).is_file():
        raise CheckpointError(f"eigenvector file not found: {eigenvectors}")

    from ..utils.manifest import refuse_foreign

    refuse_foreign(out, [f"surface_{kind}.{fmt}" for kind in ("contour", "3d") for fmt in ("png", "pdf")]
                   + ["surface.csv", "surface.npz", "directions.pt", "surface.json"])
    from ..checkpoint import load_checkpoint

    ckpt = load_checkpoint(checkpoint, device=dev, data_dir=data_dir, model_factory=model_factory)
    model = ckpt.model
    batches = ckpt.eval_batches(split=split, samples=samples, batch_size=batch_size, seed=seed)
    fingerprint = {
        "checkpoint": str(ckpt.path.resolve()), "round": ckpt.round, "weights_sha1": _weights_digest(model),
        "directions": directions, "eigenvectors_sha1": _file_digest(eigenvectors) if eigenvectors else None,
        "include_bn_bias": include_bn_bias if directions == "random" else None,
        "grid": int(grid), "range": float(radius), "split": split, "samples": samples, "seed": seed,
        "tol": tol if directions == "hessian" and eigenvectors is None else None, "loss": "cross_entropy",
    }
    grid_path = out / "surface.npz"
    if grid_path.exists() and not force:
        GridFile.open(grid_path, grid_coordinates(grid, radius), fingerprint)  # refuses other settings early

    saved = None if force else _load_saved_directions(out / "directions.pt", fingerprint, model)
    if saved is not None:
        pair, info = saved
    elif directions == "random":
        pair = random_directions(model, seed=seed, include_bn_bias=include_bn_bias)
        info = {"kind": "random", "normalisation": "filter", "include_bn_bias": include_bn_bias, "seed": seed}
    elif eigenvectors is not None:
        pair, values = directions_from_eigenvector_file(eigenvectors, model)
        info = {"kind": "hessian", "source": str(eigenvectors), "eigenvalues": values}
    else:
        pair, values, eig_info = hessian_directions(model, batches, seed=seed, tol=tol)
        info = {"kind": "hessian", "source": "lanczos on the evaluation set", **eig_info}

    out.mkdir(parents=True, exist_ok=True)
    if saved is None:
        atomic_torch_save({"format": DIRECTIONS_FORMAT, "fingerprint": json.dumps(_jsonable(fingerprint), sort_keys=True),
                           "vectors": [flatten_direction(d).detach().cpu() for d in pair],
                           "param_names": [n for n, p in model.named_parameters() if p.requires_grad],
                           "info": json.dumps(_jsonable(info))}, out / "directions.pt")

    from tqdm.auto import tqdm

    bar = tqdm(total=grid * grid, desc="surface points", unit="pt", disable=quiet or not sys.stderr.isatty(),
               leave=False)

    def progress(done, total):
        bar.n = done
        bar.refresh()

    try:
        result = loss_surface(model, batches, pair, grid, radius, workers=workers, grid_file=grid_path,
                              fingerprint=fingerprint, force=force, save_every=save_every, progress=progress)
    finally:
        bar.close()

    labels = (r"$\epsilon_0$ (top eigenvector)", r"$\epsilon_1$ (2nd eigenvector)") if directions == "hessian" \
        else ("direction 1 (filter-normalised)", "direction 2 (filter-normalised)")
    title = f"{ckpt.model_spec.get('name')}, round {ckpt.round}: {directions} directions"
    figures = render_figures(result, title, labels)
    centre = len(result.xs) // 2 if len(result.xs) % 2 else None
    from ..version import __version__

    summary = {
        "checkpoint": str(ckpt.path), "round": ckpt.round, "model": ckpt.model_spec.get("name"),
        "dataset": ckpt.dataset_name, "num_params": ckpt.num_params, "num_samples": sum(len(y) for _, y in batches),
        "directions": info, "grid": int(grid), "range": float(radius),
        "loss_at_origin": float(result.loss[centre, centre]) if centre is not None else None,
        "accuracy_at_origin": float(result.accuracy[centre, centre]) if centre is not None else None,
        "loss_min": float(np.nanmin(result.loss)), "loss_max": float(np.nanmax(result.loss)),
        "points": int(result.done.size), "points_computed_now": result.computed, "workers": workers,
        "seconds": result.total_seconds, "settings": {**fingerprint, "batch_size": batch_size, "workers": workers,
                                                      "device": str(dev)},
        "flatfl_version": __version__, "torch_version": torch.__version__,
    }
    names = sorted(figures) + ["surface.csv", "surface.npz", "directions.pt", "surface.json"]
    summary["files"] = names
    files = {out / name: payload for name, payload in sorted(figures.items())}
    files[out / "surface.csv"] = surface_csv(result)
    files[out / "surface.json"] = json.dumps(json_safe(summary), indent=2, default=str) + "\n"
    atomic_write_many(files)  # all or nothing
    return summary
