"""Local optimizers: how one local step turns a loss closure into a parameter update.

A :class:`LocalOptimizer` is built for each client each round (the FedDyn-family code builds a new SGD optimizer
every round). Its :meth:`step` receives

* ``closure()`` - zeroes the gradients, computes the local objective (cross-entropy + regularizer + the algorithm's
  loss terms) at the current parameters, backpropagates and returns the loss;
* ``correct()`` - adds the algorithm's parameter-dependent gradient terms (proximal, drift, control variates).

Plain SGD calls the closure once; SAM and ASAM call it again at the perturbed point, so every loss term enters both
passes with no code per combination. The order inside a step follows algorithms.md section 0: gradient, algorithm
terms, clip to the global norm, then the SGD update with weight decay (and momentum) applied by torch's SGD.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from .components import LOCAL_OPTIMIZERS, Component, HParam
from ..models.params import ParamLayout


class LocalOptimizer(Component):
    kind: ClassVar[str] = "local optimizer"

    def __init__(self, layout: ParamLayout, *, lr: float, weight_decay: float = 0.0, momentum: float = 0.0,
                 nesterov: bool = False, clip: float = 0.0, hp: dict[str, Any] | None = None):
        self.layout = layout
        self.params = layout.params
        self.clip = clip
        for k, v in (hp or {}).items():
            setattr(self, k, v)
        self.sgd = torch.optim.SGD(self.params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                   nesterov=nesterov and momentum > 0, foreach=True)

    def clip_gradients(self) -> None:
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)

    def step(self, closure: Callable[[], torch.Tensor], correct: Callable[[], None]) -> torch.Tensor:
        raise NotImplementedError


@LOCAL_OPTIMIZERS.register
class SGD(LocalOptimizer):
    name = "sgd"
    display_name = "SGD"
    summary = "plain local SGD (momentum and Nesterov through --momentum / --nesterov)"

    def step(self, closure, correct):
        loss = closure()
        correct()
        self.clip_gradients()
        self.sgd.step()
        return loss


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all tensors together, as a 0-d tensor (no host synchronisation)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


@LOCAL_OPTIMIZERS.register
class SAM(LocalOptimizer):
    """Sharpness-aware minimization as a local optimizer (Foret et al. 2021; FedSAM; algorithms.md section 8).

    One step::

        g   = grad of the local objective at theta          (closure, first pass)
        eps = rho * g / (||g|| + 1e-16)                     (:meth:`perturbation`)
        g~  = grad of the local objective at theta + eps    (closure, second pass)
        theta restored exactly; the algorithm's correct() adds its terms at theta; clip; SGD step along g~

    The MAN/SAMC minimizers also clip g before the ascent; the ascent direction is invariant to that rescaling, so
    it is not done here. theta is restored from a saved copy rather than by subtracting eps, so the step starts
    exactly at theta (ASD's FedSpeed never removes the perturbation: a bug not copied). The returned loss is the
    first pass's, at theta. Gradient terms added by ``correct()`` (FedDyn, SCAFFOLD, FedSpeed's correction, ...)
    are not part of the ascent direction: they are evaluated once, at the unperturbed theta, as in the FedSpeed
    and MoFedSAM code; loss terms of the closure (regularizers, MOON, FedNTD) enter both passes.
    """

    name = "sam"
    display_name = "SAM"
    summary = "SAM: gradient at theta + rho g/||g||, then an SGD step from theta (two forward/backward passes)"
    hparams = (HParam("rho", 0.05, "SAM/ASAM radius rho (SAM: MAN --search_param 0.05; SAMC CIFAR-10 0.1; "
                      "ASAM: MAN 0.5)", check="nonnegative"),)

    def perturbation(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """eps = rho g / (||g|| + 1e-16), ||.|| the global 2-norm over all parameters."""
        return torch._foreach_mul(grads, self.rho / (global_norm(grads) + 1e-16))

    def step(self, closure, correct):
        loss = closure()
        with torch.no_grad():
            theta = [p.detach().clone() for p in self.params]
            eps = self.perturbation(self.layout.grads())
            torch._foreach_add_(self.params, eps)
        closure()
        with torch.no_grad():
            torch._foreach_copy_(self.params, theta)
        correct()
        self.clip_gradients()
        self.sgd.step()
        return loss


@LOCAL_OPTIMIZERS.register
class ASAM(SAM):
    """Adaptive SAM (Kwon et al. 2021; FedASAM; algorithms.md section 8): the ascent is taken in the metric of
    T_w = |w| + eta (element-wise) for every parameter tensor whose name contains "weight", T = 1 for the others
    (biases)::

        eps = rho * T^2 g / ||T g||      (+1e-16 in the denominator)

    Everything else is the SAM step. MAN defaults (rho, eta) = (0.5, 0.2); (0.1, 0.2) for its IID runs; SAMC's
    CIFAR-10 script uses (0.7, 0.2).
    """

    name = "asam"
    display_name = "ASAM"
    summary = "ASAM: SAM with the ascent scaled by T = |w| + eta on weight tensors"
    hparams = (HParam("rho", 0.5, "SAM/ASAM radius rho (SAM: MAN --search_param 0.05; ASAM: MAN 0.5)",
                      check="nonnegative"),
               HParam("eta", 0.2, "ASAM offset eta in T_w = |w| + eta (MAN and SAMC: 0.2)", check="nonnegative"))

    def perturbation(self, grads):
        scales = [p.detach().abs() + self.eta if "weight" in name else None
                  for name, p in zip(self.layout.names, self.params)]
        scaled = [g * t if t is not None else g for g, t in zip(grads, scales)]  # T g
        factor = self.rho / (global_norm(scaled) + 1e-16)
        return [(t * tg if t is not None else tg) * factor for t, tg in zip(scales, scaled)]
