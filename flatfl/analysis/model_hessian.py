"""The Hessian of your own model in a few lines, the way PyHessian is called.

::

    from flatfl.analysis import hessian

    h = hessian(model, criterion, data=(x, y))      # or data=[(x1, y1), ...], or dataloader=loader
    eig = h.eigenvalues(top_n=5)                    # EigenResult: .eigenvalues (descending), .residuals, .hvps
    tr = h.trace()                                  # TraceResult: .estimate, .stderr, .hvps (Hutch++)
    esd = h.density()                               # DensityResult: .nodes, .weights (SLQ, one list per start)
    h.save_density("density.png")                   # the figure of `flatfl hessian --density` (.png, .pdf), or .csv

:func:`hessian` builds a :class:`ModelHessian` over a :class:`~flatfl.analysis.operator.HessianOperator` (the mean of
``criterion`` over the data, the model in eval mode as PyHessian has it) and runs the estimators ``flatfl hessian``
runs, with its defaults (:class:`flatfl.utils.hessian_settings.HessianSettings`) and its seed streams (``seed`` for
the eigenvalues, ``seed + 1`` for the trace, ``seed + 2`` for the density), so on the same batches it gives the
command's numbers. The model's device is used (move the model first, e.g. ``model.cuda()``; the data follows it).
Differences from PyHessian: ``eigenvalues`` returns the k largest *algebraic* eigenvalues by block Lanczos
(``method="power"``: PyHessian's power iteration, largest in magnitude) with their residuals; ``trace`` returns one
estimate with its standard error (Hutch++; ``method="pyhessian"`` for PyHessian's rule); ``density`` returns the
quadrature nodes and weights (PyHessian's ``density_eigen``, ``density_weight``), several starts averaged.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..utils.atomic import atomic_write_bytes_unrecorded
from ..utils.hessian_settings import DEFAULT_TRACE_METHOD, HessianSettings
from .density import DensityResult, spectral_density
from .eigen import EigenResult
from .estimators import estimate_eigenvalues, estimate_trace
from .operator import HessianOperator
from .trace import TraceResult

__all__ = ["hessian", "ModelHessian", "DENSITY_FORMATS"]

DEFAULTS = HessianSettings()
#: what :meth:`ModelHessian.save_density` writes, by the file's suffix
DENSITY_FORMATS = (".png", ".pdf", ".csv")


class ModelHessian:
    """The Hessian of ``criterion`` (the mean loss of a batch) over ``data`` at ``model``'s current weights.

    ``data``: one ``(inputs, targets)`` batch, a list of them or a DataLoader (read once); ``dataloader`` is the same
    thing under PyHessian's other name. ``mode``: ``"eval"`` (default) or ``"train"``. ``seed``: every random probe.
    The operator is :attr:`operator` (``matvec``, ``dim``, ``hvps``...), for the other estimators of
    :mod:`flatfl.analysis`.
    """

    def __init__(self, model, criterion: Callable | None = None, data=None, *, dataloader=None, mode: str = "eval",
                 seed: int = DEFAULTS.seed) -> None:
        if (data is None) == (dataloader is None):
            raise ConfigError("give the data once: data=(inputs, targets) (or a list of batches), or "
                              "dataloader=a DataLoader")
        reduction = getattr(criterion, "reduction", "mean")
        if reduction != "mean":
            raise ConfigError(f"the criterion must return the mean loss of a batch (reduction='mean'), got "
                              f"reduction={reduction!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        self.operator = HessianOperator(model, data if data is not None else dataloader, loss_fn=criterion, mode=mode)
        self.seed = seed
        self.last_eigenvalues: EigenResult | None = None
        self.last_density: DensityResult | None = None

    @property
    def num_samples(self) -> int:
        return self.operator.num_samples

    @property
    def num_params(self) -> int:
        return self.operator.dim

    def eigenvalues(self, top_n: int = 1, *, method: str = DEFAULTS.method, tol: float = DEFAULTS.tol,
                    return_vectors: bool = False, exact_residuals: bool = DEFAULTS.exact_residuals) -> EigenResult:
        """The ``top_n`` largest eigenvalues, descending (``.eigenvalues``), with residuals ``||Hv - λv||``;
        ``return_vectors=True`` adds ``.eigenvectors`` (``(top_n, dim)`` unit rows; ``operator.unflatten(v)``
        shapes one like the parameters)."""
        result = estimate_eigenvalues(self.operator, method, top_n, tol=tol, seed=self.seed,
                                      return_vectors=return_vectors, exact_residuals=exact_residuals)
        self.last_eigenvalues = result
        return result

    def trace(self, *, method: str = DEFAULT_TRACE_METHOD, max_hvps: int = DEFAULTS.trace_hvps,
              rtol: float | None = DEFAULTS.trace_rtol) -> TraceResult:
        """The trace with its standard error (``.estimate``, ``.stderr``) from at most ``max_hvps`` products,
        stopping once the standard error is below ``rtol`` of the estimate."""
        return estimate_trace(self.operator, method, max_hvps=max_hvps, rtol=rtol, seed=self.seed + 1)

    def density(self, *, steps: int = DEFAULTS.density_steps, starts: int = DEFAULTS.density_starts) -> DensityResult:
        """The spectral density by stochastic Lanczos quadrature: ``starts`` runs of ``steps`` Lanczos steps."""
        result = spectral_density(self.operator, steps=steps, starts=starts, seed=self.seed + 2)
        self.last_density = result
        return result

    def save_density(self, path, density: DensityResult | None = None, *, title: str | None = None) -> Path:
        """Write ``density`` (default: the last :meth:`density`, computed now if there is none) to ``path``:
        ``.png`` / ``.pdf``, the figure ``flatfl hessian --density`` draws (the last top eigenvalues marked);
        ``.csv``, that figure's curve (columns ``eigenvalue``, ``density``). Written atomically; returns the path."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in DENSITY_FORMATS:
            raise ConfigError(f"cannot write a density as {path.name!r}: name a {', '.join(DENSITY_FORMATS)} file")
        if density is None:
            density = self.last_density if self.last_density is not None else self.density()
        dens = density.as_dict()
        if suffix == ".csv":
            from ..utils.plots import density_curves

            grid, curves, _ = density_curves({"": [dens]})
            out = io.StringIO()
            out.write("eigenvalue,density\n")
            for x, d in zip(grid, curves[""]):
                out.write(f"{x:.9g},{d:.9g}\n")
            data = out.getvalue().encode()
        else:
            from .figures import density_figure

            marks = [] if self.last_eigenvalues is None else self.last_eigenvalues.eigenvalues.tolist()
            data = density_figure(dens, suffix[1:], marks=marks, samples=self.num_samples,
                                  model=title or f"{self.num_params:,} parameters")
        atomic_write_bytes_unrecorded(path, data)
        return path


def hessian(model, criterion: Callable | None = None, data=None, *, dataloader=None, mode: str = "eval",
            seed: int = DEFAULTS.seed) -> ModelHessian:
    """PyHessian's ``hessian(model, criterion, data=(x, y))`` (or ``dataloader=``), on flatfl's estimators: a
    :class:`ModelHessian` with ``eigenvalues(top_n)``, ``trace()``, ``density()`` and ``save_density(path)``.
    ``criterion`` defaults to cross-entropy."""
    return ModelHessian(model, criterion, data, dataloader=dataloader, mode=mode, seed=seed)
