"""Curvature beyond the Hessian: the generalized Gauss-Newton matrix and the empirical Fisher as operators
(docs/analysis.md, "Which curvature").

For the sample-weighted mean loss ``L = sum_b (n_b / N) l_b(f_b(theta))`` over the evaluation set (the batches'
outputs ``f_b`` and the loss of those outputs ``l_b``):

* :class:`GGNOperator`: ``G = sum_b (n_b / N) J_b^T H_b J_b`` with ``J_b = d f_b / d theta`` and ``H_b`` the
  Hessian of ``l_b`` in the outputs: the Hessian without the terms of the network's own second derivatives,
  positive semi-definite for a convex loss of the outputs (cross-entropy, squared error), and for cross-entropy
  equal to the Fisher information of the model's predictive distribution. A block of vectors costs one forward
  pass, one forward-mode pass (``J V``, ``torch.func.jvp`` under ``vmap``) and one reverse pass (``J^T (H J V)``,
  the forward pass' ``vjp`` under ``vmap``); the network is never differentiated twice;
* :class:`EmpiricalFisherOperator`: ``F = (1 / N) sum_i g_i g_i^T``, the mean outer product of the per-sample
  gradients ``g_i`` (the gradient of sample i's loss, a batch of one): ``F V = (1 / N) sum_b G_b^T (G_b V)`` with
  the per-sample gradients ``G_b`` of batch b (``vmap`` of ``grad``, or one sample at a time for inputs of another
  structure), kept between products while they fit in ``cache_bytes``.

Both keep the Hessian's evaluation set forms, losses (cross-entropy, a criterion, ``loss(model, batch)``), layout
and first-order quantities: they are :class:`~flatfl.analysis.operators.hessian.HessianOperator`'s siblings, sharing its
``loss()``, ``gradient()``, ``num_samples``, ``param_names``, ``unflatten`` and ``flatten``. The GGN of an objective
``loss(model, batch)`` needs the split of the objective into the model's outputs and a loss of them: the function
carries ``loss.outputs(model, batch) -> tensor`` and ``loss.loss_of_outputs(outputs, batch) -> scalar``.

:func:`curvature_operator` is the one place an analysis builds its operator from a curvature's name.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterable, Sequence

import torch

from ...errors import ConfigError, unknown_name
from ..commands.hessian_settings import CURVATURES
from .hessian import HessianOperator
from .products import ForwardOverReverse, LossTerms, ProductMethod, check_scalar
from .second_order import needs_double_backward

__all__ = ["CURVATURES", "GGNOperator", "EmpiricalFisherOperator", "curvature_operator", "output_split"]


class _Outputs(torch.nn.Module):
    """``outputs(model, batch)`` as a module of one argument, so that ``functional_call`` can put other parameter
    values into ``model`` (their names gain the prefix ``model.``)."""

    def __init__(self, model: torch.nn.Module, outputs: Callable) -> None:
        super().__init__()
        self.model, self.outputs = model, outputs

    def forward(self, batch):
        return self.outputs(self.model, batch)


def output_split(loss: Callable) -> tuple[Callable, Callable]:
    """``(loss.outputs, loss.loss_of_outputs)`` of an objective ``loss(model, batch)``; a ConfigError line naming
    what is missing otherwise (the GGN needs the loss of the outputs apart from the network)."""
    name = getattr(loss, "__qualname__", type(loss).__name__)
    outputs, of_outputs = getattr(loss, "outputs", None), getattr(loss, "loss_of_outputs", None)
    if not callable(outputs) or not callable(of_outputs):
        missing = " and ".join(a for a, f in (("outputs", outputs), ("loss_of_outputs", of_outputs))
                               if not callable(f))
        raise ConfigError(f"the Gauss-Newton curvature of loss(model, batch) needs it split into the model's outputs "
                          f"and a loss of those outputs, and the function {name!r} has no {missing}: set "
                          f"{name}.outputs = fn(model, batch) -> tensor and {name}.loss_of_outputs = "
                          "fn(outputs, batch) -> the batch's mean loss")
    return outputs, of_outputs


def _func_failure(e: RuntimeError, what: str) -> ConfigError | None:
    """One line for a model that ``torch.func`` cannot transform (a custom Function without its support)."""
    if not needs_double_backward(e):
        return None
    return ConfigError(f"the {what} needs every operation of the model to support torch.func "
                       f"({' '.join(str(e).split())[:160]}); give the Function setup_context and jvp, or use "
                       "--curvature hessian")


def check_once(terms: LossTerms, index: int) -> None:
    """Batch ``index``'s loss checked once (a scalar, finite) as the Hessian's is, before its first product."""
    if index not in terms.checked:
        with torch.enable_grad():
            terms.batch_loss(index)


class GaussNewtonProducts(ProductMethod):
    """``G V`` per batch: ``J^T (H_out (J V))`` by ``torch.func`` (one forward, one ``jvp`` and one ``vjp`` pass
    under ``vmap`` over a block of vectors). ``split``: None for ``loss_fn(model(inputs), targets)``, else an
    objective's ``(outputs, loss_of_outputs)``."""

    name = "jvp-vjp"

    def __init__(self, terms: LossTerms, block_size: int | None, keys: list[str], split) -> None:
        super().__init__(terms, block_size)
        self.keys, self.split = keys, split
        self.wrapper = _Outputs(terms.model, split[0]) if split is not None else None

    @property
    def preferred_block_size(self) -> int:
        return min(32, self.block_limit())

    def network_and_loss(self, index: int) -> tuple[Callable, Callable]:
        """Batch ``index``'s outputs as a function of the parameters (by name) and its loss of the outputs."""
        from torch.func import functional_call

        terms, batch = self.terms, self.terms.batches[index]
        if self.split is None:
            inputs, targets = batch
            return (lambda params: functional_call(terms.model, params, (inputs,)),
                    lambda out: terms.loss_fn(out, targets))
        of_outputs = self.split[1]
        return (lambda params: functional_call(self.wrapper, {f"model.{k}": v for k, v in params.items()}, (batch,)),
                lambda out: of_outputs(out, batch))

    def matmat(self, rows: torch.Tensor) -> torch.Tensor:
        try:
            return self._matmat(rows)
        except RuntimeError as e:
            failure = _func_failure(e, "Gauss-Newton curvature")
            if failure is None:
                raise
            raise failure from None

    def _matmat(self, rows: torch.Tensor) -> torch.Tensor:
        from torch.func import grad, jvp, vjp, vmap

        terms, keys = self.terms, self.keys
        out = torch.zeros_like(rows)
        primals = {key: p.detach() for key, p in zip(keys, terms.params)}
        with terms.model_mode(), terms.no_running_stats():
            for index, weight in enumerate(terms.weights):
                check_once(terms, index)
                network, loss_of = self.network_and_loss(index)
                with terms.batch_rng(index):
                    outputs, pullback = vjp(network, primals)
                if not isinstance(outputs, torch.Tensor) or not outputs.is_floating_point():
                    raise ConfigError(f"the Gauss-Newton curvature needs the model's outputs as one floating tensor, "
                                      f"got {type(outputs).__name__} on evaluation batch {index}")
                outputs = outputs.detach()
                check_scalar(loss_of(outputs), self.split is not None)
                output_gradient = grad(loss_of)

                def jacobian_product(tangent):
                    return jvp(network, (primals,), (tangent,))[1]

                def output_hessian_product(u):
                    return jvp(output_gradient, (outputs,), (u,))[1]

                def block(tangents, index=index):
                    with terms.batch_rng(index):
                        jv = vmap(jacobian_product, randomness="same")(tangents)
                    return vmap(pullback)(vmap(output_hessian_product)(jv))[0]

                self.add_in_blocks(out, rows, keys, weight, block)
        return out


