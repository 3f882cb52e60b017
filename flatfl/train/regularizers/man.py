"""MAN: minimize the layer-wise activation norm (Yashwanth et al.; MAN paper Eq. 15-18; docs/update-rules.md §16).

Local loss, exactly as the official fedMAN code computes it::

    loss = CE + (zeta / 2) * Reg,    Reg = sum_l mean_b mean_elements(a_l ** 2)

where a_l runs over the model's post-non-linearity activations (``model.activation_modules()``; the logits are
never among them). Each layer term is the per-sample mean of squares over all non-batch elements, averaged over the
batch (Eq. 17 for convolutional maps, Eq. 18 for fully connected layers); the terms are summed over layers (Eq. 16).

The weight: the paper writes f_k = L_k + zeta * L_act (Eq. 15), the code adds ``mu_mean / 2 * Reg``.
``--zeta`` is the code's ``--mu_mean``, so the published values (zeta = 0.15 on CIFAR-100, 0.1 on Tiny-ImageNet,
README; 0.2 in the shipped Tiny-ImageNet scripts) mean here what they meant there: loss = CE + (zeta/2) * Reg.
Default 0.15 (the CIFAR-100 value).

Activations are captured by forward hooks installed once in :meth:`MAN.attach`. A hook acts only while MAN's own
forward pass runs and only for the module instances it was installed on, so a deep copy of the model (a teacher,
the frozen global model, an algorithm's extra forward) never adds terms; the list of terms is cleared at every
forward, so SAM's two passes each see exactly their own activations. Hooked activation modules are switched to
``inplace=False``. A model that later changes a hooked activation in place (``x += ...`` after a ReLU) gets a clear
error instead of a silently different penalty: with a graph, autograd refuses the in-place change of the view the
hook passed on (turned into MAN's message); without one (``torch.no_grad()``), the activation's version counter,
recorded by the hook, tells.

Cost. The hook computes the layer's term from the output as soon as the module returns it, and passes the output on
through one autograd node per layer (:class:`_ActivationPenalty`) that also returns the term; the layer's backward
is one fused kernel, ``grad + (2 w / numel) * a`` with w the term's weight in the loss, so the penalty costs one
read of each activation forward (its norm) and one fused multiply-add backward, with no saved list, no separate
penalty node and no second gradient accumulation pass. A layer over 65,536 elements is reduced in blocks whose
squares are summed in float64 (:func:`_mean_square_value`), and the layers' terms are summed in float64, so the
logged value stays within 1e-7 of float64 at 25M elements.

Models without ``activation_modules()`` fall back to every element-wise non-linearity module (ReLU, GELU, tanh, ...)
registered before the final linear layer. A network with nothing to hook (non-linearities written as ``F.relu`` in
``forward``) is refused with one line, rather than trained as plain cross-entropy. The modules are always chosen on
the plain network and found by name in a channel-stacked copy of it (:func:`flatfl.models.stacking.counterparts`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..components import REGULARIZERS, HParam
from ..context import StepContext
from ...models.stacking import client_blocks, counterparts, source_network
from .regularizer import Regularizer, per_client_cross_entropy

#: element-wise non-linearities the fallback hooks when a model does not list its activation modules
NONLINEARITIES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
                  nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softsign)


def default_activation_modules(model: nn.Module) -> list[nn.Module]:
    """The model's own list when it has ``activation_modules()``; else every non-linearity module registered before
    the final linear layer (``model.classifier`` when present, else the last ``nn.Linear``), so nothing applied to
    the logits is ever penalised."""
    own = getattr(model, "activation_modules", None)
    if callable(own):
        return list(own())
    modules = list(model.modules())
    head = getattr(model, "classifier", None)
    if not isinstance(head, nn.Module):
        linears = [m for m in modules if isinstance(m, nn.Linear)]
        head = linears[-1] if linears else None
    end = next((i for i, m in enumerate(modules) if m is head), len(modules))
    return [m for m in modules[:end] if isinstance(m, NONLINEARITIES)]


def mean_square(a: torch.Tensor) -> torch.Tensor:
    """One layer's term mean_b mean_elements(a ** 2) (Eq. 17 / 18): the mean of squares over every element, which
    equals the per-sample mean over the non-batch elements averaged over the batch (every sample has as many).
    A value without a graph (:func:`sum_of_mean_squares` gives the penalty its gradient)."""
    return _mean_square_value(a).to(a.dtype)


#: activations larger than this are reduced in blocks of this many elements (see _mean_square_value)
BLOCK = 1 << 16


def _mean_square_value(a: torch.Tensor) -> torch.Tensor:
    """||a||^2 / numel(a) as a float64 0-d tensor, without a graph. torch's float32 norm accumulates a long tensor
    in a few running float32 sums: 1e-2 relative error at 25M elements. A layer up to ``BLOCK`` elements (every
    layer of a small network) takes one norm; a larger layer is reduced as rows of ``BLOCK`` elements (one kernel,
    the same arithmetic as one norm), and the row norms are squared and summed in float64: within 1e-7 of float64
    at 25M elements, at the speed of the plain norm (tests/test_regularizers.py)."""
    a = a.detach()
    n = a.numel()
    if n <= BLOCK:
        return torch.linalg.vector_norm(a).double().square() / n
    flat, m = a.reshape(-1), n // BLOCK
    r = torch.linalg.vector_norm(flat[:m * BLOCK].view(m, BLOCK), dim=1)
    if n > m * BLOCK:
        r = torch.cat([r, torch.linalg.vector_norm(flat[m * BLOCK:]).reshape(1)])
    r = r.double()
    return torch.dot(r, r) / n


class _ActivationPenalty(torch.autograd.Function):
    """One hooked layer: ``(a, mean(a ** 2))``. The first output is the activation itself (a view of it, which the
    rest of the forward pass uses), the second the layer's term as a float64 0-d tensor. Backward is one fused
    kernel: d/da = grad_a + grad_term * 2 a / numel(a), the penalty's gradient added to the gradient that flows
    back from later layers, with no separate node, no saved list and no second accumulation pass. Autograd runs
    this backward only once both gradients have arrived, so the penalty's weight in the loss (zeta / 2, or
    whatever multiplies the term) reaches the layer exactly; a term that no loss uses contributes nothing."""

    @staticmethod
    def forward(ctx, a: torch.Tensor):
        ctx.save_for_backward(a)
        ctx.set_materialize_grads(False)
        return a.view_as(a), _mean_square_value(a)

    @staticmethod
    def backward(ctx, grad_a, grad_term):
        if grad_term is None:
            return grad_a
        (a,) = ctx.saved_tensors
        coef = (grad_term * (2.0 / a.numel())).to(a.dtype)
        return a * coef if grad_a is None else torch.addcmul(grad_a, a, coef)


def _client_mean_squares(a: torch.Tensor, m: int) -> torch.Tensor:
    """Each client's term of a stacked activation (B, M*C, ...) (client k's part in the k-th channel block): (M,)
    float64, each sample's block norm taken in one kernel and the squares summed in float64."""
    blocks = client_blocks(a.detach(), m)
    r = torch.linalg.vector_norm(blocks, dim=2).double()
    return (r * r).sum(0) / (blocks.shape[0] * blocks.shape[2])


