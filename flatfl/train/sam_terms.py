"""Pieces shared by the SAM-family algorithms (FedSMOO, FedGAMMA, FedLESAM; docs/update-rules.md §23-25); not an
algorithm module, so it lives beside them and registers nothing.

* :func:`linear_term` - a loss term of value 0 whose gradient is a given vector per client, so that an algorithm can
  steer the gradient a SAM-type optimizer sees in one of its passes (the loss closure is the only thing the optimizer
  computes its ascent from);
* :func:`sam_pass` - which pass of the local optimizer's closure a step is in (0 at theta, 1 at the SAM point);
* :func:`scaled_direction` - rho d / ||d|| in the global norm or the FedLESAM code's sum of tensor norms;
* :class:`Perturbed` - a point theta + eps set before the step's only gradient and theta restored exactly after it
  (FedLESAM's one-pass step).

All of them act on a cohort's (N, dim) rows (``step.cohort.layout``), so they work for clients trained together and
one at a time alike.
"""
from __future__ import annotations

import torch

from .context import StepContext


def linear_term(step: StepContext, vectors: torch.Tensor) -> torch.Tensor:
    """(M,) values, each exactly 0, whose gradient with respect to client k's parameters is ``vectors[k]``
    (``vectors``: (N, dim) rows, or one (dim,) vector for every client): the term <theta_k, v_k> minus its own
    value. Only the clients of the step (``step.rows``) get it."""
    layout = step.cohort.layout
    views = layout.views(vectors if vectors.dim() == 2 else vectors.unsqueeze(0))
    total = None
    for p, v in zip(layout.param_rows(), views):
        part = (p * v.to(p.dtype)).reshape(layout.n, -1).sum(1)
        total = part if total is None else total + part
    total = step.select(total)
    return total - total.detach()


def sam_pass(step: StepContext, key: str) -> int:
    """How many times the loss closure of this step has run before (0: the first pass, at theta; 1: the SAM
    optimizer's second pass, at theta + eps). Counted per step in ``step.scratch`` under ``key``."""
    seen = step.scratch.get(key, 0)
    step.scratch[key] = seen + 1
    return seen


def scaled_direction(direction: torch.Tensor, rho: float, norm: str, numels: list[int]) -> torch.Tensor:
    """rho d / (||d|| + 1e-7) for a direction d ((dim,) or (N, dim) rows), ``numels`` the parameter tensors' sizes in
    the flat order. ``norm``: 'global', the 2-norm of the whole vector; 'tensors', the sum of the parameter tensors'
    2-norms (the FedLESAM code's ``grad_norm``). A zero direction gives a zero perturbation."""
    rows = direction if direction.dim() == 2 else direction.unsqueeze(0)
    if norm == "global":
        size = torch.linalg.vector_norm(rows, dim=1)
    else:
        size = torch.stack([torch.linalg.vector_norm(part, dim=1) for part in torch.split(rows, numels, dim=1)]).sum(0)
    out = rows * (rho / (size + 1e-7)).unsqueeze(1)
    return out if direction.dim() == 2 else out[0]


class Perturbed:
    """The step's one gradient taken at theta + eps: :meth:`enter` (in ``prepare_batch``, before the closure) saves
    the cohort's parameters and adds ``eps`` ((N, dim) rows or one (dim,) vector) to every row; :meth:`leave` (in
    ``correct_gradient``, after the closure's backward and before the algorithm's gradient terms, clipping and the
    SGD step) copies theta back exactly. Clients that sit out the step are moved and restored too: their parameters
    end where they were."""

    KEY = "perturbed_theta"

    @staticmethod
    @torch.no_grad()
    def enter(step: StepContext, eps: torch.Tensor) -> None:
        layout = step.cohort.layout
        step.scratch[Perturbed.KEY] = [p.detach().clone() for p in layout.params]
        views = layout.views(eps if eps.dim() == 2 else eps.unsqueeze(0).expand(layout.n, -1))
        torch._foreach_add_(layout.param_rows(), [v.to(p.dtype) for v, p in zip(views, layout.param_rows())])

    @staticmethod
    @torch.no_grad()
    def leave(step: StepContext) -> None:
        saved = step.scratch.pop(Perturbed.KEY, None)
        if saved is not None:
            torch._foreach_copy_(step.cohort.layout.params, saved)
