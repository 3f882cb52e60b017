"""Local optimizers: how one local step turns a loss closure into a parameter update.

A :class:`LocalOptimizer` is built for each client each round (the FedDyn-family code builds a new SGD optimizer
every round). Its :meth:`step` receives

* ``closure()`` - zeroes the gradients, computes the local objective (cross-entropy + regularizer + the algorithm's
  loss terms) at the current parameters, backpropagates and returns the loss;
* ``correct()`` - adds the algorithm's parameter-dependent gradient terms (proximal, drift, control variates).

Plain SGD calls the closure once; SAM and ASAM call it again at the perturbed point, so every loss term enters both
passes with no code per combination. The order inside a step follows docs/update-rules.md section 0: gradient, algorithm
terms, clip to the global norm, then the SGD update with weight decay (and momentum) applied by torch's SGD.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from .components import LOCAL_OPTIMIZERS, Component, HParam
from ..models.stacking import StackedLayout


class LocalOptimizer(Component):
    kind: ClassVar[str] = "local optimizer"

    def __init__(self, layout: StackedLayout, *, lr: float, weight_decay: float | torch.Tensor = 0.0,
                 momentum: float = 0.0, nesterov: bool = False, clip: float = 0.0, hp: dict[str, Any] | None = None):
        """``layout``: the cohort's (N, dim) parameters; ``weight_decay`` a number, or an (N,) tensor when clients
        decay at different rates (FedDyn's alpha / w_i)."""
        self.layout = layout
        self.params = layout.params
        self.clip = clip
        for k, v in (hp or {}).items():
            setattr(self, k, v)
        self.sgd = RowSGD(layout, lr=lr, momentum=momentum, weight_decay=weight_decay,
                          nesterov=nesterov and momentum > 0)

    def clip_gradients(self) -> None:
        """Scale each client's gradient to global 2-norm at most ``clip`` (torch's clip_grad_norm_ rule per row)."""
        if self.clip <= 0:
            return
        if self.layout.n == 1:  # torch's own: parameters without a gradient keep none, so SGD skips them
            torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
            return
        grads = self.layout.grads(touch=False)
        coef = torch.clamp(self.clip / (self.layout.row_norms(grads) + 1e-6), max=1.0)
        torch._foreach_mul_(grads, [per_row(coef, g) for g in grads])

    def step(self, closure: Callable[[], torch.Tensor], correct: Callable[[], None],
             rows: torch.Tensor | None = None) -> torch.Tensor:
        """One local step of the clients ``rows`` (None: all); returns the closure's (M,) losses."""
        raise NotImplementedError

    def descend(self, correct: Callable[[], None], rows: torch.Tensor | None) -> None:
        """A step's end, once its gradient is in place: the algorithm's gradient terms, clipping, the SGD update."""
        correct()
        self.clip_gradients()
        self.sgd.step(rows)


def per_row(coef: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """An (N,) coefficient shaped to multiply an (N, ...) tensor row by row."""
    return coef.view(-1, *[1] * (t.dim() - 1)).to(t.dtype)


class RowSGD:
    """torch's SGD step (weight decay, momentum, Nesterov, in torch's order) applied to each client's row: a client
    decays at its own rate, and a step of some clients (``rows``) leaves the others' parameters and momentum as they
    are. With N = 1 (or every client stepping at one decay rate) it is torch's foreach SGD operation for operation;
    otherwise each stage is one foreach operation over the stacked parameters with per-client coefficients, (N,)
    tensors on the device (no loop over clients, no host synchronisation)."""

    def __init__(self, layout: StackedLayout, *, lr: float, momentum: float, weight_decay, nesterov: bool):
        self.layout = layout
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), nesterov
        wd = weight_decay
        if isinstance(wd, torch.Tensor) and bool((wd == wd[0]).all()):
            wd = float(wd[0])
        if isinstance(wd, torch.Tensor):  # per-client rates, cast once to the parameters' type
            wd = wd.to(layout.params[0].device, layout.params[0].dtype)
        self.weight_decay = wd  # a number, or an (N,) tensor
        self.bufs: dict[int, torch.Tensor] = {}  # momentum per parameter index (stacked layout)

    @torch.no_grad()
    def step(self, rows: torch.Tensor | None = None) -> None:
        if rows is not None and rows.numel() == self.layout.n:
            rows = None
        live = [k for k, p in enumerate(self.layout.params) if p.grad is not None]
        if not live:
            return
        if rows is None and not isinstance(self.weight_decay, torch.Tensor) and not self.layout.live:
            self._plain(live)
        else:
            self._rowwise(rows)

    def _plain(self, live: list[int]) -> None:
        """Every client at one decay rate: torch's foreach SGD on the stacked tensors (parameters without a
        gradient skipped, a momentum buffer started from the first gradient a parameter gets)."""
        params = [self.layout.params[k] for k in live]
        grads = [p.grad for p in params]
        if self.weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        if self.momentum != 0:
            if all(k in self.bufs for k in live):
                bufs = [self.bufs[k] for k in live]
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, grads, alpha=1.0)
            else:
                bufs = []
                for k, g in zip(live, grads):
                    if k not in self.bufs:
                        self.bufs[k] = g.detach().clone()
                    else:
                        self.bufs[k].mul_(self.momentum).add_(g, alpha=1.0)
                    bufs.append(self.bufs[k])
            if self.nesterov:
                torch._foreach_add_(grads, bufs, alpha=self.momentum)
            else:
                grads = bufs
        torch._foreach_add_(params, grads, alpha=-self.lr)

    def _rowwise(self, rows: torch.Tensor | None) -> None:
        """Clients at their own decay rates, only the clients ``rows`` stepping, or rows without a gradient
        (``layout.live``): per-client coefficients over the stacked tensors. A client that sits out, or a row that
        got no gradient, gets coefficient 0 (parameters and momentum stay exactly as they are, as torch's SGD skips
        a parameter without a gradient); a client's first momentum buffer is its first gradient (torch's rule)."""
        lay = self.layout
        params, grads = lay.param_rows(), lay.grads(touch=False)
        dtype = params[0].dtype
        wd = self.weight_decay
        if isinstance(wd, torch.Tensor):
            d = torch._foreach_addcmul(grads, params, [per_row(wd, p) for p in params])
        elif wd != 0:
            d = torch._foreach_add(grads, params, alpha=wd)
        else:
            d = grads
        on = None  # (N,) 1 for the clients that step, 0 for those that sit out
        dev = params[0].device
        if rows is not None:
            on = torch.zeros(lay.n, device=dev, dtype=dtype).index_fill_(0, rows.to(dev), 1.0)
        masked = on is not None or bool(lay.live)
        ons = [on] * len(params)  # per parameter: the stepping clients less the rows it has no gradient in
        if masked:
            ons = [torch.ones(lay.n, device=dev, dtype=dtype) if on is None else on] * len(params)
            stepping: dict[int, torch.Tensor] = {}  # one per live mask (a block's parameters share theirs)
            for k, live in lay.live.items():
                if id(live) not in stepping:
                    mask = live.to(dev, dtype)
                    stepping[id(live)] = mask if on is None else mask * on
                ons[k] = stepping[id(live)]
        distinct = list({id(o): o for o in ons}.values())
        if self.momentum != 0:
            # a buffer not yet started is zero, so momentum * buf + g is torch's first buffer, g
            if not self.bufs:
                self.bufs = {k: torch.zeros_like(p) for k, p in enumerate(lay.params)}
            bufs = [lay.rows(self.bufs[k], s) for k, s in enumerate(lay.shapes)]
            if not masked:
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, d)
            else:  # buf <- momentum * buf + g on the stepping rows, unchanged on the others
                keeps = {id(o): o * self.momentum + (1.0 - o) for o in distinct}
                torch._foreach_mul_(bufs, [per_row(keeps[id(o)], b) for o, b in zip(ons, bufs)])
                torch._foreach_addcmul_(bufs, d, [per_row(o, b) for o, b in zip(ons, bufs)])
            d = torch._foreach_add(d, bufs, alpha=self.momentum) if self.nesterov else bufs
        if not masked:
            torch._foreach_add_(params, d, alpha=-self.lr)
        else:
            steps = {id(o): o * -self.lr for o in distinct}
            torch._foreach_addcmul_(params, d, [per_row(steps[id(o)], p) for o, p in zip(ons, params)])