class _ClientsActivationPenalty(torch.autograd.Function):
    """:class:`_ActivationPenalty` for a stacked activation of M clients: ``(a, terms)`` with terms (M,) the clients'
    mean(a_k ** 2); backward one fused ``grad + (2 w_k / numel_k) a`` with each client's own weight w_k."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, m: int):
        ctx.save_for_backward(a)
        ctx.set_materialize_grads(False)
        ctx.m = m
        return a.view_as(a), _client_mean_squares(a, m)

    @staticmethod
    def backward(ctx, grad_a, grad_term):
        if grad_term is None:
            return grad_a, None
        (a,) = ctx.saved_tensors
        blocks = client_blocks(a, ctx.m)
        coef = (grad_term * (2.0 / (blocks.shape[0] * blocks.shape[2]))).to(a.dtype).view(1, ctx.m, 1)
        if grad_a is None:
            return (blocks * coef).view_as(a), None
        return torch.addcmul(grad_a.reshape(blocks.shape), blocks, coef).view_as(a), None


def penalised(a: torch.Tensor, clients: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(the activation to pass on, its term mean(a ** 2) in float64): with the penalty's gradient when ``a``
    requires one (grad enabled), else ``a`` itself and a value. For a stacked activation of ``clients`` > 1 clients
    (:mod:`flatfl.models.stacking`), one term per client, (clients,)."""
    if clients > 1:
        if torch.is_grad_enabled() and a.requires_grad:
            return _ClientsActivationPenalty.apply(a, clients)
        return a, _client_mean_squares(a, clients)
    if torch.is_grad_enabled() and a.requires_grad:
        return _ActivationPenalty.apply(a)
    return a, _mean_square_value(a)


def sum_of_mean_squares(activations: list[torch.Tensor]) -> torch.Tensor:
    """sum_l mean(a_l ** 2) in the activations' dtype, summed in float64, with its gradient when any activation
    requires one."""
    return _sum_terms([penalised(a)[1] for a in activations], activations[0].dtype)