def _one_sample(batch, i: int, n: int):
    """Sample ``i`` of a batch of ``n`` samples as a batch of one: every tensor whose first dimension is ``n``
    sliced, the rest kept (containers rebuilt as in :func:`flatfl.analysis.operators.objective.move`)."""
    if isinstance(batch, torch.Tensor):
        return batch[i:i + 1] if batch.dim() >= 1 and batch.shape[0] == n else batch
    if isinstance(batch, Mapping):
        items = {k: _one_sample(v, i, n) for k, v in batch.items()}
        try:
            return type(batch)(items)
        except Exception:  # a Mapping type that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_one_sample(v, i, n) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_one_sample(v, i, n) for v in batch)
    return batch


class PerSampleGradients(ProductMethod):
    """``F V = (1 / N) sum_b G_b^T (G_b V)`` from each batch's per-sample gradients ``G_b`` (n_b, dim), kept while
    they fit in ``cache_bytes``."""

    name = "per-sample-gradients"

    def __init__(self, terms: LossTerms, block_size: int | None, keys: list[str] | None, cache_bytes: int) -> None:
        super().__init__(terms, block_size)
        self.keys, self.cache_bytes = keys, cache_bytes
        self.kept: list | None = None
        self.sizes = [round(w * terms.num_samples) for w in terms.weights]

    @property
    def preferred_block_size(self) -> int:
        return 32  # the per-sample gradients are computed once per block (or kept): a block shares them

    def release(self) -> None:
        self.kept = None

    def gradients(self, index: int) -> torch.Tensor:
        """Batch ``index``'s per-sample gradients, one row per sample."""
        terms = self.terms
        check_once(terms, index)
        batch, n = terms.batches[index], self.sizes[index]
        if terms.objective is None and isinstance(batch[0], torch.Tensor) and self.keys is not None:
            try:
                return self._vmapped(batch)
            except RuntimeError as e:
                if not needs_double_backward(e):
                    raise  # a Function without torch.func support: one sample at a time below
        rows = torch.empty(n, terms.dim, dtype=terms.params[0].dtype, device=terms.device)
        with torch.enable_grad():
            for i in range(n):
                sample = _one_sample(batch, i, n)
                if terms.objective is not None:
                    loss = terms.objective(terms.model, sample)
                else:
                    loss = terms.loss_fn(terms.model(sample[0]), sample[1])
                check_scalar(loss, terms.objective is not None)
                grads = torch.autograd.grad(loss, terms.params, allow_unused=True)
                rows[i] = torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                     for g, p in zip(grads, terms.params)])
        return rows

    def _vmapped(self, batch) -> torch.Tensor:
        from torch.func import functional_call, grad, vmap

        terms, keys = self.terms, self.keys
        primals = {key: p.detach() for key, p in zip(keys, terms.params)}

        def sample_loss(params, x, y):
            return terms.loss_fn(functional_call(terms.model, params, (x.unsqueeze(0),)), y.unsqueeze(0))

        inputs, targets = batch
        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(primals, inputs, targets)
        return torch.cat([per_sample[key].reshape(len(targets), -1) for key in keys], dim=1)

    def matmat(self, rows: torch.Tensor) -> torch.Tensor:
        terms = self.terms
        out = torch.zeros_like(rows)
        with terms.model_mode():
            if self.kept is None:
                self.kept = [None] * len(terms.batches)
                budget = self.cache_bytes
                for index in range(len(terms.batches)):
                    need = self.sizes[index] * terms.dim * rows.element_size()
                    if need > budget:
                        break
                    self.kept[index] = self.gradients(index)
                    budget -= need
            for index, n in enumerate(self.sizes):
                G = self.kept[index] if self.kept[index] is not None else self.gradients(index)
                out.add_((rows @ G.T) @ G, alpha=1.0 / terms.num_samples)  # (k, n_b) then (k, dim)
        return out


