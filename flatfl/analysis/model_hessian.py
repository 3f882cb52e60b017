"""PyHessian's ``hessian``, on flatfl's estimators: PyHessian code runs with the import line changed.

::

    from flatfl.analysis import hessian               # was: from pyhessian import hessian

    hessian_comp = hessian(model, criterion, data=(inputs, targets), cuda=False)   # or dataloader=loader
    top_eigenvalues, top_eigenvector = hessian_comp.eigenvalues(top_n=3)
    trace = hessian_comp.trace()                       # a list of per-probe estimates: np.mean(trace)
    density_eigen, density_weight = hessian_comp.density()

The calls take PyHessian's arguments and return what PyHessian returns (docs/analysis.md, "Coming from
PyHessian"):

* ``eigenvalues(maxIter=100, tol=1e-3, top_n=1)`` -> ``(eigenvalues, eigenvectors)``: a list of Python floats, and
  for each a list of tensors shaped like the parameters (``model.parameters()`` that require a gradient, in order),
  unit norm over all of them. flatfl's thick-restart block Lanczos answers: the ``top_n`` largest *algebraic*
  eigenvalues, descending, to a relative residual ``tol`` (PyHessian's power iteration stops on a relative change of
  ``tol`` and can be several percent low; it finds the largest in *magnitude*, in the order found:
  ``method="power"`` runs it, at most ``maxIter`` products per eigenvalue, with PyHessian's draws after
  ``torch.manual_seed(seed)``).
* ``trace(maxIter=100, tol=1e-3)`` -> a list of per-probe trace estimates, whose mean is the estimate. Hutch++ with a
  budget of ``maxIter`` products, stopped once the standard error is below ``tol`` of the estimate: each entry is the
  exact trace of the sketched top of the spectrum plus one Hutchinson probe of the rest, so every entry is an
  unbiased estimate of the trace, with a far smaller spread than PyHessian's ``z^T H z``. ``method="pyhessian"``:
  PyHessian's loop and stopping rule, its samples.
* ``density(iter=100, n_v=1)`` -> ``(nodes, weights)``: one list of floats per start (stochastic Lanczos quadrature,
  ``iter`` steps from each of ``n_v`` Rademacher starts; PyHessian 0.1's own ``density`` calls the removed
  ``torch.eig``).

``which="smallest"`` (the most negative first) or ``"magnitude"`` in ``eigenvalues`` and ``top_eigenvalues`` asks
for other eigenvalues than the largest, and :meth:`ModelHessian.as_linear_operator` gives the curvature to scipy's
solvers.

The richer answers stay reachable: :meth:`ModelHessian.top_eigenvalues` (residuals, error estimates, products),
:meth:`ModelHessian.trace_estimate` (the estimate with its standard error), :meth:`ModelHessian.spectral_density`,
:meth:`ModelHessian.per_layer` (each module's block), and ``h.last``, the rich result behind the last call
(``h.last_eigenvalues``, ``h.last_trace``, ``h.last_density`` for each kind).

Beyond PyHessian: ``loss=fn`` instead of a criterion, ``fn(model, batch) -> scalar`` for batches of any structure
(:mod:`flatfl.analysis.operators.objective`); ``data=`` is then one batch and ``dataloader=`` yields batches, weighted by
their number of samples. ``cuda``: PyHessian's flag. flatfl computes on the model's device (move the model
first, ``model.cuda()``; the data follows it); ``cuda=True`` on a machine without CUDA is a ConfigError naming
``cuda=False``. The default, ``None``, takes the model's device without a check. Every estimator runs with
``flatfl hessian``'s defaults and its seed streams (``seed`` for the eigenvalues, ``seed + 1`` for the trace,
``seed + 2`` for the density, ``seed + 5`` for a measured quantity), so on the same batches it gives the command's
numbers.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError
from ..utils.atomic import atomic_write_bytes_unrecorded
from .estimators.registry import DEFAULT_EIGEN_METHOD, DEFAULT_TRACE_METHOD, estimator, resolve_which
from .commands.hessian_settings import HessianSettings, measured_text
from .estimators.density import DensityResult, spectral_density
from .estimators.eigen import EigenResult
from .estimators.by_name import estimate_eigenvalues, estimate_trace
from .operators.batches import as_batches
from .operators.kinds import kind_of
from .operators.loss_curvature import curvature_operator
from .estimators.per_layer import PerLayerResult, per_layer_curvature
from .estimators.power import power_iteration
from .estimators.trace import TraceResult, hutchpp_trace, pyhessian_trace

__all__ = ["hessian", "ModelHessian", "DENSITY_FORMATS"]

DEFAULTS = HessianSettings()
#: what :meth:`ModelHessian.save_density` writes, by the file's suffix
DENSITY_FORMATS = (".png", ".pdf", ".csv")


def _check_cuda(cuda) -> None:
    if cuda is None or cuda is False:
        return
    if cuda is not True:
        raise ConfigError(f"cuda must be True, False or None (the model's device), got {cuda!r}")
    if not torch.cuda.is_available():
        raise ConfigError("cuda=True, but CUDA is not available on this machine: pass cuda=False (flatfl computes on "
                          "the model's device)")


def _operator(model, batches, criterion, loss, mode: str, curvature: str, products: str):
    """The curvature operator of the API (:func:`~flatfl.analysis.operators.loss_curvature.curvature_operator`): under torchrun
    (several ranks), this rank's shard of the batches with its products all-reduced
    (:mod:`flatfl.analysis.operators.distributed`), the process group started on the model's device; else the plain operator."""
    from ..utils import ranks
    from .operators.distributed import over_ranks

    if ranks.launched().distributed:
        first = next((p for p in model.parameters()), None)
        ranks.join(first.device if first is not None else torch.device("cpu"))
        batches = batches if loss is not None else as_batches(batches)  # a list, to be cut into shards
    return over_ranks(lambda shard: curvature_operator(curvature, model, shard, loss_fn=criterion, mode=mode, loss=loss,
                                                       products=products), batches, objective=loss is not None,
                      mode=mode)


