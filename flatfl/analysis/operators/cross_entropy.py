"""The Hessian of cross-entropy in the model's outputs, applied in closed form: the Gauss-Newton products of
:mod:`.curvatures` for a criterion that is recognisably cross-entropy, at O(C) per sample and vector for C classes.

For one sample (or one position of a sequence) with scores ``z`` over C classes and ``p = softmax(z)``, every
cross-entropy torch computes is ``a * logsumexp(z)`` plus a term linear in ``z``: class-index targets with class
weights ``w``, ``ignore_index`` and label smoothing ``eps`` give ``a = ((1 - eps) w_y + (eps / C) sum_c w_c) / D``
(0 for an ignored sample), probability targets ``t`` give ``a = sum_c w_c t'_c / D`` with ``t' = (1 - eps) t + eps
/ C``, and ``D`` is the reduction's divisor (``sum`` 1; ``mean`` the summed weights ``w_y`` of the samples not
ignored, or, for probability targets, the number of samples and positions). So its Hessian in ``z`` is
``a (diag(p) - p p^T)`` and

    H_out u = a (p * u - p (p . u))

per sample: two elementwise products and one sum over the classes, never a C x C matrix and no graph. Recognised:
``torch.nn.functional.cross_entropy`` itself and ``torch.nn.CrossEntropyLoss`` (the class itself, not a subclass)
with reduction ``mean`` or ``sum``; any other criterion, and a criterion whose value on a batch's outputs is not
``F.cross_entropy``'s with its settings (a forward hook, say), goes through the general double backward of
:class:`~flatfl.analysis.operators.curvatures.OutputHessian`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["CrossEntropyForm", "SoftmaxHessian", "cross_entropy_form"]


@dataclass(frozen=True)
class CrossEntropyForm:
    """The settings of a recognised cross-entropy criterion (those of ``F.cross_entropy``)."""

    weight: torch.Tensor | None
    ignore_index: int
    reduction: str
    label_smoothing: float

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``F.cross_entropy`` with these settings: what the criterion must give for the closed form to hold."""
        return F.cross_entropy(outputs, targets, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


def cross_entropy_form(loss_fn: Callable | None) -> CrossEntropyForm | None:
    """The settings of ``loss_fn`` when it is ``F.cross_entropy`` or a ``nn.CrossEntropyLoss`` (not a subclass) with
    reduction ``mean`` or ``sum``; None for any other criterion."""
    if loss_fn is F.cross_entropy:
        return CrossEntropyForm(None, -100, "mean", 0.0)
    if type(loss_fn) is torch.nn.CrossEntropyLoss and loss_fn.reduction in ("mean", "sum"):
        return CrossEntropyForm(loss_fn.weight, int(loss_fn.ignore_index), loss_fn.reduction,
                                float(loss_fn.label_smoothing))
    return None


class SoftmaxHessian:
    """``H_out U`` of a recognised cross-entropy on one batch's ``outputs`` (scores, classes along dimension 1, or
    0 for one unbatched sample) and ``targets``: the softmax ``p`` and each sample's coefficient ``a`` (module
    docstring), computed once; a product costs O(C) per sample and vector."""

    def __init__(self, form: CrossEntropyForm, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        outputs = outputs.detach()
        self.class_dim = 1 if outputs.dim() >= 2 else 0
        self.probabilities = torch.softmax(outputs, dim=self.class_dim)
        #: ``a`` per sample (and position), the class dimension kept as size 1 to broadcast over the classes
        self.coefficients = self.coefficients_of(form, outputs, targets.detach()).unsqueeze(self.class_dim)

    def coefficients_of(self, form: CrossEntropyForm, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``a``: the weight of ``logsumexp(z)`` in each sample's (and position's) term of the loss."""
        classes, eps, dim = outputs.shape[self.class_dim], form.label_smoothing, self.class_dim
        weight = form.weight.to(outputs) if form.weight is not None else None
        if targets.is_floating_point():  # probabilities over the classes, shaped as the outputs
            smoothed = targets.to(outputs) * (1.0 - eps) + eps / classes
            if weight is not None:
                smoothed = smoothed * weight.view([classes] + [1] * (outputs.dim() - dim - 1))
            divisor = outputs.numel() / classes if form.reduction == "mean" else 1.0
            return smoothed.sum(dim) / divisor
        kept = targets != form.ignore_index
        if weight is None:
            target_weight = kept.to(outputs.dtype)
            total = float(classes)
        else:
            target_weight = weight[torch.where(kept, targets, torch.zeros_like(targets))] * kept
            total = weight.sum()
        raw = ((1.0 - eps) * target_weight + (eps / classes) * total) * kept
        return raw / target_weight.sum() if form.reduction == "mean" else raw

    def products(self, U: torch.Tensor) -> torch.Tensor:
        """``H_out u = a (p * u - p (p . u))`` for each row ``u`` of ``U`` (k, *outputs.shape)."""
        p = self.probabilities
        result = p * U
        totals = result.sum(dim=self.class_dim + 1, keepdim=True)
        result.addcmul_(p, totals, value=-1.0)
        return result.mul_(self.coefficients)

    def worst_coefficient(self) -> tuple[float, int] | None:
        """``(a, flat index)`` of the first coefficient that is negative or not finite (class weights or
        probability targets below zero make the loss concave there); None when every one is finite and >= 0."""
        flat = self.coefficients.reshape(-1)
        bad = torch.nonzero(~torch.isfinite(flat) | (flat < 0))
        if len(bad) == 0:
            return None
        at = int(bad[0, 0])
        return float(flat[at]), at
