"""What ``flatfl surface`` does: checkpoint in; ``surface.npz`` (the resumable grid), ``surface.csv``,
``surface.json``, ``directions.pt`` and contour / 3-D figures (PNG, PDF) out (:mod:`flatfl.analysis.command`'s
skeleton; settings: :class:`~flatfl.utils.surface_settings.SurfaceSettings`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ConfigError
from ..utils import distributed
from ..utils.lock import locks_output
from ..utils.surface_settings import SurfaceSettings
from .command import AnalysisCommand, progress_bar, versions, weights_digest
from .distributed import spread
from .directions import directions_from_eigenvector_file, hessian_directions, random_directions
from .figures import surface_figures
from .surface import grid_coordinates, loss_surface
from .surface_files import GridFile, file_sha1, load_saved_directions, save_directions, surface_csv, weights_sha1

__all__ = ["run_surface", "OUTPUT_NAMES"]

DEFAULTS = SurfaceSettings()  # every default below is one of its fields
FIGURE_NAMES = tuple(f"surface_{kind}.{fmt}" for kind in ("contour", "3d") for fmt in ("png", "pdf"))
OUTPUT_NAMES = FIGURE_NAMES + ("surface.csv", "surface.npz", "directions.pt", "surface.json")


@locks_output
def run_surface(
    checkpoint,
    out,
    *,
    directions: str = DEFAULTS.directions,
    grid: int = DEFAULTS.grid,
    range: float = DEFAULTS.range,  # noqa: A002
    samples: int | None = DEFAULTS.samples,
    workers: int = DEFAULTS.workers,
    batch_size: int = DEFAULTS.batch_size,
    split: str = DEFAULTS.split,
    seed: int = DEFAULTS.seed,
    include_bn_bias: bool = DEFAULTS.include_bn_bias,
    eigenvectors=DEFAULTS.eigenvectors,
    tol: float = DEFAULTS.tol,
    device: str = DEFAULTS.device,
    data_dir=DEFAULTS.data_dir,
    force: bool = DEFAULTS.force,
    save_every: int = DEFAULTS.save_every,
    quiet: bool = False,
    model_factory: str | None = DEFAULTS.model_factory,
    precision: str | None = DEFAULTS.precision,
) -> dict:
    """What ``flatfl surface`` does: checkpoint in; ``surface.npz`` (the resumable grid), ``surface.csv``,
    ``surface.json``, ``directions.pt`` and contour / 3-D figures (PNG, PDF) out. Bad input writes nothing."""
    radius = range
    SurfaceSettings(directions=directions, grid=grid, range=radius, samples=samples, workers=workers,
                    batch_size=batch_size, split=split, seed=seed, include_bn_bias=include_bn_bias,
                    eigenvectors=eigenvectors, tol=tol, device=device, data_dir=data_dir, force=force,
                    save_every=save_every, model_factory=model_factory, precision=precision).validate()

    def device_check(dev) -> None:
        if workers > 1 and dev.type != "cpu":
            raise ConfigError("--workers > 1 runs on the CPU only; use one worker on an accelerator")
        if eigenvectors is not None and not Path(eigenvectors).exists():
            raise CheckpointError(f"eigenvector file not found: {eigenvectors}")
        if eigenvectors is not None and not Path(eigenvectors).is_file():  # a device or pipe: read for ever
            raise CheckpointError(f"{eigenvectors} is not a regular file (a directory, pipe, device or socket), "
                                  "not an eigenvector file")

    cmd = AnalysisCommand.open(checkpoint, out, device=device, outputs=OUTPUT_NAMES, data_dir=data_dir,
                               model_factory=model_factory, device_check=device_check, precision=precision)
    out, ckpt = cmd.out, cmd.checkpoint
    model = ckpt.model
    digest = weights_digest(model)  # before the grid moves the weights
    batches = ckpt.eval_batches(split=split, samples=samples, batch_size=batch_size, seed=seed)
    fingerprint = {
        "checkpoint": str(ckpt.path.resolve()), "round": ckpt.round, "weights_sha1": weights_sha1(model),
        "directions": directions, "eigenvectors_sha1": file_sha1(eigenvectors) if eigenvectors else None,
        "include_bn_bias": include_bn_bias if directions == "random" else None,
        "grid": int(grid), "range": float(radius), "split": split, "samples": samples, "seed": seed,
        "tol": tol if directions == "hessian" and eigenvectors is None else None, "loss": "cross_entropy",
        # a float64 grid is another grid (a float32 one, of every earlier version, keeps its fingerprint)
        **({"precision": ckpt.precision} if ckpt.precision != "float32" else {}),
    }
    grid_path = out / "surface.npz"
    if grid_path.exists() and not force:
        GridFile.open(grid_path, grid_coordinates(grid, radius), fingerprint)  # refuses other settings early

    saved = None if force else load_saved_directions(out / "directions.pt", fingerprint, model)
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
    if saved is None and distributed.is_main():
        save_directions(out / "directions.pt", pair, fingerprint, info, model)

    with progress_bar(quiet, total=grid * grid, desc="surface points", unit="pt") as bar:
        def progress(done, total):
            bar.n = done
            bar.refresh()

        result = loss_surface(model, batches, pair, grid, radius, workers=workers, grid_file=grid_path,
                              fingerprint=fingerprint, force=force, save_every=save_every, progress=progress,
                              spread=spread())

    labels = (r"$\epsilon_0$ (top eigenvector)", r"$\epsilon_1$ (2nd eigenvector)") if directions == "hessian" \
        else ("direction 1 (filter-normalised)", "direction 2 (filter-normalised)")
    # every rank holds the whole grid; rank 0 alone draws and writes
    figures = surface_figures(result, f"{cmd.title}, {directions} directions", labels,
                              samples=sum(len(y) for _, y in batches), split=split) if distributed.is_main() else {}
    centre = len(result.xs) // 2 if len(result.xs) % 2 else None
    summary = {
        **cmd.header(digest=digest), "num_samples": sum(len(y) for _, y in batches),
        "directions": info, "grid": int(grid), "range": float(radius),
        "loss_at_origin": float(result.loss[centre, centre]) if centre is not None else None,
        "accuracy_at_origin": float(result.accuracy[centre, centre]) if centre is not None else None,
        "loss_min": float(np.nanmin(result.loss)), "loss_max": float(np.nanmax(result.loss)),
        "points": int(result.done.size), "points_computed_now": result.computed, "workers": workers,
        "seconds": result.total_seconds, "settings": {**fingerprint, "batch_size": batch_size, "workers": workers,
                                                      "device": str(cmd.device)},
        "distributed": distributed.record(),
        **versions(),
        "files": sorted(FIGURE_NAMES) + ["surface.csv", "surface.npz", "directions.pt", "surface.json"],
    }
    if distributed.is_main():
        cmd.write({**dict(sorted(figures.items())), "surface.csv": surface_csv(result)}, "surface.json", summary)
    return summary
