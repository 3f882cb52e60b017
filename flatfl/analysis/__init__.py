"""Curvature analysis of trained models: Hessian spectra, traces, spectral densities (docs/analysis-protocols.md).

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

Your own model, PyHessian's calls with the import changed (:mod:`flatfl.analysis.model_hessian`)::

    from flatfl.analysis import hessian                       # was: from pyhessian import hessian
    h = hessian(model, criterion, data=(x, y), cuda=False)    # or dataloader=loader
    values, vectors = h.eigenvalues(top_n=5)                  # floats, descending; per-parameter tensors
    np.mean(h.trace()); h.last.stderr                         # Hutch++ per-probe estimates; its standard error
    nodes, weights = h.density(); h.save_density("density.png")
    h.top_eigenvalues(5).residuals; h.per_layer().blocks      # the rich results; each module's Hessian block
    hessian(model, data=batch, loss=fn)                       # any objective fn(model, batch), any batch structure

* :func:`hessian` ``(model, criterion=None, data=None, dataloader=None, cuda=None, *, loss=None, mode="eval",
  seed=0) -> ModelHessian``: PyHessian's ``eigenvalues(maxIter, tol, top_n)``, ``trace(maxIter, tol)``,
  ``density(iter, n_v)`` with PyHessian's return types; ``top_eigenvalues``, ``trace_estimate``,
  ``spectral_density``, ``per_layer``, ``save_density``, ``last``, ``operator``.
* :func:`per_layer_curvature` ``(op, top=1, *, grouping="module", tol, trace_hvps, trace_rtol, seed, dense_up_to)
  -> PerLayerResult``: each module's Hessian block, top eigenvalues and trace +- standard error
  (:mod:`flatfl.analysis.estimators.per_layer`). An operation without a second derivative is a :class:`SecondDerivativeError`
  naming it (:mod:`flatfl.analysis.operators.second_order`); ``loss(model, batch)`` objectives: :mod:`flatfl.analysis.operators.objective`.
* :class:`HessianOperator` ``(model, batches, loss_fn=cross_entropy, params=None, mode="eval",
  cache_graph="auto", products="auto", block_size=None, *, loss=None)``: Hessian of the sample-weighted mean loss over a fixed
  evaluation set (``batches``: one ``(x, y)`` batch, a list of them or a DataLoader: :func:`as_batches`); ``matvec(v)``,
  ``matmat(V)`` on flat vectors, ``dim``, ``device``, ``dtype``, ``hvps`` (products so far), ``unflatten(v)``
  (parameter-shaped views by name), ``gradient()``, ``loss()``. :class:`MatrixOperator` wraps an explicit matrix,
  :class:`FunctionOperator` a function ``v -> H v``. Every estimator below takes a :class:`CurvatureOperator`
  (:mod:`flatfl.analysis.operators.linear_operator`: ``dim``, ``dtype``, ``device``, ``matmat``, ``matvec``, ``hvps``,
  ``param_shapes``, ``preferred_block_size``, ``release()``, ``locked``); :func:`as_operator` makes one of a matrix
  and refuses anything else in one line. ``products="finite-difference"``: central differences of gradients, for
  an operation without a second derivative.
* :class:`GGNOperator` and :class:`EmpiricalFisherOperator`, the same arguments: the generalized Gauss-Newton
  matrix and the empirical Fisher of the same loss (:mod:`flatfl.analysis.operators.curvatures`), siblings of
  :class:`HessianOperator` on the curvature base :class:`LossCurvature` (its contract:
  :mod:`flatfl.analysis.operators.loss_curvature`); :func:`curvature_operator` ``(curvature, model, batches, *,
  loss_fn, loss, params, mode, products, ...)`` builds the one named (``"hessian"``, ``"ggn"``,
  ``"empirical-fisher"`` or any kind registered: the decorator :func:`curvature_kind` or
  :func:`register_curvature`, :mod:`flatfl.analysis.operators.kinds`, giving a :class:`CurvatureKind`).
* :func:`top_eigenvalues` ``(op, k, *, tol=1e-3, seed=0, return_vectors=False, basis_size=None, block_size=None,
  max_hvps=None, exact_residuals=False) -> EigenResult``: thick-restart block Lanczos, largest algebraic; repeated
  eigenvalues checked for more copies (``info["multiplicity"]``).
* :func:`power_iteration` ``(op, top_n=1, *, max_iter=100, tol=1e-3, seed=0, ...) -> EigenResult``: PyHessian's
  rule, exactly (:mod:`flatfl.analysis.estimators.power`).
* :func:`hutchinson_trace`, :func:`hutchpp_trace`, :func:`pyhessian_trace`, :func:`estimate_trace`
  ``-> TraceResult(estimate, stderr, hvps, method, samples)``; :func:`hutchinson_diagonal` ``(op, *, samples=100,
  seed=0) -> (diagonal, stderr)``.
* :func:`spectral_density` ``(op, *, steps=100, starts=1, seed=0) -> DensityResult(nodes, weights, hvps)`` and
  :func:`smoothed_density` ``(nodes, weights) -> (grid, density)``.
* :func:`estimate_eigenvalues` ``(op, method, k, ...)`` and :func:`estimate_trace` ``(op, method, ...)``: an
  estimator by name (:mod:`flatfl.analysis.estimators.by_name`); the registry of names, labels and defaults is
  :mod:`flatfl.analysis.estimators.registry`, where :func:`register_estimator` adds one from any package.
* :class:`ScaledOperator` ``(op, c)``, :class:`SumOperator` ``([a, b, ...])``, :class:`IdentityOperator` ``(like)``
  and :func:`damped` ``(op, damping)``: operators made of others, the damped curvature ``op + damping I``
  (:mod:`flatfl.analysis.operators.combined`).
* :class:`Quantity` and :func:`register_quantity`: a measured quantity of the operator beside the eigenvalues and the
  trace (``flatfl hessian --measure``; :mod:`flatfl.analysis.estimators.quantities`, where each module is a built-in
  one: the squared Frobenius norm, the squared norm of the diagonal).
* :func:`cross_client_metrics` ``(operators, *, protocol="default", probes=100, groups=10, seed=0, ...) ->
  ClientMetrics`` and :func:`pairwise_metrics` ``(diagonals)``: H_N and H_D across clients
  (:mod:`flatfl.analysis.estimators.client_metrics`).
* :func:`loss_surface` ``(model, batches, directions, grid=21, range=1.0, ...) -> SurfaceResult`` with
  :class:`SurfaceEvaluator`: a 2-D loss surface (:mod:`flatfl.analysis.estimators.surface`; directions:
  :mod:`flatfl.analysis.estimators.directions`; its files: :mod:`flatfl.analysis.estimators.surface_files`).

The commands, each on the skeleton of :mod:`flatfl.analysis.commands.skeleton` (``--out`` checked, the device resolved,
foreign files refused, the checkpoint loaded, a progress bar, the common header, an all-or-nothing write), each
``(checkpoint, out, settings, *, quiet)`` with one torch-free settings object (:mod:`flatfl.analysis.commands.hessian_settings`,
:mod:`flatfl.analysis.commands.client_metrics_settings`, :mod:`flatfl.analysis.commands.surface_settings`):
:func:`flatfl.analysis.commands.hessian_command.run_hessian` (``flatfl hessian``: hessian.json, eigenvalues.csv, figures;
:func:`flatfl.analysis.commands.hessian_command.load_eigenvectors` reads saved vectors),
:func:`flatfl.analysis.commands.clients_command.run_client_metrics` (``flatfl hessian-clients``: clients-<protocol>.json and a
heat map) and :func:`flatfl.analysis.commands.surface_command.run_surface` (``flatfl surface``). Their figures are in
:mod:`flatfl.analysis.commands.result_figures`; their result files are read back by :mod:`flatfl.analysis.commands.result_files`
(one reader per file). :mod:`flatfl.analysis.commands.tracking` makes the observer of ``flatfl train --track-hessian K``
(the same analysis on each K-th round's model).
"""
from __future__ import annotations