def _check_tol(name: str, value, none: bool = False) -> None:
    """A tolerance is a finite positive number (``none``: None too, no tolerance); a ConfigError line otherwise."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or \
            not np.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be positive and finite (a number){' or None' if none else ''}, got {value!r}")


#: the floating types the products compute in; 16-bit ones are refused (their eigenvalues are tens of percent off)
COMPUTE_DTYPES = (torch.float32, torch.float64)


class ModelHessian:
    """The Hessian of the mean loss over ``data`` at ``model``'s current weights, with PyHessian's methods (see the
    module docstring). ``criterion(outputs, targets)`` (the mean loss of a batch; default cross-entropy) over
    ``(inputs, targets)`` batches, or ``loss(model, batch)`` over batches of any structure. ``data``: one batch (with
    a criterion also a list of batches); ``dataloader``: any iterable of batches (read once). ``mode``: ``"eval"``
    (default, as PyHessian) or ``"train"``. ``seed``: every random vector.

    Attributes as PyHessian's: ``model``, ``criterion``, ``params`` (the parameters differentiated, in order),
    ``device`` (``"cuda"`` or ``"cpu"``), ``full_dataset`` (True with ``dataloader=``), ``data``. :attr:`operator`
    is the :class:`~flatfl.analysis.operators.hessian.HessianOperator` (``matvec``, ``dim``, ``hvps``...) for the other
    estimators of :mod:`flatfl.analysis`; with ``curvature="ggn"`` or ``"empirical-fisher"`` it is its sibling,
    the generalized Gauss-Newton matrix or the empirical Fisher (:mod:`flatfl.analysis.operators.curvatures`), and every
    method answers for that matrix. ``products``: how Hessian products are computed (``"finite-difference"`` for
    an operation torch cannot differentiate twice).
    """

    def __init__(self, model, criterion: Callable | None = None, data=None, dataloader=None, cuda: bool | None = None,
                 *, loss: Callable | None = None, mode: str = "eval", seed: int = DEFAULTS.seed,
                 curvature: str = DEFAULTS.curvature, products: str = DEFAULTS.products) -> None:
        kind_of(curvature).check_products(products)  # a registered curvature, before any data is read
        if (data is None) == (dataloader is None):
            raise ConfigError("give the data once: data=(inputs, targets) (or a list of batches), or "
                              "dataloader=a DataLoader")
        if loss is not None and criterion is not None:
            raise ConfigError("give a criterion (a function of (outputs, targets)) or loss= (a function of (model, "
                              "batch)), not both")
        reduction = getattr(criterion, "reduction", "mean")
        if reduction != "mean":
            raise ConfigError(f"the criterion must return the mean loss of a batch (reduction='mean'), got "
                              f"reduction={reduction!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        _check_cuda(cuda)
        low = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.is_floating_point()
                      and p.dtype not in COMPUTE_DTYPES})
        if low:
            raise ConfigError(f"the model's parameters are {', '.join(low)}: Hessian products in 16-bit floating "
                              "point are too coarse for eigenvalues; analyse a float32 copy "
                              "(copy.deepcopy(model).float()) or model.double()")
        if loss is not None:
            from .operators.objective import loss_batches

            batches = loss_batches(data, one_batch=True) if data is not None else loss_batches(dataloader)
        else:
            batches = data if data is not None else dataloader
        self.operator = _operator(model, batches, criterion, loss, mode, curvature, products)
        self.curvature = curvature
        self.model, self.criterion, self.loss = model, criterion, loss
        self.data = data if data is not None else dataloader
        self.full_dataset = data is None
        self.params = list(self.operator.params)
        self.device = self.operator.device.type
        self.seed = seed
        self.last = None  # the rich result behind the last call (EigenResult, TraceResult, DensityResult, ...)
        self.last_eigenvalues: EigenResult | None = None
        self.last_trace: TraceResult | None = None
        self.last_density: DensityResult | None = None
        self.last_per_layer: PerLayerResult | None = None

    @property
    def num_samples(self) -> int:
        return self.operator.num_samples

    @property
    def num_params(self) -> int:
        return self.operator.dim

    def _keep(self, result):
        self.last = result
        if isinstance(result, EigenResult):
            self.last_eigenvalues = result
        elif isinstance(result, TraceResult):
            self.last_trace = result
        elif isinstance(result, DensityResult):
            self.last_density = result
        elif isinstance(result, PerLayerResult):
            self.last_per_layer = result
        return result

    # ------------------------------------------------------------------ PyHessian's calls
    def eigenvalues(self, maxIter: int = 100, tol: float = 1e-3, top_n: int = 1, *,
                    method: str = DEFAULT_EIGEN_METHOD,
                    which: str | None = None) -> tuple[list[float], list[list[torch.Tensor]]]:
        """PyHessian's ``eigenvalues``: ``(values, vectors)``, the ``top_n`` largest eigenvalues as floats and each
        one's eigenvector as a list of tensors shaped like :attr:`params`. ``method="lanczos"`` (default: largest
        algebraic, descending, relative residual ``tol``), ``"power"`` (PyHessian's power iteration, at most
        ``maxIter`` products per eigenvalue, in the order found) or any other registered eigenvalue method
        (:mod:`flatfl.analysis.estimators.registry`; ``maxIter`` is PyHessian's power iteration's alone).
        ``which="smallest"`` gives the ``top_n`` smallest (ascending: the most negative first), ``"magnitude"`` the
        largest in magnitude (by decreasing ``|lambda|``; power iteration finds these only); None: the method's own.
        The rich result: ``h.last``."""
        estimator("eigenvalues", method)  # an unknown name: the registry's one line, naming the registered ones
        which = resolve_which(method, which)
        if not isinstance(maxIter, (int, np.integer)) or isinstance(maxIter, bool) or maxIter < 1:
            raise ConfigError(f"maxIter must be a positive integer, got {maxIter!r}")
        _check_tol("tol", tol)
        if method == "power":
            result = power_iteration(self.operator, top_n, max_iter=int(maxIter), tol=tol, seed=self.seed,
                                     return_vectors=True)
        else:
            result = estimate_eigenvalues(self.operator, method, top_n, which=which, tol=tol, seed=self.seed,
                                          return_vectors=True)
        self._keep(result)
        vectors = [[t.detach().clone() for t in self.operator.unflatten(v).values()] for v in result.eigenvectors]
        return [float(v) for v in result.eigenvalues], vectors

    def trace(self, maxIter: int = 100, tol: float = 1e-3, *, method: str = DEFAULT_TRACE_METHOD) -> list[float]:
        """PyHessian's ``trace``: a list of per-probe trace estimates (``np.mean`` of it is the estimate), from at
        most ``maxIter`` products. ``method="hutchpp"`` (default): Hutch++, stopped once its standard error is below
        ``tol`` of the estimate, each entry the sketch's exact trace plus one probe of the rest;
        ``"hutchinson"``: ``z^T H z`` probes with the same stopping rule; ``"pyhessian"``: PyHessian's loop and
        stopping rule; any other registered trace method with the budget ``maxIter`` and the relative standard error
        ``tol``. The rich result (estimate, standard error, products): ``h.last``."""
        estimator("trace", method)  # an unknown name: the registry's one line, naming the registered ones
        if not isinstance(maxIter, (int, np.integer)) or isinstance(maxIter, bool) or maxIter < 1:
            raise ConfigError(f"maxIter must be a positive integer, got {maxIter!r}")
        _check_tol("tol", tol)
        if method == "hutchpp" and maxIter < 12:  # too few products for a sketch and 10 probes of the rest
            method = "hutchinson"
        if method == "pyhessian":
            result = pyhessian_trace(self.operator, max_iter=int(maxIter), tol=tol, seed=self.seed + 1)
        elif method == "hutchpp":
            result = hutchpp_trace(self.operator, max_hvps=int(maxIter), rtol=tol, seed=self.seed + 1)
        else:
            result = estimate_trace(self.operator, method, max_hvps=int(maxIter), rtol=tol, seed=self.seed + 1)
        self._keep(result)
        offset = float(result.info.get("sketch_trace", 0.0))
        return [offset + float(s) for s in result.samples]

    def density(self, iter: int = 100, n_v: int = 1) -> tuple[list[list[float]], list[list[float]]]:  # noqa: A002
        """PyHessian's ``density``: ``(nodes, weights)``, one list of floats per start, from ``iter`` Lanczos steps
        (at most the parameter count) of each of ``n_v`` starts. The rich result: ``h.last``."""
        result = self.spectral_density(steps=iter, starts=n_v)
        return [[float(t) for t in nodes] for nodes in result.nodes], \
            [[float(w) for w in weights] for weights in result.weights]

    # ------------------------------------------------------------------ flatfl's richer answers
    def top_eigenvalues(self, top_n: int = 1, *, method: str = DEFAULTS.method, tol: float = DEFAULTS.tol,
                        which: str | None = DEFAULTS.which, return_vectors: bool = False,
                        exact_residuals: bool = DEFAULTS.exact_residuals) -> EigenResult:
        """The ``top_n`` largest eigenvalues, descending (``.eigenvalues``), with residuals ``||Hv - λv||``, error
        estimates (never below the products' rounding, ``.info["rounding_floor"]``) and the products used, by any
        registered method (``lanczos``, ``power``); ``which="smallest"``: the ``top_n`` smallest, ascending;
        ``"magnitude"``: the largest in magnitude. ``return_vectors=True`` adds ``.eigenvectors`` (``(top_n, dim)``
        unit rows; ``operator.unflatten(v)`` shapes one like the parameters)."""
        _check_tol("tol", tol)
        return self._keep(estimate_eigenvalues(self.operator, method, top_n, which=which, tol=tol, seed=self.seed,
                                               return_vectors=return_vectors, exact_residuals=exact_residuals))

    def as_linear_operator(self):
        """The curvature as a ``scipy.sparse.linalg.LinearOperator`` in the model's dtype (float32 or float64), for
        scipy's solvers: ``scipy.sparse.linalg.eigsh(h.as_linear_operator(), k=3, which="SA")`` (each product
        counted in ``h.operator.hvps``; the operator's ``as_linear_operator``,
        :mod:`flatfl.analysis.operators.linear_operator`)."""
        return self.operator.as_linear_operator()

    @property
    def measured(self) -> str:
        """What this object's numbers are of: 'GGN, exact products (jvp-vjp), float32' (the curvature, how its
        products are computed, the floating type)."""
        error = self.operator.product_error
        products = {"method": self.operator.products, "relative_error": None if error is None else float(error)}
        return measured_text(self.curvature, products, str(self.operator.dtype).removeprefix("torch."))

    def trace_estimate(self, *, method: str = DEFAULT_TRACE_METHOD, max_hvps: int = DEFAULTS.trace_hvps,
                       rtol: float | None = DEFAULTS.trace_rtol) -> TraceResult:
        """The trace with its standard error (``.estimate``, ``.stderr``, ``.hvps``) from at most ``max_hvps``
        products, stopping once the standard error is below ``rtol`` of the estimate (``flatfl hessian``'s
        defaults)."""
        _check_tol("rtol", rtol, none=True)
        return self._keep(estimate_trace(self.operator, method, max_hvps=max_hvps, rtol=rtol, seed=self.seed + 1))

    def measure(self, name: str, *, max_hvps: int = DEFAULTS.trace_hvps,
                rtol: float | None = DEFAULTS.trace_rtol) -> dict:
        """A registered quantity of the matrix (:mod:`flatfl.analysis.estimators.quantities`; ``"frobenius"``: the
        squared Frobenius norm), as ``flatfl hessian --measure NAME`` records it: ``{"estimate", "stderr", "hvps",
        ...}``, within the budget ``max_hvps`` and target ``rtol`` of a trace, from the seed stream ``seed + 5``."""
        from .estimators.quantities import QUANTITY_SEED_OFFSET, quantity

        _check_tol("rtol", rtol, none=True)
        if isinstance(max_hvps, bool) or not isinstance(max_hvps, (int, np.integer)) or max_hvps < 1:
            raise ConfigError(f"max_hvps must be a positive integer, got {max_hvps!r}")
        settings = HessianSettings(top=0, trace=False, trace_hvps=int(max_hvps), trace_rtol=rtol,
                                   measure=name).validate()
        if len(settings.quantities) != 1:
            raise ConfigError(f"measure takes one quantity's name, got {name!r}")
        (one,) = settings.quantities
        return quantity(one).measure(self.operator, settings, self.seed + QUANTITY_SEED_OFFSET)

    def spectral_density(self, *, steps: int = DEFAULTS.density_steps,
                         starts: int = DEFAULTS.density_starts) -> DensityResult:
        """The spectral density by stochastic Lanczos quadrature: ``starts`` runs of ``steps`` Lanczos steps
        (``.nodes``, ``.weights``: one array per start)."""
        return self._keep(spectral_density(self.operator, steps=steps, starts=starts, seed=self.seed + 2))

    def per_layer(self, top_n: int = 1, *, grouping: str = "module", tol: float = DEFAULTS.tol,
                  max_hvps: int = DEFAULTS.trace_hvps, rtol: float | None = DEFAULTS.trace_rtol,
                  dense_up_to: int | None = None) -> PerLayerResult:
        """Each module's Hessian block (weights and bias together; ``grouping="parameter"``: each named parameter):
        its top ``top_n`` eigenvalues and its trace +- standard error (:mod:`flatfl.analysis.estimators.per_layer`; a block
        of at most ``dense_up_to`` entries, default ``max_hvps``, exactly). ``.blocks``, ``.trace_sum``."""
        _check_tol("tol", tol)
        _check_tol("rtol", rtol, none=True)
        return self._keep(per_layer_curvature(self.operator, top_n, grouping=grouping, tol=tol, trace_hvps=max_hvps,
                                              trace_rtol=rtol, seed=self.seed + 3, dense_up_to=dense_up_to))

    def save_density(self, path, density: DensityResult | None = None, *, title: str | None = None) -> Path:
        """Write ``density`` (default: the last density, computed now if there is none) to ``path``: ``.png`` /
        ``.pdf``, the figure ``flatfl hessian --density`` draws (the last eigenvalues computed marked; the axis
        names the curvature, the title the products and precision, :attr:`measured`); ``.csv``, that figure's curve
        (columns ``eigenvalue``, ``density``). Written atomically;
        returns the path."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in DENSITY_FORMATS:
            raise ConfigError(f"cannot write a density as {path.name!r}: name a {', '.join(DENSITY_FORMATS)} file")
        if density is None:
            density = self.last_density if self.last_density is not None else self.spectral_density()
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
            from .commands.result_figures import density_figure

            last = self.last_eigenvalues
            marks = [] if last is None else last.eigenvalues.tolist()
            which = "largest" if last is None else last.info.get("which", "largest")
            data = density_figure(dens, suffix[1:], marks=marks, curvature=self.curvature, which=which,
                                  measured=self.measured, samples=self.num_samples,
                                  model=title or f"{self.num_params:,} parameters")
        atomic_write_bytes_unrecorded(path, data)
        return path


def hessian(model, criterion: Callable | None = None, data=None, dataloader=None, cuda: bool | None = None, *,
            loss: Callable | None = None, mode: str = "eval", seed: int = DEFAULTS.seed,
            curvature: str = DEFAULTS.curvature, products: str = DEFAULTS.products) -> ModelHessian:
    """PyHessian's ``hessian(model, criterion, data=None, dataloader=None, cuda=True)`` on flatfl's estimators: a
    :class:`ModelHessian` whose ``eigenvalues``, ``trace`` and ``density`` return what PyHessian's return (see the
    module docstring). ``criterion`` defaults to cross-entropy; ``loss=fn`` takes ``fn(model, batch) -> scalar``
    instead; ``curvature="ggn"`` or ``"empirical-fisher"`` measures the generalized Gauss-Newton matrix or the
    empirical Fisher instead of the Hessian."""
    return ModelHessian(model, criterion, data, dataloader, cuda, loss=loss, mode=mode, seed=seed, curvature=curvature,
                        products=products)