class _SiblingOperator(HessianOperator):
    """A curvature of the same loss, evaluation set and layout as :class:`HessianOperator` (its constructor's
    checks, ``loss()``, ``gradient()``, ``unflatten``, ``flatten``), with products of its own (:meth:`_products`)."""

    curvature = ""

    def __init__(self, model: torch.nn.Module, batches: Iterable, loss_fn: Callable | None = None,
                 params: Sequence[torch.Tensor] | None = None, mode: str = "eval", cache_bytes: int | None = None,
                 block_size: int | None = None, *, loss: Callable | None = None) -> None:
        super().__init__(model, batches, loss_fn, params, mode, cache_graph=False, cache_bytes=cache_bytes,
                         products="double-backward", block_size=block_size, loss=loss)
        self.terms.second_order = False  # the network is differentiated once
        self.requested_products = "auto"
        self.method = self._products()
        self.products: str = self.method.name

    def _products(self) -> ProductMethod:  # pragma: no cover - every sibling has its own
        raise NotImplementedError

    @property
    def product_error(self) -> float | None:
        return None


class GGNOperator(_SiblingOperator):
    """The generalized Gauss-Newton matrix ``sum_b (n_b / N) J_b^T H_b J_b`` of the sample-weighted mean loss
    (module docstring). The arguments are :class:`HessianOperator`'s but ``cache_graph`` and ``products``; a
    ``loss(model, batch)`` objective must carry its split (``loss.outputs``, ``loss.loss_of_outputs``)."""

    curvature = "ggn"

    def _products(self) -> ProductMethod:
        keys = ForwardOverReverse.names_of(self.model, self.params)
        if keys is None:
            raise ConfigError("the Gauss-Newton curvature needs parameters that belong to the model")
        split = output_split(self.objective) if self.objective is not None else None
        if split is not None:
            self._check_split(split)
        return GaussNewtonProducts(self.terms, self.block_size, keys, split)

    def _check_split(self, split) -> None:
        """``loss_of_outputs(outputs(model, batch), batch)`` is ``loss(model, batch)`` on the first batch."""
        terms = self.terms
        with terms.model_mode(), torch.no_grad(), terms.batch_rng(0):
            whole = float(terms.objective(terms.model, terms.batches[0]))
        with terms.model_mode(), torch.no_grad(), terms.batch_rng(0):
            parts = float(split[1](split[0](terms.model, terms.batches[0]), terms.batches[0]))
        if not abs(whole - parts) <= 1e-5 * max(1.0, abs(whole)):
            raise ConfigError(f"the objective's split does not add up: loss_of_outputs(outputs(model, batch), batch) "
                              f"= {parts:.9g} but loss(model, batch) = {whole:.9g} on evaluation batch 0")




