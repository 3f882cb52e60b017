"""2-D loss surfaces around a model (docs/analysis-protocols.md §6; Li et al. 2018; MAN Fig. 1; FedAlign Fig. 1).

The loss and accuracy of ``theta + x d1 + y d2`` at every point of the square grid ``x, y in linspace(-R, R, N)``,
over a fixed evaluation set, the model in eval mode (BatchNorm running statistics, no dropout), no augmentation.
Directions come from :mod:`flatfl.analysis.estimators.directions` (filter-normalised random, or the top-2 Hessian
eigenvectors).

How a point is evaluated (:class:`SurfaceEvaluator`): the model's own parameters are overwritten in place with
foreach ops (``theta`` copied in, then ``x d1`` and ``y d2`` added), and the evaluation set, kept on the device as
tensors, is run under ``torch.inference_mode``. Nothing is rebuilt or reloaded per point (loss-landscape builds and
loads a perturbed state dict for every point); the original weights are restored at the end.

Grid file (resume): :class:`~flatfl.analysis.estimators.surface_files.GridFile` is an ``.npz`` with the coordinates, the loss
and accuracy grids, a done-mask and a fingerprint of the settings. It is rewritten atomically every ``save_every``
points, so a killed run loses at most that many points; running again with the same settings evaluates only the
points not done.

Workers: with ``workers > 1`` the pending points are split into chunks and spread over a local process pool
(:func:`flatfl.utils.processes.worker_pool`, the executor's pool; ``fork`` where the platform has it, else
``spawn``, which needs a picklable model and loss function); each worker
holds its own copy of the model and runs torch on ``max(1, threads // workers)`` threads. Small convolutional
networks scale poorly over intra-op threads on a few cores, so separate processes use the cores better than one
process with more threads (docs/performance.md).

Python API: :func:`loss_surface` on any model; :func:`flatfl.analysis.commands.surface_command.run_surface` is what
``flatfl surface`` does for a checkpoint (its files: :mod:`flatfl.analysis.estimators.surface_files`; its figures:
:func:`flatfl.analysis.commands.result_figures.surface_figures`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from .surface_checks import DIRECTION_KINDS, check_grid, check_save_every, check_workers
from .directions import direction_params
from ..operators.batches import as_batches
from ...utils.ranks import World
from .surface_files import GridFile

__all__ = ["SurfaceEvaluator", "SurfaceResult", "loss_surface", "grid_coordinates", "DIRECTION_KINDS"]


# ---------------------------------------------------------------------------------------------- evaluation
class SurfaceEvaluator:
    """Loss and accuracy of ``model`` at ``theta + x d1 + y d2``, perturbing its parameters in place.

    ``batches``: one ``(inputs, targets)`` batch, a list of them or a DataLoader (:func:`~.batches.as_batches`); ``loss_fn(outputs, targets)`` is the mean loss of a batch (default
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
        self.batches = as_batches(batches, device)  # one (x, y) batch, a list of them or a DataLoader
        sizes = [len(t) for _, t in self.batches]
        self.num_samples = int(sum(sizes))
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


def grid_coordinates(grid: int, radius: float) -> np.ndarray:
    """``linspace(-radius, radius, grid)``, the coordinates along each axis."""
    check_grid(grid, radius)
    return np.linspace(-float(radius), float(radius), int(grid))


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


def init_worker(model, batches, directions, loss_fn, threads) -> None:
    """In a worker process: its own evaluator on ``threads`` torch threads."""
    global _WORKER
    torch.set_num_threads(int(threads))
    _WORKER = SurfaceEvaluator(model, batches, directions, loss_fn)


def evaluate_chunk(points):
    """In a worker process: (index, loss, accuracy) of every (index, x, y) point."""
    out = []
    for index, x, y in points:
        loss, acc = _WORKER.evaluate(x, y)
        out.append((index, loss, acc))
    return out


def _evaluate_spread(evaluator: SurfaceEvaluator, state, pending: list, spread: World, save_every: int,
                     record: Callable) -> None:
    """The pending points over the ranks: this rank's share (every ``size``-th), ``save_every`` at a time, then
    every rank's values recorded in the grid's order on every rank."""
    mine = spread.dealt(pending)
    steps = math.ceil(math.ceil(len(pending) / spread.size) / save_every)  # the same count on every rank
    try:
        for step in range(steps):
            part = [(i, *evaluator.evaluate(*state.point(i))) for i in mine[step * save_every:(step + 1) * save_every]]
            for got in spread.gather(part):
                for index, loss, acc in got:
                    record(index, loss, acc)
    finally:
        evaluator.restore()


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
    spread: World | None = None,
) -> SurfaceResult:
    """Loss and accuracy on the ``grid x grid`` square ``linspace(-range, range, grid)^2`` around ``model``.

    ``directions``: two lists of tensors shaped like the model's parameters (see :mod:`.directions`).
    ``grid_file``: an ``.npz`` path to resume from and save to every ``save_every`` points (atomically);
    ``fingerprint``: the settings stored in it (a file with other settings is refused unless ``force``).
    ``workers``: local processes (CPU models). ``progress(done, total)`` is called after each recorded point.
    ``spread``: the ranks the points are dealt to (a :class:`~flatfl.utils.ranks.World`; None: a world of one): each
    rank evaluates every ``size``-th pending point (:meth:`~flatfl.utils.ranks.World.dealt`), the ranks exchange their values every ``save_every`` points each, every rank
    ends with the whole grid and rank 0 alone saves ``grid_file``. The model's parameters are restored before
    returning.
    """
    radius = range
    check_grid(grid, radius)
    check_workers(workers)
    check_save_every(save_every)
    xs = grid_coordinates(grid, radius)
    evaluator = SurfaceEvaluator(model, batches, directions, loss_fn)
    if workers > 1 and evaluator.params[0].device.type != "cpu":
        raise ConfigError("--workers > 1 runs on the CPU only; use one worker on an accelerator")
    spread = spread if spread is not None else World()
    if workers > 1 and spread.distributed:
        raise ConfigError(f"--workers {workers} under torchrun: the {spread.size} ranks already share the points; "
                          "give each rank one worker (--workers 1) and start more ranks instead")
    writes = spread.main  # the grid file is rank 0's
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
            if writes:
                state.save()
            since_save = 0
        if progress is not None:
            progress(int(state.done.sum()), total)

    if grid_file is not None and not Path(grid_file).exists() and writes:
        state.save()
    try:
        if pending and spread.distributed:
            _evaluate_spread(evaluator, state, pending, spread, save_every, record)
        elif pending and workers == 1:
            try:
                for index in pending:
                    x, y = state.point(index)
                    record(index, *evaluator.evaluate(x, y))
            finally:
                evaluator.restore()
        elif pending:
            from concurrent.futures import as_completed

            from ...utils.processes import start_method as choose_method, worker_pool

            threads = max(1, torch.get_num_threads() // workers)
            method = choose_method(start_method, default="fork")
            chunk = max(1, min(save_every, math.ceil(len(pending) / (workers * 4))))
            chunks = [[(i, *state.point(i)) for i in pending[a:a + chunk]]
                      for a in np.arange(0, len(pending), chunk).tolist()]
            with worker_pool(workers, method, initializer=init_worker,
                             initargs=(model, evaluator.batches, evaluator.directions, loss_fn, threads)) as pool:
                for done in as_completed([pool.submit(evaluate_chunk, c) for c in chunks]):
                    for index, loss, acc in done.result():
                        record(index, loss, acc)
    except KeyboardInterrupt:
        if writes:
            state.save()  # keep what was finished; a rerun resumes from here
        raise
    state.seconds = seconds_before + time.perf_counter() - start
    if (since_save or not pending) and writes:
        state.save()
    return SurfaceResult(state.xs, state.ys, state.loss, state.accuracy, state.done, computed,
                         time.perf_counter() - start, state.seconds, workers)


