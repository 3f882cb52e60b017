"""Curvature beyond the Hessian: the generalized Gauss-Newton matrix and the empirical Fisher as operators
(docs/analysis.md, "Which curvature").

For the sample-weighted mean loss ``L = sum_b (n_b / N) l_b(f_b(theta))`` over the evaluation set (the batches'
outputs ``f_b`` and the loss of those outputs ``l_b``):

* :class:`GGNOperator`: ``G = sum_b (n_b / N) J_b^T H_b J_b`` with ``J_b = d f_b / d theta`` and ``H_b`` the
  Hessian of ``l_b`` in the outputs: the Hessian without the terms of the network's own second derivatives,
  positive semi-definite for a convex loss of the outputs (cross-entropy, squared error), and for cross-entropy
  equal to the Fisher information of the model's predictive distribution. A block of vectors costs one forward
  pass, one forward-mode pass (``J V``, ``torch.func.jvp`` under ``vmap``), a double backward pass through the loss
  of the outputs alone (``H_b (J V)``, :class:`OutputHessian`: any loss torch differentiates twice; for a criterion
  that is recognisably cross-entropy, ``H_b u = a (p * u - p (p . u))`` per sample in closed form instead,
  :mod:`.cross_entropy`: O(C) per sample for C classes, no graph) and one reverse
  pass (``J^T (H J V)``, the forward pass' ``vjp`` under ``vmap``); the network is never differentiated twice. A
  loss without a finite second derivative in the outputs, or found not convex in them on a few random directions,
  is refused in one line naming it;
* :class:`EmpiricalFisherOperator`: ``F = (1 / N) sum_i g_i g_i^T``, the mean outer product of the per-sample
  gradients ``g_i`` (the gradient of sample i's loss, a batch of one): ``F V = (1 / N) sum_b G_b^T (G_b V)`` with
  the per-sample gradients ``G_b`` of batch b (``vmap`` of ``grad``, or one sample at a time for inputs of another
  structure), kept between products while they fit in ``cache_bytes``.

Both keep the Hessian's evaluation set forms, losses (cross-entropy, a criterion, ``loss(model, batch)``), layout
and first-order quantities: they are :class:`~flatfl.analysis.operators.hessian.HessianOperator`'s siblings, kinds of
:class:`~flatfl.analysis.operators.loss_curvature.LossCurvature` sharing its ``loss()``, ``gradient()``,
``num_samples``, ``param_names``, ``unflatten`` and ``flatten``, each registered by its decorator
(:mod:`flatfl.analysis.operators.kinds`). The GGN of an objective ``loss(model, batch)`` needs the split of the
objective into the model's outputs and a loss of them: the function carries ``loss.outputs(model, batch) -> tensor``
and ``loss.loss_of_outputs(outputs, batch) -> scalar``.

:func:`curvature_operator` (:mod:`.loss_curvature`, importable from here) is the one place an analysis builds its
operator from a curvature's name.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...errors import ConfigError
from ...utils.batch_walk import slice_samples
from .kinds import CURVATURES, curvature_kind
from .cross_entropy import SoftmaxHessian, cross_entropy_form
from .exact_trace import gradient_columns, softmax_columns
from .loss_curvature import LossCurvature, curvature_operator
from .products import ForwardOverReverse, LossTerms, ProductMethod, check_scalar
from .second_order import custom_functions, needs_double_backward

__all__ = ["CURVATURES", "GGNOperator", "EmpiricalFisherOperator", "OutputHessian", "curvature_operator",
           "output_split"]


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


def loss_name(objective: Callable | None, loss_fn: Callable | None) -> str:
    """How a refusal names the loss of the outputs: ``fn.loss_of_outputs`` of an objective, else the criterion's
    function or class name (``cross_entropy``, ``MSELoss``)."""
    if objective is not None:
        return f"{getattr(objective, '__qualname__', type(objective).__name__)}.loss_of_outputs"
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


def gauss_newton_refusal(name: str, reason: str) -> ConfigError:
    """The one line refusing the Gauss-Newton curvature of the loss ``name`` for ``reason``."""
    return ConfigError(f"the Gauss-Newton curvature J^T H_out J needs the loss twice differentiable and convex in "
                       f"the model's outputs, and {name} is not: {reason}; use --curvature hessian (with "
                       "--products finite-difference for a loss without a second derivative) or "
                       "--curvature empirical-fisher")


class OutputHessian:
    """``H_out U`` for one batch: the Hessian of the loss in the model's outputs applied to a block of output-shaped
    vectors ``U`` (k, *outputs.shape), by differentiating the loss's gradient in the outputs again (reverse over
    reverse, on the outputs alone: cheap beside the network's passes). Every loss torch can differentiate twice
    works so, squared error and Huber included (whose backward torch's forward mode does not support); a gradient
    that does not depend on the outputs (a loss linear in them, or linear pieces such as L1's) gives ``H_out = 0``.
    A loss without a second derivative in the outputs is refused in one line naming it (:meth:`refusal`)."""

    #: random directions on which :meth:`check_convex` tries ``u^T H_out u >= 0``
    PROBES = 4

    def __init__(self, loss_of: Callable, outputs: torch.Tensor, name: str, index: int) -> None:
        self.name, self.index = name, index
        self.outputs = outputs.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = loss_of(self.outputs)
            once = [function for function, flag in custom_functions(loss) if flag] if loss.requires_grad else []
            if once:
                raise self.refusal(f"it goes through torch.autograd.Function {once[0]!r}, whose backward is marked "
                                   "@once_differentiable")
            gradient = torch.autograd.grad(loss, self.outputs, create_graph=True)[0] if loss.requires_grad else None
        #: None: the gradient does not depend on the outputs (the loss is linear in them): H_out = 0
        self.gradient = gradient if gradient is not None and gradient.requires_grad else None
        self.batched = True  # False once a batched backward pass failed: one vector at a time from then on

    def refusal(self, reason: str) -> ConfigError:
        return gauss_newton_refusal(self.name, reason)

    def products(self, U: torch.Tensor) -> torch.Tensor:
        """``H_out u`` for each row ``u`` of ``U`` (k, *outputs.shape)."""
        if self.gradient is None:
            return torch.zeros_like(U)
        try:
            result = self.batched_products(U) if self.batched else None
            if not self.batched:  # an operation without batching rules: one vector at a time
                rows = [torch.autograd.grad(self.gradient, self.outputs, u, retain_graph=True, allow_unused=True)[0]
                        for u in U]
                result = None if rows[0] is None else torch.stack(rows)
        except RuntimeError as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            detail = " ".join(str(e).split())[:160]
            raise self.refusal(f"torch failed to differentiate its gradient again ({detail})") from None
        return torch.zeros_like(U) if result is None else result

    def batched_products(self, U: torch.Tensor) -> torch.Tensor | None:
        """The block in one batched backward pass; None, with :attr:`batched` cleared, where torch cannot batch it."""
        try:
            return torch.autograd.grad(self.gradient, self.outputs, U, retain_graph=True, allow_unused=True,
                                       is_grads_batched=True)[0]
        except RuntimeError as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            self.batched = False
            return None

    def check_convex(self) -> None:
        """``H_out`` finite and positive semi-definite on :attr:`PROBES` seeded random directions (a necessary
        condition, tried where the products are taken): a refusal otherwise. The tolerance is sqrt(eps) of the
        dtype relative to ``|u| |H_out u|`` (the rounding of a quadratic form near zero)."""
        if self.gradient is None:
            return
        generator = torch.Generator().manual_seed(1_000_003 + self.index)
        probes = torch.randn(self.PROBES, *self.outputs.shape, generator=generator, dtype=self.outputs.dtype)
        probes = probes.to(self.outputs.device)
        products = self.products(probes)
        if not bool(torch.isfinite(products).all()):
            raise self.refusal(f"its second derivative is not finite at the outputs of evaluation batch {self.index}")
        flat_u, flat_h = probes.reshape(self.PROBES, -1), products.reshape(self.PROBES, -1)
        forms = (flat_u * flat_h).sum(dim=1)
        scales = flat_u.norm(dim=1) * flat_h.norm(dim=1)
        tolerance = torch.finfo(self.outputs.dtype).eps ** 0.5
        worst = int(torch.argmin(forms / scales.clamp_min(torch.finfo(self.outputs.dtype).tiny)))
        if float(forms[worst]) < -tolerance * float(scales[worst]):
            raise self.refusal(f"it is not convex there (u^T H_out u = {float(forms[worst]):.3g} < 0 for a random "
                               f"direction u of evaluation batch {self.index}'s outputs), so J^T H_out J would not "
                               "be positive semi-definite")


class GaussNewtonProducts(ProductMethod):
    """``G V`` per batch: ``J^T (H_out (J V))`` by ``torch.func`` (one forward, one ``jvp`` and one ``vjp`` pass
    under ``vmap`` over a block of vectors; ``H_out`` from :meth:`output_hessian`). ``split``: None for
    ``loss_fn(model(inputs), targets)``, else an objective's ``(outputs, loss_of_outputs)``."""

    name = "jvp-vjp"

    def __init__(self, terms: LossTerms, block_size: int | None, keys: list[str], split) -> None:
        super().__init__(terms, block_size)
        self.keys, self.split = keys, split
        self.wrapper = _Outputs(terms.model, split[0]) if split is not None else None
        self.loss_name = loss_name(terms.objective, terms.loss_fn)
        self.convex_checked: set[int] = set()  # batches whose output Hessian was checked (OutputHessian.check_convex)
        #: the criterion's settings where it is recognisably cross-entropy (H_out in closed form), else None
        self.cross_entropy = cross_entropy_form(terms.loss_fn) if split is None else None
        self.general: set[int] = set()  # batches on which the criterion did not give F.cross_entropy's value

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
        from torch.func import jvp, vjp, vmap

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
                value = loss_of(outputs)
                check_scalar(value, self.split is not None)
                output_hessian = self.output_hessian(index, loss_of, outputs, value)

                def jacobian_product(tangent):
                    return jvp(network, (primals,), (tangent,))[1]

                def block(tangents, index=index, output_hessian=output_hessian):
                    with terms.batch_rng(index):
                        jv = vmap(jacobian_product, randomness="same")(tangents)
                    return vmap(pullback)(output_hessian.products(jv))[0]

                self.add_in_blocks(out, rows, keys, weight, block)
        return out

    def output_hessian(self, index: int, loss_of: Callable, outputs: torch.Tensor,
                       value: torch.Tensor) -> OutputHessian | SoftmaxHessian:
        """Batch ``index``'s ``H_out`` at ``outputs`` (where the loss is ``value``): in closed form
        (:class:`SoftmaxHessian`) for a recognised cross-entropy whose value on the batch is ``F.cross_entropy``'s
        with its settings, by double backward (:class:`OutputHessian`) otherwise. Checked on a batch's first use:
        the closed form's coefficients finite and >= 0 (exactly the convex case), the general one on random
        directions."""
        first = index not in self.convex_checked
        if self.cross_entropy is not None and index not in self.general:
            targets = self.terms.batches[index][1]
            if first and not self.gives_cross_entropy(value, outputs, targets):
                self.general.add(index)
            else:
                hessian = SoftmaxHessian(self.cross_entropy, outputs, targets)
                worst = hessian.worst_coefficient() if first else None
                if worst is not None:
                    raise gauss_newton_refusal(self.loss_name, f"its class weights or probability targets make it "
                                               f"concave in the outputs of evaluation batch {index} (element "
                                               f"{worst[1]} has {worst[0]:.3g} < 0 times logsumexp of its scores)")
                self.convex_checked.add(index)
                return hessian
        hessian = OutputHessian(loss_of, outputs, self.loss_name, index)
        if first:
            hessian.check_convex()
            self.convex_checked.add(index)
        return hessian

    def gives_cross_entropy(self, value: torch.Tensor, outputs: torch.Tensor, targets) -> bool:
        """Whether the criterion's ``value`` on ``outputs`` is ``F.cross_entropy``'s with the recognised settings,
        to a few units of rounding (not so for a hooked or altered criterion: the general path then)."""
        try:
            expected = self.cross_entropy.loss(outputs, targets)
        except (RuntimeError, TypeError, ValueError, IndexError):
            return False
        tolerance = 8 * torch.finfo(outputs.dtype).eps * max(1.0, abs(float(expected)))
        return bool(abs(float(value) - float(expected)) <= tolerance)


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
                sample = slice_samples(batch, i, i + 1, n)  # a batch of one
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


@curvature_kind("ggn", title="GGN", full_name="Gauss-Newton matrix",
                description="the generalized Gauss-Newton matrix J^T H_out J: positive semi-definite for a convex "
                            "loss, the Fisher for cross-entropy")
class GGNOperator(LossCurvature):
    """The generalized Gauss-Newton matrix ``sum_b (n_b / N) J_b^T H_b J_b`` of the sample-weighted mean loss
    (module docstring). The arguments are :class:`~.loss_curvature.LossCurvature`'s
    (:class:`~.hessian.HessianOperator`'s but ``cache_graph`` and ``products``); a ``loss(model, batch)`` objective
    must carry its split (``loss.outputs``, ``loss.loss_of_outputs``)."""

    def product_method(self) -> ProductMethod:
        self.terms.second_order = False  # the network is differentiated once
        keys = ForwardOverReverse.names_of(self.model, self.params)
        if keys is None:
            raise ConfigError("the Gauss-Newton curvature needs parameters that belong to the model")
        split = output_split(self.objective) if self.objective is not None else None
        if split is not None:
            self._check_split(split)
        return GaussNewtonProducts(self.terms, self.block_size, keys, split)

    def trace_columns(self, outputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
        return softmax_columns(self.loss_fn, outputs, targets, self.curvature_name())

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




@curvature_kind("empirical-fisher", title="empirical Fisher", full_name="empirical Fisher",
                description="the empirical Fisher (1/N) sum_i g_i g_i^T: the mean outer product of the per-sample "
                            "gradients")
class EmpiricalFisherOperator(LossCurvature):
    """The empirical Fisher ``(1 / N) sum_i g_i g_i^T`` of the per-sample gradients (module docstring). The
    arguments are :class:`~.loss_curvature.LossCurvature`'s (:class:`~.hessian.HessianOperator`'s but
    ``cache_graph`` and ``products``); ``cache_bytes`` bounds the per-sample gradients kept between products.
    Evaluation mode only (a batch of one has no batch statistics)."""

    def product_method(self) -> ProductMethod:
        self.terms.second_order = False  # each sample's loss is differentiated once
        if self.mode != "eval":
            raise ConfigError("the empirical Fisher takes each sample's gradient alone (a batch of one), which needs "
                              "mode='eval' (BatchNorm's batch statistics and dropout belong to a batch)")
        keys = ForwardOverReverse.names_of(self.model, self.params)
        return PerSampleGradients(self.terms, self.block_size, keys, self.cache_bytes)

    def trace_columns(self, outputs: torch.Tensor, targets: torch.Tensor, batch_size: int) -> torch.Tensor:
        return gradient_columns(self.loss_fn, outputs, targets, batch_size)
