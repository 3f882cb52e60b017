"""MAN: minimize the layer-wise activation norm (Yashwanth et al.; MAN paper Eq. 15-18; algorithms.md §16).

Local loss, exactly as the official fedMAN code computes it::

    loss = CE + (zeta / 2) * Reg,    Reg = sum_l mean_b mean_elements(a_l ** 2)

where a_l runs over the model's post-non-linearity activations (``model.activation_modules()``; the logits are
never among them). Each layer term is the per-sample mean of squares over all non-batch elements, averaged over the
batch (Eq. 17 for convolutional maps, Eq. 18 for fully connected layers); the terms are summed over layers (Eq. 16).

The weight: the paper writes f_k = L_k + zeta * L_act (Eq. 15), the code adds ``mu_mean / 2 * Reg``.
``--zeta`` is the code's ``--mu_mean``, so the published values (zeta = 0.15 on CIFAR-100, 0.1 on Tiny-ImageNet,
README; 0.2 in the shipped Tiny-ImageNet scripts) mean here what they meant there: loss = CE + (zeta/2) * Reg.
Default 0.15 (the CIFAR-100 value).

Activations are captured by forward hooks installed once in :meth:`MAN.attach`. A hook records only while MAN's own
forward pass runs and only for the module instances it was installed on, so a deep copy of the model (a teacher,
the frozen global model, an algorithm's extra forward) never adds terms; the list is cleared at every forward, so
SAM's two passes each see exactly their own activations. Hooked activation modules are switched to
``inplace=False``, and a hook stores the activation with its version counter: a model that later changes one in
place (``x += ...`` after a ReLU) gets a clear error instead of a silently different penalty.

Cost. A hook only appends the output; the penalty is then one autograd node for all layers
(:class:`_SumOfMeanSquares`): its forward is one multi-tensor norm (a layer over 65,536 elements is reduced in
blocks whose squares are summed in float64, so the logged value stays within 1e-7 of float64 at 25M elements), its
backward one multi-tensor scale writing ``zeta / numel * a`` into each activation's gradient. That is the least
arithmetic the penalty allows, with no per-layer autograd or dispatch bookkeeping, which matters on small networks whose steps take a millisecond.

Models without ``activation_modules()`` fall back to every element-wise non-linearity module (ReLU, GELU, tanh, ...)
registered before the final linear layer.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..components import REGULARIZERS, HParam
from ..context import StepContext
from .base import Regularizer

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
    return _sum_of_mean_squares_value([a])


class _SumOfMeanSquares(torch.autograd.Function):
    """sum_l mean(a_l ** 2) over all layers as one autograd node; backward d/da_l = 2 a_l / numel(a_l)."""

    @staticmethod
    def forward(ctx, *activations: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*activations)
        return _sum_of_mean_squares_value(activations)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        out = torch._foreach_mul(saved, grad)  # one dispatch for all layers, then the per-layer 2 / numel
        torch._foreach_mul_(out, [2.0 / a.numel() for a in saved])
        return tuple(out)


#: activations larger than this are reduced in blocks of this many elements (see _sum_of_mean_squares_value)
_BLOCK = 1 << 16


def _sum_of_mean_squares_value(activations) -> torch.Tensor:
    """sum_l ||a_l||^2 / numel(a_l). torch's float32 norm accumulates a long tensor in a few running float32 sums:
    1e-2 relative error at 25M elements. Layers up to ``_BLOCK`` elements (every layer of a small network) take one
    multi-tensor norm as before; a larger layer is reduced as rows of ``_BLOCK`` elements (one kernel, the same
    arithmetic as one norm), and the row norms are squared and summed in float64: within 1e-7 of float64 at 25M
    elements, at the speed of the plain norm (tests/test_regularizers.py)."""
    acts = [a.detach() for a in activations]
    small = [a for a in acts if a.numel() <= _BLOCK]
    value = None
    if small:
        norms = torch._foreach_norm(small)  # one reduction dispatch for all small layers
        scale = torch.tensor([1.0 / a.numel() for a in small], dtype=norms[0].dtype, device=norms[0].device)
        value = torch.dot(torch.stack(norms).square(), scale).double()
    for a in acts:
        n = a.numel()
        if n <= _BLOCK:
            continue
        flat, m = a.reshape(-1), n // _BLOCK
        rows = [torch.linalg.vector_norm(flat[:m * _BLOCK].view(m, _BLOCK), dim=1)]
        if n > m * _BLOCK:
            rows.append(torch.linalg.vector_norm(flat[m * _BLOCK:]).reshape(1))
        r = torch.cat(rows).double() if len(rows) > 1 else rows[0].double()
        term = torch.dot(r, r) / n
        value = term if value is None else value + term
    return value.to(acts[0].dtype)


def sum_of_mean_squares(activations: list[torch.Tensor]) -> torch.Tensor:
    """sum_l mean(a_l ** 2) with its gradient (when any activation requires one), as one autograd node."""
    if torch.is_grad_enabled() and any(a.requires_grad for a in activations):
        return _SumOfMeanSquares.apply(*activations)
    return _sum_of_mean_squares_value(activations)


@REGULARIZERS.register
class MAN(Regularizer):
    name = "man"
    display_name = "MAN"
    summary = "MAN: CE + (zeta/2) * sum over layers of the mean squared post-non-linearity activation"
    hparams = (HParam("zeta", 0.15, "MAN weight as in the fedMAN code (--mu_mean): loss = CE + (zeta/2) * "
                      "sum_l mean(a_l^2); 0.15 CIFAR-100, 0.1 Tiny-ImageNet", check="nonnegative"),)

    def __init__(self, hp: dict[str, Any], *, num_classes: int, config: Any = None):
        super().__init__(hp, num_classes=num_classes, config=config)
        self._hooked: list[nn.Module] = []
        self._handles: list = []
        self._activations: list[torch.Tensor] = []
        self._versions: list[int] = []
        self._recording = False

    # ----- hooks -----
    def attach(self, model: nn.Module) -> None:
        self.detach()
        self._hooked = default_activation_modules(model)
        owned = {id(m) for m in self._hooked}

        def record(module: nn.Module, inputs, output) -> None:
            if self._recording and id(module) in owned and isinstance(output, torch.Tensor):
                self._activations.append(output)
                self._versions.append(output._version)

        for module in self._hooked:
            if getattr(module, "inplace", False):
                module.inplace = False
            self._handles.append(module.register_forward_hook(record))

    def detach(self) -> None:
        """Remove the hooks (not needed by the engine; for tests and interactive use)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def hooked_modules(self) -> list[nn.Module]:
        return list(self._hooked)

    def capture(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run ``model(x)`` recording this forward's activations only. Returns (logits, layer terms); the terms are
        values (no graph): :meth:`forward` gives the penalty its gradient."""
        logits, activations = self._capture(model, x)
        return logits, [mean_square(a) for a in activations]

    def _capture(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self._activations, self._versions = [], []
        self._recording = True
        try:
            logits = model(x)
        finally:
            self._recording = False
        activations, versions = self._activations, self._versions
        self._activations, self._versions = [], []
        for a, v in zip(activations, versions):
            if a._version != v:
                raise ConfigError("MAN: the model changes a hooked activation in place after its non-linearity "
                                  "(e.g. `x += ...` after ReLU); MAN would penalise the changed tensor. Write the "
                                  "operation out of place or list the intended modules in activation_modules()")
        return logits, activations

    # ----- the loss -----
    def forward(self, step: StepContext) -> torch.Tensor:
        step.logits, activations = self._capture(step.model, step.x)
        loss = torch.nn.functional.cross_entropy(step.logits, step.y)
        if not activations:
            return loss
        reg = sum_of_mean_squares(activations)
        step.scratch["man_reg"] = reg.detach()
        return loss + (self.zeta / 2.0) * reg
