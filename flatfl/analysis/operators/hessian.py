"""The Hessian of a model's mean loss as a linear operator (docs/analysis-protocols.md §1).

:class:`HessianOperator` is the Hessian of the **sample-weighted mean** loss over a fixed, deterministic evaluation
set, a :class:`~flatfl.analysis.operators.linear_operator.CurvatureOperator`: ``matvec(v)`` and ``matmat(V)`` on flat vectors
(the concatenation of the selected parameters in ``model.parameters()`` order). Every estimator in
:mod:`flatfl.analysis` takes any such operator, so an explicit matrix (:class:`MatrixOperator`) or another curvature
operator can stand in for it.

The products are computed by one of the methods of :mod:`flatfl.analysis.operators.products`: Pearlmutter's double backward
through each batch's kept first-order graph, or forward-over-reverse (``torch.func`` ``jvp`` of ``grad`` under
``vmap`` over a block of vectors). ``products="auto"`` means forward-over-reverse on CUDA and double backward
elsewhere, by measurement (docs/performance.md). Both give the same numbers to rounding. ``"finite-difference"``
takes central differences of two gradients per vector, for models with an operation torch cannot differentiate
twice; its stated relative error is :attr:`HessianOperator.product_error`.

Parameters that receive no gradient (unused layers, frozen branches) are rows and columns of zeros, where PyHessian
fails. The model's mode is set for every product (``eval`` by default: BatchNorm running statistics, no dropout) and
each module's own mode is restored afterwards; in ``train`` mode the buffers (BatchNorm running statistics) are
restored after each pass and the random state is re-seeded per batch, so the operator stays deterministic.

The evaluation set's forms (:func:`~flatfl.analysis.operators.batches.as_batches`) and the random vectors
(:mod:`flatfl.analysis.operators.vectors`) have modules of their own; their names are also importable from here.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from ...errors import ConfigError
from .names import PRODUCT_METHODS
from .batches import ACCEPTED_DATA, as_batches
from .linear_operator import CurvatureOperator, MatrixOperator, block_size_for
from .objective import loss_batches
from .products import DoubleBackward, FiniteDifference, ForwardOverReverse, LossTerms
from .second_order import needs_double_backward
from .vectors import free_memory, random_block, seeded_generator

__all__ = ["HessianOperator", "MatrixOperator", "as_batches", "block_size_for", "free_memory", "random_block",
           "seeded_generator", "ACCEPTED_DATA", "PRODUCTS", "AUTO_PRODUCTS"]

_MODES = ("eval", "train")
PRODUCTS = PRODUCT_METHODS
#: the product method "auto" picks per device type (docs/performance.md); elsewhere double backward
AUTO_PRODUCTS = {"cuda": "forward-over-reverse"}


class HessianOperator(CurvatureOperator):
    """Hessian of the sample-weighted mean loss of ``model`` over ``batches``.

    Parameters
    ----------
    model: any ``nn.Module``; its parameters stay untouched.
    batches: the evaluation set: one ``(inputs, targets)`` batch, a list of them, or a DataLoader (any iterable)
        yielding them (:func:`as_batches`). It is read once and kept (moved to the model's device), so the operator
        is deterministic. ``model(inputs)`` gives the outputs and
        ``loss_fn(outputs, targets)`` must be the **mean** loss over the batch; the batch size is ``len(targets)``.
    loss_fn: defaults to cross-entropy.
    loss: instead of ``loss_fn``, any objective ``loss(model, batch) -> scalar`` (the batch's mean loss) over batches
        of any structure (a dict such as ``{"input_ids": ..., "labels": ...}``, a tuple of several inputs): then
        ``batches`` is one dict or tuple (one batch), or a list of batches or a DataLoader yielding them, each
        weighted by its number of samples (the first dimension of its first tensor;
        :mod:`flatfl.analysis.operators.objective`).
    params: the parameters to differentiate (default: every parameter with ``requires_grad``), all of one floating
        dtype. The flat layout follows this order.
    mode: ``"eval"`` (default, as PyHessian) or ``"train"``.
    cache_graph: ``True`` keeps every batch's first-order graph, ``False`` none, ``"auto"`` keeps them while their
        saved tensors fit in ``cache_bytes`` (default 2 GiB on CPU, half the free memory on CUDA).
    products: ``"auto"`` (default: by device, see the module docstring), ``"double-backward"``,
        ``"forward-over-reverse"`` (batched; needs parameters registered in ``model``) or ``"finite-difference"``
        (central differences of gradients, for operations without a second derivative; :attr:`product_error`).
    block_size: vectors per batched pass (default: sized from free memory, at most 256).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batches: Iterable,
        loss_fn: Callable | None = None,
        params: Sequence[torch.Tensor] | None = None,
        mode: str = "eval",
        cache_graph: bool | str = "auto",
        cache_bytes: int | None = None,
        products: str = "auto",
        block_size: int | None = None,
        *,
        loss: Callable | None = None,
    ) -> None:
        if loss is not None and loss_fn is not None:
            raise ConfigError("give loss_fn (a criterion of (outputs, targets)) or loss (a function of (model, "
                              "batch)), not both")
        if loss is not None and not callable(loss):
            raise ConfigError(f"loss must be a function loss(model, batch) -> scalar, got a {type(loss).__name__}")
        if mode not in _MODES:
            raise ConfigError(f"unknown Hessian mode {mode!r}; choose one of {', '.join(_MODES)}")
        if products not in PRODUCTS:
            raise ConfigError(f"unknown product method {products!r}; choose one of {', '.join(PRODUCTS)}")
        if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
            raise ConfigError(f"block size must be a positive integer, got {block_size!r}")
        if cache_graph not in (True, False, "auto"):
            raise ConfigError(f"cache_graph must be True, False or 'auto', got {cache_graph!r}")
        self.model = model
        self.loss_fn = loss_fn if loss_fn is not None else (None if loss is not None else F.cross_entropy)
        self.objective = loss
        self.mode = mode
        self.params = list(params) if params is not None else [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameters that require a gradient")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ConfigError(f"all parameters must share one floating dtype, found {sorted(map(str, dtypes))}")
        if next(iter(dtypes)) in (torch.float16, torch.bfloat16):
            raise ConfigError(f"the parameters are {next(iter(dtypes))}: Hessian products in 16-bit floating point are "
                              "tens of percent off; cast the model first (model.float() or model.double())")
        self.dtype: torch.dtype = self.params[0].dtype
        self.device: torch.device = self.params[0].device

        names = {id(p): n for n, p in model.named_parameters()}
        self.param_names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        self.batches = loss_batches(batches, self.device) if loss is not None else as_batches(batches, self.device)
        self.terms = LossTerms(model, self.batches, self.loss_fn, self.params, mode, objective=loss)
        self.dim: int = self.terms.dim
        self.num_samples: int = self.terms.num_samples

        self.cache_graph = cache_graph
        if cache_bytes is None:
            if self.device.type == "cuda":
                cache_bytes = int(torch.cuda.mem_get_info(self.device)[0] * 0.5)
            else:
                cache_bytes = 2 * 2**30
        self.cache_bytes = int(cache_bytes)
        self.requested_products = products
        self.block_size = block_size  # vectors per batched pass (None: sized from free memory)
        chosen = products if products != "auto" else AUTO_PRODUCTS.get(self.device.type, "double-backward")
        keys = ForwardOverReverse.names_of(model, self.params) if chosen == "forward-over-reverse" else None
        if chosen == "forward-over-reverse" and keys is None:
            if products != "auto":
                raise ConfigError("forward-over-reverse products need parameters that belong to the model")
            chosen = "double-backward"
        if chosen == "forward-over-reverse":
            self.method = ForwardOverReverse(self.terms, block_size, keys)
        elif chosen == "finite-difference":
            self.method = FiniteDifference(self.terms, block_size)
        else:
            self.method = DoubleBackward(self.terms, block_size, cache_graph, self.cache_bytes)
        self.products: str = self.method.name
        self.hvps = 0  # Hessian-vector products computed so far (one per vector)
        self.on_hvp: Callable[[int], None] | None = None  # called with the count after every product

    # ------------------------------------------------------------------ layout
    @property
    def param_shapes(self) -> list[tuple[int, ...]]:
        """The selected parameters' shapes, in the flat layout's order."""
        return self.terms.shapes

    @property
    def has_param_layout(self) -> bool:
        return True

    def unflatten(self, vector: torch.Tensor) -> "OrderedDict[str, torch.Tensor]":
        """Views of a flat vector shaped like the parameters, keyed by parameter name."""
        if vector.shape != (self.dim,):
            raise ConfigError(f"expected a vector of length {self.dim}, got shape {tuple(vector.shape)}")
        offsets = self.terms.offsets
        return OrderedDict(
            (name, vector[a:b].view(shape))
            for name, shape, a, b in zip(self.param_names, self.param_shapes, offsets, offsets[1:])
        )

    def flatten(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Concatenate per-parameter tensors (``None`` meaning zeros) into one flat vector."""
        out = torch.zeros(self.dim, dtype=self.dtype, device=self.device)
        for t, a, b in zip(tensors, self.terms.offsets, self.terms.offsets[1:]):
            if t is not None:
                out[a:b] = t.reshape(-1)
        return out

    # ------------------------------------------------------------------ products
    @property
    def product_error(self) -> float | None:
        """The stated relative error of a product: finite differences' estimate (None before the first product);
        None for exact products (double backward, forward-over-reverse: rounding only)."""
        return getattr(self.method, "error", None)

    @property
    def fully_cached(self) -> bool:
        """True when every batch's first-order graph is kept (a product costs one double backward)."""
        return self.method.fully_cached

    @property
    def preferred_block_size(self) -> int:
        """How many vectors estimators should push through one pass.

        Forward-over-reverse: the block that fits in memory (at most 32). Double backward: 1 when graphs are cached
        (a product is then one double backward whatever the block), else 8 (a block shares the first-order pass).
        """
        return self.method.preferred_block_size

    def block_limit(self) -> int:
        """Most vectors one batched pass takes (:meth:`flatfl.analysis.operators.products.ProductMethod.block_limit`)."""
        return self.method.block_limit()

    def release(self) -> None:
        """Free the cached first-order graphs (they are rebuilt on the next product)."""
        self.method.release()

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """H v for a flat vector ``v`` of length ``dim``; returns a vector of ``dtype`` on ``device``."""
        return self.matmat(torch.as_tensor(v).reshape(-1, 1)).reshape(-1)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        """H V for ``V`` of shape ``(dim, k)``: k products sharing each batch's first-order pass."""
        V = torch.as_tensor(V)
        if V.dim() != 2 or V.shape[0] != self.dim:
            raise ConfigError(f"expected a ({self.dim}, k) block of vectors, got shape {tuple(V.shape)}")
        rows = V.to(device=self.device, dtype=self.dtype).T.contiguous()  # (k, dim): each vector contiguous
        k = rows.shape[0]
        try:
            out = self.method.matmat(rows)
        except RuntimeError as e:
            if not (self.products == "forward-over-reverse" and needs_double_backward(e)):
                raise
            if self.requested_products != "auto":
                raise ConfigError(f"forward-over-reverse products need every operation of the model to support "
                                  f"torch.func ({' '.join(str(e).split())[:160]}); use products='double-backward'") \
                    from None
            # "auto": double backward does not need torch.func (an autograd.Function without setup_context or jvp)
            self.method = DoubleBackward(self.terms, self.block_size, self.cache_graph, self.cache_bytes)
            self.products = self.method.name
            out = self.method.matmat(rows)
        self.hvps += k
        if self.on_hvp is not None:
            self.on_hvp(k)
        return out.T

    # ------------------------------------------------------------------ first-order quantities
    def loss(self) -> float:
        """The mean loss over the evaluation set (the sample-weighted mean of the batches' losses)."""
        terms = self.terms
        total = 0.0
        with terms.model_mode(), torch.no_grad():
            for index, weight in enumerate(terms.weights):
                total += weight * float(terms.batch_loss(index))
        return total

    def gradient(self) -> torch.Tensor:
        """Flat gradient of the mean loss (no graph kept): the unit of cost HVPs are compared with."""
        with self.terms.model_mode():
            return self.terms.gradient()
