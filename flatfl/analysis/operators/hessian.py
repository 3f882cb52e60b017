"""The Hessian of a model's mean loss as a linear operator (docs/analysis-protocols.md §1).

:class:`HessianOperator` is the Hessian of the **sample-weighted mean** loss over a fixed, deterministic evaluation
set, one kind of :class:`~flatfl.analysis.operators.loss_curvature.LossCurvature` (registered as ``"hessian"``, the
default of :mod:`~flatfl.analysis.operators.kinds`; the Gauss-Newton matrix and the empirical Fisher are its siblings):
``matvec(v)`` and ``matmat(V)`` on flat vectors (the concatenation of the selected parameters in
``model.parameters()`` order). Every estimator in
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

from typing import Callable, Iterable, Sequence

import torch

from ...errors import ConfigError
from .names import PRODUCT_METHODS
from .batches import ACCEPTED_DATA, as_batches
from .exact_trace import softmax_columns
from .kinds import curvature_kind
from .linear_operator import MatrixOperator, block_size_for
from .loss_curvature import LossCurvature
from .products import DoubleBackward, FiniteDifference, ForwardOverReverse, ProductMethod
from .second_order import needs_double_backward
from .vectors import free_memory, random_block, seeded_generator

__all__ = ["HessianOperator", "MatrixOperator", "as_batches", "block_size_for", "free_memory", "random_block",
           "seeded_generator", "ACCEPTED_DATA", "PRODUCTS", "AUTO_PRODUCTS"]

PRODUCTS = PRODUCT_METHODS
#: the product method "auto" picks per device type (docs/performance.md); elsewhere double backward
AUTO_PRODUCTS = {"cuda": "forward-over-reverse"}


@curvature_kind("hessian", title="Hessian", full_name="Hessian", takes_products=True,
                description="the Hessian of the mean loss: second derivatives of the loss and of the network")
class HessianOperator(LossCurvature):
    """Hessian of the sample-weighted mean loss of ``model`` over ``batches`` (a
    :class:`~flatfl.analysis.operators.loss_curvature.LossCurvature`: the arguments it shares are described there).

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
        if products not in PRODUCTS:
            raise ConfigError(f"unknown product method {products!r}; choose one of {', '.join(PRODUCTS)}")
        if cache_graph not in (True, False, "auto"):
            raise ConfigError(f"cache_graph must be True, False or 'auto', got {cache_graph!r}")
        self.cache_graph = cache_graph
        self.requested_products = products
        super().__init__(model, batches, loss_fn, params, mode, loss=loss, cache_bytes=cache_bytes,
                         block_size=block_size)

    def product_method(self) -> ProductMethod:
        """Forward-over-reverse, finite differences or double backward, as ``products`` asks (``"auto"``: by
        device, :data:`AUTO_PRODUCTS`)."""
        products, model = self.requested_products, self.model
        chosen = products if products != "auto" else AUTO_PRODUCTS.get(self.device.type, "double-backward")
        keys = ForwardOverReverse.names_of(model, self.params) if chosen == "forward-over-reverse" else None
        if chosen == "forward-over-reverse" and keys is None:
            if products != "auto":
                raise ConfigError("forward-over-reverse products need parameters that belong to the model")
            chosen = "double-backward"
        if chosen == "forward-over-reverse":
            return ForwardOverReverse(self.terms, self.block_size, keys)
        if chosen == "finite-difference":
            return FiniteDifference(self.terms, self.block_size)
        return DoubleBackward(self.terms, self.block_size, self.cache_graph, self.cache_bytes)

    #: the Hessian's exact trace is the Gauss-Newton matrix's for a network linear in each layer's parameters
    #: (checked on every batch: :mod:`.exact_trace`)
    exact_trace_needs_linear_layers = True

    def trace_columns(self, outputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
        return softmax_columns(self.loss_fn, outputs, targets, self.curvature_name())

    @property
    def fully_cached(self) -> bool:
        """True when every batch's first-order graph is kept (a product costs one double backward)."""
        return self.method.fully_cached

    def apply_method(self, rows: torch.Tensor) -> torch.Tensor:
        """H applied to the rows ``(k, dim)``; with ``products="auto"``, a model that ``torch.func`` cannot
        transform falls back from forward-over-reverse to double backward."""
        try:
            return self.method.matmat(rows)
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
            return self.method.matmat(rows)