def _sum_terms(terms: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The layers' terms summed in float64 (0-d terms, or (M,) terms of M clients), cast to ``dtype``."""
    total = terms[0] if len(terms) == 1 else torch.stack(terms).sum(0)
    return total.to(dtype)


@REGULARIZERS.register
class MAN(Regularizer):
    name, display_name = "man", "MAN"
    summary = "MAN: CE + (zeta/2) * sum over layers of the mean squared post-non-linearity activation"
    hparams = (HParam("zeta", 0.15, "MAN weight as in the fedMAN code (--mu_mean): loss = CE + (zeta/2) * "
                      "sum_l mean(a_l^2); 0.15 CIFAR-100, 0.1 Tiny-ImageNet", check="nonnegative"),)

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._hooked: list[nn.Module] = []
        self._hooked_names: list[str] = []
        self._hooked_source: str | None = None
        self._handles: list = []
        self._terms: list[torch.Tensor] = []
        self._watched: list[tuple[torch.Tensor, int]] = []
        self._recording = False
        self._clients = 1  # how many clients' blocks the network being run stacks

    # ----- hooks -----
    def attach(self, model: nn.Module) -> None:
        """Hook ``model``'s activation modules (each network the engine trains: the model, a stacked network). A
        stacked network's are chosen on the plain network it was built from and found by name, so both hook the
        same activations whatever classes stacking gives their layers."""
        source = source_network(model)
        chosen = default_activation_modules(source)
        self._hooked_source = "activation_modules()" if callable(getattr(source, "activation_modules", None)) else None
        if not chosen:
            raise ConfigError(_NOTHING_TO_HOOK.format(name=type(source).__name__))
        try:
            modules = counterparts(model, chosen)
        except ValueError as e:
            raise ConfigError(f"MAN: {e}; activation_modules() must list modules of the model itself") from None
        if not self._hooked:
            self._hooked = modules
            names = {id(m): name for name, m in source.named_modules()}
            self._hooked_names = [names[id(m)] or "(model)" for m in chosen]
        owned = {id(m) for m in modules}

        def record(module: nn.Module, inputs, output):
            if not (self._recording and id(module) in owned and isinstance(output, torch.Tensor)):
                return None
            passed_on, term = penalised(output, self._clients)
            self._terms.append(term)
            self._watched.append((output, output._version))
            return passed_on

        for module in modules:
            if getattr(module, "inplace", False):
                module.inplace = False
            self._handles.append(module.register_forward_hook(record))

    def detach(self) -> None:
        """Remove the hooks (not needed by the engine; for tests and interactive use)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._hooked = []

    def record(self) -> dict:
        """The activation modules MAN penalises, by name in the network (``hooked_modules`` in config.json), and
        how they were chosen: the model's own ``activation_modules()`` or the fallback."""
        if not self._hooked:
            return {}
        source = self._hooked_source or "the non-linearity modules before the final linear layer"
        return {"hooked_modules": list(self._hooked_names), "chosen_by": source}

    @property
    def hooked_modules(self) -> list[nn.Module]:
        return list(self._hooked)

    def capture(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run ``model(x)`` recording this forward's activations only. Returns (logits, layer terms); the terms are
        values (no graph): :meth:`forward` gives the penalty its gradient."""
        logits, terms = self._capture(lambda: model(x))
        return logits, [t.detach().to(logits.dtype) for t in terms]

    def _capture(self, run, clients: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``run()`` (a forward pass of a network holding ``clients`` clients) with its activations recorded."""
        self._terms, self._watched = [], []
        self._recording = True
        self._clients = clients
        try:
            logits = run()
        except RuntimeError as e:  # an in-place change of a hooked activation that autograd refuses
            ours = any(c.__name__ in str(e) for c in (_ActivationPenalty, _ClientsActivationPenalty))
            if ours and "inplace" in str(e):
                raise ConfigError(_IN_PLACE) from None
            raise
        finally:
            self._recording = False
        terms, watched = self._terms, self._watched
        self._terms, self._watched = [], []
        if any(a._version != v for a, v in watched):
            raise ConfigError(_IN_PLACE)
        return logits, terms

    # ----- the loss -----
    def forward(self, step: StepContext) -> torch.Tensor:
        step.logits, terms = self._capture(lambda: step.model(step.x), step.m)
        loss = per_client_cross_entropy(step.logits, step.y)
        if not terms:
            return loss
        reg = _sum_terms(terms, step.logits.dtype).reshape(-1)
        step.scratch["man_reg"] = reg.detach()
        return loss + (self.zeta / 2.0) * reg


_NOTHING_TO_HOOK = ("MAN: {name} has no activation modules to penalise (its non-linearities are applied as "
                    "functions, e.g. F.relu in forward, or it has none): write them as modules (nn.ReLU(), each used "
                    "once) or give the model an activation_modules() method that lists the modules whose outputs MAN "
                    "penalises")

_IN_PLACE = ("MAN: the model changes a hooked activation in place after its non-linearity (e.g. `x += ...` after "
             "ReLU); MAN would penalise the changed tensor. Write the operation out of place or list the intended "
             "modules in activation_modules()")
