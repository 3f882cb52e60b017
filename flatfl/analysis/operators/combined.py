"""Operators made of others: a multiple ``c A`` (:class:`ScaledOperator`), a sum ``A + B + ...``
(:class:`SumOperator`), the identity (:class:`IdentityOperator`) and, of them, the damped curvature ``A + lambda I``
(:func:`damped`): the Hessian of a loss plus ``(lambda / 2) ||theta||^2`` (weight decay), a damped Gauss-Newton matrix
as second-order optimizers use it (``flatfl hessian --damping``). Each is a fixed symmetric linear map when its
terms are, so every estimator runs on it unchanged.

What each keeps of the contract (:mod:`.linear_operator`):

* ``hvps``: the terms' products (the identity computes none); ``on_hvp`` is called with the products of each block;
* the parameter layout and names of the first term that has one (a model's curvature);
* ``products`` and ``product_error``: the model terms' product method, and the largest stated relative error of a
  term (read from the terms when asked: a finite-difference term states its error after its first product). Relative to a sum's product that is a bound only when the terms do not cancel; ``product_error_along``
  measures the sum's own error where the estimators ask (the terms' errors along the directions, each weighted by
  its product's norm, over the norm of the sum's product);
* ``exact_trace``: the terms' exact traces, scaled and summed per parameter block, their rounding bounds summed
  (plus the rounding of the sum itself); the identity's is each block's size, exactly.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ...errors import ConfigError
from .linear_operator import CurvatureOperator, DerivedOperator, TransformedOperator

__all__ = ["ScaledOperator", "SumOperator", "IdentityOperator", "damped"]


def _trace_of(per_param: torch.Tensor, error: float, passes: int):
    from .exact_trace import ExactTrace

    return ExactTrace(per_param, float(error), int(passes))


class IdentityOperator(DerivedOperator):
    """``I`` on the flat vectors of ``like`` (its ``dim``, ``dtype``, ``device`` and parameter layout); its products
    cost nothing and count no ``hvps``."""

    def __init__(self, like: CurvatureOperator) -> None:
        super().__init__(like)
        self.param_names = like.param_names

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(V).to(device=self.device, dtype=self.dtype).clone()

    def exact_trace(self, seed: int = 0):
        """``dim``, exactly: each parameter block's size (the exact traces' ``per_param``: per block, on the CPU)."""
        sizes = [math.prod(shape) for shape in self.param_shapes]
        return _trace_of(torch.tensor(sizes, dtype=torch.float64), 0.0, 0)


class ScaledOperator(TransformedOperator):
    """``scale * op`` (``scale`` a finite number): its products are ``op``'s times ``scale``, with ``op``'s relative
    error."""

    def __init__(self, op: CurvatureOperator, scale: float) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ConfigError(f"an operator's scale must be a finite number, got {scale!r}")
        super().__init__(op)
        self.scale = float(scale)
        self.param_names = op.param_names

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        return self.scale * self.op.matmat(V)

    def exact_trace(self, seed: int = 0):
        inner = self.op.exact_trace(seed)
        return _trace_of(self.scale * inner.per_param, abs(self.scale) * inner.error, inner.passes)


class SumOperator(DerivedOperator):
    """``terms[0] + terms[1] + ...``: operators of the same ``dim``, ``dtype`` and ``device`` (one ConfigError line
    otherwise). ``op``, whose layout and block size it keeps, is the first term with a parameter layout (else the
    first)."""

    def __init__(self, terms: Sequence[CurvatureOperator]) -> None:
        terms = list(terms)
        if not terms:
            raise ConfigError("a sum of operators needs at least one term")
        first = terms[0]
        for t in terms[1:]:
            if (t.dim, t.dtype, torch.device(t.device)) != (first.dim, first.dtype, torch.device(first.device)):
                raise ConfigError(f"the terms of a sum must act on the same vectors: {first.dim} {first.dtype} on "
                                  f"{first.device} and {t.dim} {t.dtype} on {t.device}")
        super().__init__(next((t for t in terms if t.has_param_layout), first))
        self.terms = terms
        self.param_names = self.op.param_names
        self.on_hvp = None

    @property
    def hvps(self) -> int:
        """The products of the operators under the terms, each counted once (``A + c A`` computes ``A``'s twice,
        both counted by ``A``)."""
        return sum(t.hvps for t in {id(t.product_source): t.product_source for t in self.terms}.values())

    @property
    def products(self) -> str | None:
        methods = list(dict.fromkeys(t.products for t in self.terms if t.products is not None))
        return " + ".join(methods) if methods else None

    @property
    def product_error(self) -> float | None:
        """The largest stated error of a term, read when asked (a finite-difference operator states it after its
        first product)."""
        errors = [t.product_error for t in self.terms if t.product_error is not None]
        return max(errors) if errors else None

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        before = self.hvps
        out = self.terms[0].matmat(V)
        for t in self.terms[1:]:
            out = out + t.matmat(V)
        if self.on_hvp is not None:
            self.on_hvp(self.hvps - before)
        return out

    def product_error_along(self, V: torch.Tensor) -> float | None:
        """The largest over ``V``'s columns of ``sum_t e_t ||T_t v|| / ||sum_t T_t v||`` (``e_t``: term t's error
        measured along v; the terms' products counted); None when every term's products are exact."""
        before = self.hvps
        errors = [t.product_error_along(V) for t in self.terms]
        if all(e is None for e in errors):
            return None
        products = [t.matmat(V) for t in self.terms]
        if self.on_hvp is not None:
            self.on_hvp(self.hvps - before)
        absolute = sum((e or 0.0) * P.double().norm(dim=0) for e, P in zip(errors, products))
        whole = torch.stack(products).sum(0).double().norm(dim=0)
        ratio = absolute / whole.clamp_min(torch.finfo(torch.float64).tiny)
        return float(ratio.max())

    def exact_trace(self, seed: int = 0):
        parts = [t.exact_trace(seed) for t in self.terms]
        per_param = torch.stack([p.per_param.to("cpu", torch.float64) for p in parts]).sum(0)
        rounding = len(parts) * torch.finfo(torch.float64).eps * float(per_param.abs().sum())
        return _trace_of(per_param, sum(p.error for p in parts) + rounding, sum(p.passes for p in parts))

    def release(self) -> None:
        for t in self.terms:
            t.release()


def damped(op: CurvatureOperator, damping: float) -> CurvatureOperator:
    """``op + damping * I`` (``damping`` >= 0; ``op`` itself for 0): every eigenvalue moved up by ``damping``, the
    trace by ``damping * dim``."""
    if isinstance(damping, bool) or not isinstance(damping, (int, float)) or not math.isfinite(damping) or \
            damping < 0:
        raise ConfigError(f"the damping must be a finite number >= 0, got {damping!r}")
    if damping == 0:
        return op
    return SumOperator([op, ScaledOperator(IdentityOperator(op), damping)])
