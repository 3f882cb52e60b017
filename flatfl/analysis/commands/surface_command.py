"""What ``flatfl surface`` does: checkpoint in; ``surface.npz`` (the resumable grid), ``surface.csv``,
``surface.json``, ``directions.pt`` and contour / 3-D figures (PNG, PDF) out (:mod:`flatfl.analysis.commands.skeleton`'s
skeleton; settings: :class:`~flatfl.analysis.commands.surface_settings.SurfaceSettings`)."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ...errors import CheckpointError, ConfigError
from ...utils import ranks
from ...utils.lock import locks_output
from .surface_settings import SurfaceSettings
from .skeleton import AnalysisCommand, progress_bar, versions, weights_digest
from ..estimators.directions import directions_from_eigenvector_file, hessian_directions, random_directions
from .result_figures import surface_figures
from ..estimators.surface import grid_coordinates, loss_surface
from ..estimators.surface_files import GridFile, file_sha1, load_saved_directions, save_directions, surface_csv, weights_sha1

__all__ = ["run_surface", "OUTPUT_NAMES"]

FIGURE_NAMES = tuple(f"surface_{kind}.{fmt}" for kind in ("contour", "3d") for fmt in ("png", "pdf"))
OUTPUT_NAMES = FIGURE_NAMES + ("surface.csv", "surface.npz", "directions.pt", "surface.json")


@locks_output
def run_surface(checkpoint, out, settings: SurfaceSettings = SurfaceSettings(), *, quiet: bool = False) -> dict:
    """What ``flatfl surface`` does: checkpoint in; ``surface.npz`` (the resumable grid), ``surface.csv``,
    ``surface.json``, ``directions.pt`` and contour / 3-D figures (PNG, PDF) out, as ``settings`` ask
    (:class:`~flatfl.analysis.commands.surface_settings.SurfaceSettings`). Bad input writes nothing."""
    s = settings.validate()

    def device_check(dev) -> None:
        if s.workers > 1 and dev.type != "cpu":
            raise ConfigError("--workers > 1 runs on the CPU only; use one worker on an accelerator")
        if s.eigenvectors is not None and not Path(s.eigenvectors).exists():
            raise CheckpointError(f"eigenvector file not found: {s.eigenvectors}")
        if s.eigenvectors is not None and not Path(s.eigenvectors).is_file():  # a device or pipe: read for ever
            raise CheckpointError(f"{s.eigenvectors} is not a regular file (a directory, pipe, device or socket), "
                                  "not an eigenvector file")

    cmd = AnalysisCommand.open(checkpoint, out, device=s.device, outputs=OUTPUT_NAMES, data_dir=s.data_dir,
                               model_factory=s.model_factory, device_check=device_check, precision=s.precision)
    out, ckpt = cmd.out, cmd.checkpoint
    model = ckpt.model
    digest = weights_digest(model)  # before the grid moves the weights
    batches = ckpt.eval_batches(split=s.split, samples=s.samples, batch_size=s.batch_size, seed=s.seed)
    # over several ranks: every rank evaluates the same data at the same weights (nothing computed in one process)
    ranks.agree(lambda: {"evaluation data": ranks.digest(batches),
                         "weights": ranks.fingerprint(None, list(model.state_dict().values()))})
    fingerprint = {
        "checkpoint": str(ckpt.path.resolve()), "round": ckpt.round, "weights_sha1": weights_sha1(model),
        "directions": s.directions, "eigenvectors_sha1": file_sha1(s.eigenvectors) if s.eigenvectors else None,
        "include_bn_bias": s.include_bn_bias if s.directions == "random" else None,
        "grid": int(s.grid), "range": float(s.range), "split": s.split, "samples": s.samples, "seed": s.seed,
        "tol": s.tol if s.directions == "hessian" and s.eigenvectors is None else None, "loss": "cross_entropy",
        # a float64 grid is another grid (a float32 one, of every earlier version, keeps its fingerprint)
        **({"precision": ckpt.precision} if ckpt.precision != "float32" else {}),
    }
    grid_path = out / "surface.npz"
    if grid_path.exists() and not s.force:
        GridFile.open(grid_path, grid_coordinates(s.grid, s.range), fingerprint)  # refuses other settings early

    saved = None if s.force else load_saved_directions(out / "directions.pt", fingerprint, model)
    if saved is not None:
        pair, info = saved
    elif s.directions == "random":
        pair = random_directions(model, seed=s.seed, include_bn_bias=s.include_bn_bias)
        info = {"kind": "random", "normalisation": "filter", "include_bn_bias": s.include_bn_bias, "seed": s.seed}
    elif s.eigenvectors is not None:
        pair, values = directions_from_eigenvector_file(s.eigenvectors, model)
        info = {"kind": "hessian", "source": str(s.eigenvectors), "eigenvalues": values}
    else:
        pair, values, eig_info = hessian_directions(model, batches, seed=s.seed, tol=s.tol)
        info = {"kind": "hessian", "source": "lanczos on the evaluation set", **eig_info}

    out.mkdir(parents=True, exist_ok=True)
    if saved is None:
        cmd.run_writer(save_directions, out / "directions.pt", pair, fingerprint, info, model)

    with progress_bar(quiet, total=s.grid * s.grid, desc="surface points", unit="pt") as bar:
        def progress(done, total):
            bar.n = done
            bar.refresh()

        result = loss_surface(model, batches, pair, s.grid, s.range, workers=s.workers, grid_file=grid_path,
                              fingerprint=fingerprint, force=s.force, save_every=s.save_every, progress=progress,
                              spread=cmd.world)

    labels = (r"$\epsilon_0$ (top eigenvector)", r"$\epsilon_1$ (2nd eigenvector)") if s.directions == "hessian" \
        else ("direction 1 (filter-normalised)", "direction 2 (filter-normalised)")
    # every rank holds the whole grid; the writing rank alone draws and writes
    figures = surface_figures(result, f"{cmd.title}, {s.directions} directions", labels,
                              samples=sum(len(y) for _, y in batches), split=s.split) if cmd.writes else {}
    centre = len(result.xs) // 2 if len(result.xs) % 2 else None
    summary = {
        **cmd.header(digest=digest), "num_samples": sum(len(y) for _, y in batches),
        "directions": info, "grid": int(s.grid), "range": float(s.range),
        "loss_at_origin": float(result.loss[centre, centre]) if centre is not None else None,
        "accuracy_at_origin": float(result.accuracy[centre, centre]) if centre is not None else None,
        "loss_min": float(np.nanmin(result.loss)), "loss_max": float(np.nanmax(result.loss)),
        "points": int(result.done.size), "points_computed_now": result.computed, "workers": s.workers,
        "seconds": result.total_seconds,
        "settings": {**fingerprint, "batch_size": s.batch_size, "workers": s.workers, "device": str(cmd.device)},
        "distributed": ranks.record(),
        **versions(),
        "files": sorted(FIGURE_NAMES) + ["surface.csv", "surface.npz", "directions.pt", "surface.json"],
    }
    cmd.write({**dict(sorted(figures.items())), "surface.csv": functools.partial(surface_csv, result)},
              "surface.json", summary)
    return summary