import importlib

#: each module and the public names it defines: a name's module is imported when the name is first asked for, so
#: that importing a torch-free module of this package (the settings, the estimator registry) imports no torch
_NAMES = {
    "operators.linear_operator": ("CurvatureOperator", "FunctionOperator", "MatrixOperator", "as_operator"),
    "operators.hessian": ("HessianOperator",),
    "operators.combined": ("IdentityOperator", "ScaledOperator", "SumOperator", "damped"),
    "operators.curvatures": ("EmpiricalFisherOperator", "GGNOperator"),
    "operators.loss_curvature": ("LossCurvature", "curvature_operator"),
    "operators.kinds": ("CurvatureKind", "curvature_kind", "register_curvature"),
    "operators.batches": ("as_batches",),
    "operators.second_order": ("SecondDerivativeError",),
    "estimators.registry": ("Estimator", "register_estimator"),
    "estimators.quantities": ("Quantity", "register_quantity"),
    "estimators.by_name": ("estimate_eigenvalues", "estimate_trace"),
    "estimators.eigen": ("EigenResult", "top_eigenvalues"),
    "estimators.power": ("power_iteration",),
    "estimators.trace": ("TraceResult", "hutchinson_diagonal", "hutchinson_trace", "hutchpp_trace", "pyhessian_trace"),
    "estimators.density": ("DensityResult", "smoothed_density", "spectral_density"),
    "estimators.per_layer": ("LayerCurvature", "PerLayerResult", "per_layer_curvature"),
    "estimators.client_metrics": ("ClientMetrics", "cross_client_metrics", "pairwise_metrics"),
    "estimators.surface": ("SurfaceEvaluator", "SurfaceResult", "loss_surface"),
    "model_hessian": ("ModelHessian", "hessian"),
    "commands.hessian_settings": ("HessianSettings",),
    "commands.client_metrics_settings": ("ClientMetricsSettings",),
    "commands.surface_settings": ("SurfaceSettings",),
    "commands.hessian_command": ("run_hessian", "compute"),
    "commands.clients_command": ("run_client_metrics",),
    "commands.surface_command": ("run_surface",),
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}

__all__ = [
    "hessian",
    "ModelHessian",
    "HessianOperator",
    "GGNOperator",
    "EmpiricalFisherOperator",
    "curvature_operator",
    "LossCurvature",
    "CurvatureKind",
    "curvature_kind",
    "register_curvature",
    "MatrixOperator",
    "FunctionOperator",
    "ScaledOperator",
    "SumOperator",
    "IdentityOperator",
    "damped",
    "CurvatureOperator",
    "as_operator",
    "as_batches",
    "Estimator",
    "register_estimator",
    "Quantity",
    "register_quantity",
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
    "estimate_eigenvalues",
    "ClientMetrics",
    "cross_client_metrics",
    "pairwise_metrics",
    "SurfaceEvaluator",
    "SurfaceResult",
    "loss_surface",
    "per_layer_curvature",
    "PerLayerResult",
    "LayerCurvature",
    "SecondDerivativeError",
    "HessianSettings",
    "ClientMetricsSettings",
    "SurfaceSettings",
    "run_hessian",
    "compute",
    "run_client_metrics",
    "run_surface",
]


def __getattr__(name: str):
    """A public name, its module imported now (module ``__getattr__``, PEP 562); a submodule as usual."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
