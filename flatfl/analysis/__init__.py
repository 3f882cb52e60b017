"""Curvature analysis of trained models: Hessian spectra, traces, spectral densities (spec/analysis.md).

Python API (the ``flatfl hessian`` command is a thin layer over it)::

    import flatfl
    from flatfl.analysis import HessianOperator, top_eigenvalues, hutchpp_trace, spectral_density, smoothed_density

    ckpt = flatfl.load_checkpoint("RUN/final.pt")
    op = HessianOperator(ckpt.model, ckpt.eval_batches(split="train", samples=512))  # any nn.Module + batches
    eig = top_eigenvalues(op, k=20, tol=1e-3, seed=0, return_vectors=True)   # descending, with residuals
    eig.eigenvalues, eig.residuals, eig.hvps, eig.eigenvectors               # vectors: (20, dim), unit rows
    tr = hutchpp_trace(op, max_hvps=100, seed=0)                             # tr.estimate, tr.stderr, tr.hvps
    esd = spectral_density(op, steps=100, starts=1, seed=0)                  # esd.nodes, esd.weights
    grid, density = smoothed_density(esd.nodes, esd.weights)

* :class:`HessianOperator` ``(model, batches, loss_fn=cross_entropy, params=None, mode="eval",
  cache_graph="auto", products="auto", block_size=None)``: Hessian of the sample-weighted mean loss over a fixed evaluation set; ``matvec(v)``,
  ``matmat(V)`` on flat vectors, ``dim``, ``device``, ``dtype``, ``hvps`` (products so far), ``unflatten(v)``
  (parameter-shaped views by name), ``gradient()``, ``loss()``. :class:`MatrixOperator` wraps an explicit matrix.
  Every estimator below accepts any object with ``matvec``, ``dim``, ``device``, ``dtype``.
* :func:`top_eigenvalues` ``(op, k, *, tol=1e-3, seed=0, return_vectors=False, basis_size=None, block_size=None,
  max_hvps=None, exact_residuals=False) -> EigenResult``: thick-restart block Lanczos, largest algebraic.
* :func:`power_iteration` ``(op, top_n=1, *, max_iter=100, tol=1e-3, seed=0, ...) -> EigenResult``: PyHessian's
  rule, exactly.
* :func:`hutchinson_trace`, :func:`hutchpp_trace`, :func:`pyhessian_trace`, :func:`estimate_trace`
  ``-> TraceResult(estimate, stderr, hvps, method, samples)``; :func:`hutchinson_diagonal` ``(op, *, samples=100,
  seed=0) -> (diagonal, stderr)``.
* :func:`spectral_density` ``(op, *, steps=100, starts=1, seed=0) -> DensityResult(nodes, weights, hvps)`` and
  :func:`smoothed_density` ``(nodes, weights) -> (grid, density)``.
* :func:`flatfl.analysis.hessian_run.run_hessian`: what ``flatfl hessian`` does (checkpoint in, hessian.json,
  eigenvalues.csv and figures out); :func:`flatfl.analysis.hessian_run.load_eigenvectors` reads saved vectors.
"""
from __future__ import annotations

from .density import DensityResult, smoothed_density, spectral_density
from .eigen import EigenResult, power_iteration, top_eigenvalues
from .operator import HessianOperator, MatrixOperator
from .trace import (
    TraceResult,
    estimate_trace,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    pyhessian_trace,
)

__all__ = [
    "HessianOperator",
    "MatrixOperator",
    "EigenResult",
    "top_eigenvalues",
    "power_iteration",
    "TraceResult",
    "hutchinson_trace",
    "hutchpp_trace",
    "pyhessian_trace",
    "estimate_trace",
    "hutchinson_diagonal",
    "DensityResult",
    "spectral_density",
    "smoothed_density",
]