@LOCAL_OPTIMIZERS.register
class SGD(LocalOptimizer):
    name, display_name = "sgd", "SGD"
    summary = "plain local SGD (momentum and Nesterov through --momentum / --nesterov)"

    def step(self, closure, correct, rows=None):
        loss = closure()
        self.descend(correct, rows)
        return loss


@LOCAL_OPTIMIZERS.register
class SAM(LocalOptimizer):
    """Sharpness-aware minimization as a local optimizer (Foret et al. 2021; FedSAM; docs/update-rules.md section 8).

    One step, for each client (row) of the cohort::

        g   = grad of the local objective at theta          (closure, first pass)
        eps = rho * g / (||g|| + 1e-16)                     (:meth:`perturbation`; ||.|| the client's global norm)
        g~  = grad of the local objective at theta + eps    (closure, second pass)
        theta restored exactly; the algorithm's correct() adds its terms at theta; clip; SGD step along g~

    The MAN/SAMC minimizers also clip g before the ascent; the ascent direction is invariant to that rescaling, so
    it is not done here. theta is restored from a saved copy rather than by subtracting eps, so the step starts
    exactly at theta (ASD's FedSpeed never removes the perturbation: a bug not copied). The returned loss is the
    first pass's, at theta. Gradient terms added by ``correct()`` (FedDyn, SCAFFOLD, FedSpeed's correction, ...)
    are not part of the ascent direction: they are evaluated once, at the unperturbed theta, as in the FedSpeed
    and MoFedSAM code; loss terms of the closure (regularizers, MOON, FedNTD) enter both passes.
    """

    name, display_name = "sam", "SAM"
    summary = "SAM: gradient at theta + rho g/||g||, then an SGD step from theta (two forward/backward passes)"
    hparams = (HParam("rho", 0.05, "SAM/ASAM radius rho (SAM: MAN --search_param 0.05; SAMC CIFAR-10 0.1; "
                      "ASAM: MAN 0.5)", check="nonnegative"),)

    def perturbation(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """eps = rho g / (||g|| + 1e-16), per client, ||.|| its global 2-norm over all parameters ((N, ...) rows)."""
        factor = self.rho / (self.layout.row_norms(grads) + 1e-16)
        return [g * per_row(factor, g) for g in grads]

    def step(self, closure, correct, rows=None):
        loss = closure()
        with torch.no_grad():
            theta = [p.detach().clone() for p in self.params]
            eps = self.perturbation(self.layout.grads())
            torch._foreach_add_(self.layout.param_rows(), eps)
        closure()
        with torch.no_grad():
            torch._foreach_copy_(self.params, theta)
        self.descend(correct, rows)
        return loss


@LOCAL_OPTIMIZERS.register
class ASAM(SAM):
    """Adaptive SAM (Kwon et al. 2021; FedASAM; docs/update-rules.md section 8): the ascent is taken in the metric of
    T_w = |w| + eta (element-wise) for every parameter tensor whose name contains "weight", T = 1 for the others
    (biases)::

        eps = rho * T^2 g / ||T g||      (+1e-16 in the denominator)

    Everything else is the SAM step. MAN defaults (rho, eta) = (0.5, 0.2); (0.1, 0.2) for its IID runs; SAMC's
    CIFAR-10 script uses (0.7, 0.2).
    """

    name, display_name = "asam", "ASAM"
    summary = "ASAM: SAM with the ascent scaled by T = |w| + eta on weight tensors"
    hparams = (HParam("rho", 0.5, "SAM/ASAM radius rho (SAM: MAN --search_param 0.05; ASAM: MAN 0.5)",
                      check="nonnegative"),
               HParam("eta", 0.2, "ASAM offset eta in T_w = |w| + eta (MAN and SAMC: 0.2)", check="nonnegative"))

    def perturbation(self, grads):
        scales = [p.detach().abs() + self.eta if "weight" in name else None
                  for name, p in zip(self.layout.names, self.layout.param_rows())]
        scaled = [g * t if t is not None else g for g, t in zip(grads, scales)]  # T g
        factor = self.rho / (self.layout.row_norms(scaled) + 1e-16)
        return [(t * tg if t is not None else tg) * per_row(factor, tg) for t, tg in zip(scales, scaled)]