class EmpiricalFisherOperator(_SiblingOperator):
    """The empirical Fisher ``(1 / N) sum_i g_i g_i^T`` of the per-sample gradients (module docstring). The
    arguments are :class:`HessianOperator`'s but ``cache_graph`` and ``products``; ``cache_bytes`` bounds the
    per-sample gradients kept between products. Evaluation mode only (a batch of one has no batch statistics)."""

    curvature = "empirical-fisher"

    def _products(self) -> ProductMethod:
        if self.mode != "eval":
            raise ConfigError("the empirical Fisher takes each sample's gradient alone (a batch of one), which needs "
                              "mode='eval' (BatchNorm's batch statistics and dropout belong to a batch)")
        keys = ForwardOverReverse.names_of(self.model, self.params)
        return PerSampleGradients(self.terms, self.block_size, keys, self.cache_bytes)


_OPERATORS = {"ggn": GGNOperator, "empirical-fisher": EmpiricalFisherOperator}


def curvature_operator(curvature: str, model: torch.nn.Module, batches: Iterable, *, loss_fn: Callable | None = None,
                       loss: Callable | None = None, params: Sequence[torch.Tensor] | None = None,
                       mode: str = "eval", products: str = "auto", block_size: int | None = None,
                       cache_graph: bool | str = "auto", cache_bytes: int | None = None) -> HessianOperator:
    """The operator of ``curvature`` (one of :data:`CURVATURES`) for the mean loss of ``model`` over ``batches``:
    ``"hessian"`` a :class:`HessianOperator` (``products`` its product method), ``"ggn"`` a :class:`GGNOperator`,
    ``"empirical-fisher"`` an :class:`EmpiricalFisherOperator` (their products are their own: ``products`` must be
    ``"auto"``). The other arguments are :class:`HessianOperator`'s."""
    if curvature not in CURVATURES:
        raise unknown_name("curvature", curvature, CURVATURES)
    if curvature == "hessian":
        return HessianOperator(model, batches, loss_fn, params, mode, cache_graph, cache_bytes, products, block_size,
                               loss=loss)
    if products != "auto":
        raise ConfigError(f"--products {products} chooses how Hessian products are computed; the {curvature} "
                          "curvature has products of its own (first derivatives only): leave --products at auto")
    return _OPERATORS[curvature](model, batches, loss_fn, params, mode, cache_bytes, block_size, loss=loss)
