"""Trace and diagonal of a Hessian operator by randomised probing (docs/analysis-protocols.md §3 and §5).

* :func:`hutchinson_trace`: the mean of ``z^T H z`` over Rademacher vectors z (Hutchinson 1989), with its standard
  error ``std(samples) / sqrt(count)``; stops at a target relative standard error or an HVP budget.
* :func:`hutchpp_trace`: Hutch++ (Meyer, Musco, Musco & Woodruff 2021, Algorithm 1). A sketch ``Q = orth(H S)`` of
  ``s`` Rademacher vectors captures the top of the spectrum, whose trace ``tr(Q^T H Q)`` is computed exactly
  (``s`` more products); Hutchinson then estimates ``tr((I - QQ^T) H (I - QQ^T))`` on what is left. With a budget of
  ``m`` products the paper's split is ``s = m / 3``. The standard error is that of the Hutchinson part (the sketch
  part has no variance given Q, and the estimate is unbiased given Q).
* :func:`pyhessian_trace`: PyHessian's ``hessian.trace`` rule step for step (Rademacher draws per parameter, the
  same as PyHessian's after ``torch.manual_seed(seed)``; stop when ``|mean - previous mean| / (previous mean + 1e-6)
  < tol``; at most ``max_iter`` samples). Note that the denominator has no absolute value: a negative running mean
  stops it at the second sample (docs/analysis-protocols.md §3). flatfl adds the standard error PyHessian does not report.
* :func:`hutchinson_diagonal`: the per-coordinate diagonal ``E[z * Hz]`` (Bekas, Kokiopoulou & Saad 2007) with a
  per-coordinate standard error, for the cross-client metrics (FedAlign Eq. 3-4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import ConfigError
from ..operators.linear_operator import CurvatureOperator, as_operator, block_size_for
from ..operators.vectors import random_block, seeded_generator
from .eigen import rounding_floor

__all__ = ["TraceResult", "target_info", "hutchinson_trace", "hutchpp_trace", "pyhessian_trace", "exact_trace",
           "hutchinson_diagonal", "probe_samples", "standard_error"]


@dataclass
class TraceResult:
    """A trace estimate with its standard error and the number of Hessian-vector products spent."""

    estimate: float
    stderr: float
    hvps: int
    method: str
    samples: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    info: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "stderr": self.stderr, "hvps": self.hvps, "method": self.method,
                "samples": len(self.samples), **self.info}


def standard_error(samples) -> float:
    """The standard error of the mean of ``samples`` (NaN for fewer than two)."""
    samples = np.asarray(samples, dtype=float)
    if samples.size < 2:
        return math.nan
    return float(np.std(samples, ddof=1) / math.sqrt(samples.size))


def target_info(estimate: float, stderr: float, rtol: float | None) -> dict:
    """What a relative-error target bought: ``{"target_rtol", "relative_stderr", "target_reached"}`` (empty
    without a target; ``relative_stderr`` None where there is none: one sample, or a spread around 0; a standard error
    of 0 reaches any target). A target not reached means the budget stopped the estimator: every product was spent and the
    error is still above what was asked (the result and ``flatfl hessian``'s trace line say so)."""
    if rtol is None:
        return {}
    relative = 0.0 if stderr == 0 else stderr / abs(estimate) if estimate and math.isfinite(stderr) else math.inf
    if not math.isfinite(relative):
        relative = None  # no standard error (one sample), or a spread around an estimate of 0
    return {"target_rtol": float(rtol), "relative_stderr": relative,
            "target_reached": relative is not None and relative <= rtol}


def _check_budget(max_hvps, rtol, min_samples):
    if max_hvps is not None and max_hvps < 1:
        raise ConfigError(f"the HVP budget must be >= 1, got {max_hvps}")
    if rtol is not None and not rtol > 0:
        raise ConfigError(f"the target relative standard error must be positive, got {rtol}")
    if max_hvps is None and rtol is None:
        raise ConfigError("give an HVP budget (max_hvps) or a target relative standard error (rtol)")
    if min_samples < 2:
        raise ConfigError(f"min_samples must be >= 2 for a standard error, got {min_samples}")


def _inner(Z: torch.Tensor, HZ: torch.Tensor) -> torch.Tensor:
    """``z^T H z`` of each probe (rows)."""
    return (Z * HZ).sum(dim=1)


def probe_samples(op, rows_fn, gen, rtol, max_hvps, min_samples, block, term=_inner) -> tuple[int, list[float]]:
    """Draw Rademacher probes ``z`` in blocks (``rows_fn`` maps a block, as rows, to the probes applied) and take
    ``term(Z, HZ)`` of each (by default ``z^T H z``: Hutchinson's) until the standard error of their mean is at most
    ``rtol`` of its magnitude (after ``min_samples``) or ``max_hvps`` products are spent; returns the products spent
    and the terms."""
    used, samples = 0, []
    while True:
        if max_hvps is not None:
            room = max_hvps - used
            if room <= 0:
                break
            count = min(block, room)
        else:
            count = block
        Z = rows_fn(random_block("rademacher", op.dim, count, gen, op.dtype, op.device))
        HZ = op.matmat(Z.T).T
        samples.extend(term(Z, HZ).to(torch.float64).numpy(force=True).tolist())  # one read per block
        used += count
        if rtol is not None and len(samples) >= min_samples:
            if standard_error(samples) <= rtol * abs(float(np.mean(samples))):
                break
    return used, samples


def hutchinson_trace(
    op: CurvatureOperator,
    *,
    rtol: float | None = 1e-2,
    max_hvps: int | None = 100,
    min_samples: int = 10,
    seed: int = 0,
    block_size: int | None = None,
) -> TraceResult:
    """Hutchinson's estimator; stops when ``stderr <= rtol * |estimate|`` (after ``min_samples``) or at the budget."""
    op = as_operator(op, "hutchinson_trace")
    _check_budget(max_hvps, rtol, min_samples)
    gen = seeded_generator(seed, op.device)
    used, samples = probe_samples(op, lambda Z: Z, gen, rtol, max_hvps, min_samples, block_size_for(op, block_size))
    estimate, stderr = float(np.mean(samples)), standard_error(samples)
    return TraceResult(estimate, stderr, used, "hutchinson", np.asarray(samples),
                       info=target_info(estimate, stderr, rtol))


def hutchpp_trace(
    op: CurvatureOperator,
    *,
    max_hvps: int = 100,
    rtol: float | None = None,
    sketch_size: int | None = None,
    min_samples: int = 10,
    seed: int = 0,
    block_size: int | None = None,
) -> TraceResult:
    """Hutch++ with a budget of ``max_hvps`` products (sketch ``max_hvps // 3`` unless ``sketch_size`` is given).

    The Hutchinson phase on the deflated operator may stop early at ``rtol`` (relative standard error). The standard
    error is never below the rounding of the sketch's products (``info["rounding_floor"]``).
    """
    op = as_operator(op, "hutchpp_trace")
    _check_budget(max_hvps, rtol, min_samples)
    s = max(0, min(max_hvps // 3, (max_hvps - 2) // 2)) if sketch_size is None else int(sketch_size)
    s = min(s, op.dim)
    if s < 0 or 2 * s + 2 > max_hvps:
        raise ConfigError(f"a sketch of {s} vectors needs a budget of at least {2 * s + 2} products, got {max_hvps}")
    gen = seeded_generator(seed, op.device)
    block = block_size_for(op, block_size)
    low_rank, rounding = 0.0, 0.0
    Q = None
    if s > 0:
        S = random_block("rademacher", op.dim, s, gen, op.dtype, op.device)
        Y = _apply_rows(op, S, block)
        Q = _orthonormal_rows(Y)
        HQ = _apply_rows(op, Q, block)
        low_rank = float((Q * HQ).sum().double())
        # each q^T (H q) is off by up to the products' rounding times ||H q|| (eigen.rounding_floor): where the sketch
        # spans (nearly) the whole space the samples' spread is ~0 and this bound is the error
        rounding = rounding_floor(op, float(HQ.double().norm(dim=1).sum()))

    def deflate(Z):
        if Q is None:
            return Z
        for _ in range(2):  # twice, so the projection is exact to rounding in float32
            Z = Z - (Z @ Q.T) @ Q
        return Z

    used, samples = probe_samples(op, deflate, gen, rtol, max_hvps - 2 * s, min_samples, block)
    estimate, stderr = low_rank + float(np.mean(samples)), standard_error(samples)
    if math.isfinite(stderr):
        stderr = max(stderr, rounding)  # never below what the arithmetic allows
    return TraceResult(
        estimate, stderr, used + 2 * s, "hutchpp", np.asarray(samples),
        info={"sketch_size": s, "sketch_trace": low_rank, "rounding_floor": rounding,
              **target_info(estimate, stderr, rtol)},
    )


def exact_trace(op: CurvatureOperator, *, max_hvps: int | None = None, rtol: float | None = None, seed: int = 0,
                block_size: int | None = None) -> TraceResult:
    """The exact trace of a model's curvature from per-sample squared norms, no product
    (:mod:`flatfl.analysis.operators.exact_trace`: cross-entropy, networks of linear and convolutional layers; the
    Hessian's for networks linear in each layer's parameters). The budget and target do not apply; the stated error
    (``stderr``) is a bound on the rounding of the sums."""
    op = as_operator(op, "the exact trace")
    result = op.exact_trace(seed=seed)
    names = list(op.param_names or [f"param{i}" for i in range(len(result.per_param))])
    return TraceResult(result.value, result.error, 0, "exact", np.zeros(0),
                       info={"error_kind": "rounding bound", "backward_passes": result.passes,
                             "per_parameter": {n: float(v) for n, v in zip(names, result.per_param.tolist())}})


def _apply_rows(op, rows: torch.Tensor, block: int) -> torch.Tensor:
    return torch.cat([op.matmat(rows[a:a + block].T).T for a in range(0, rows.shape[0], block)])


def _orthonormal_rows(Y: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis (as rows) of the row space of Y; QR twice keeps float32 orthogonal."""
    Q = torch.linalg.qr(Y.T.double())[0]
    Q = torch.linalg.qr(Q)[0]
    return Q.T.to(Y.dtype).contiguous()


def pyhessian_trace(op: CurvatureOperator, *, max_iter: int = 100, tol: float = 1e-3, seed: int = 0) -> TraceResult:
    """PyHessian's Hutchinson loop and stopping rule, reproduced exactly (see the module docstring)."""
    op = as_operator(op, "pyhessian_trace")
    if max_iter < 1:
        raise ConfigError(f"max_iter must be >= 1, got {max_iter}")
    gen = torch.Generator().manual_seed(int(seed))
    shapes = op.param_shapes
    samples: list[float] = []
    running = 0.0
    stopped = False
    for _ in range(max_iter):
        # PyHessian: torch.randint_like(p, high=2) per parameter, then zeros set to -1.
        parts = [torch.randint(0, 2, shape, generator=gen, dtype=torch.float32).reshape(-1) for shape in shapes]
        z = torch.cat(parts).mul_(2).sub_(1).to(dtype=op.dtype, device=op.device)
        samples.append(float(torch.dot(op.matvec(z), z)))
        mean = float(np.mean(samples))
        if abs(mean - running) / (running + 1e-6) < tol:
            stopped = True
            break
        running = mean
    return TraceResult(float(np.mean(samples)), standard_error(samples), len(samples), "pyhessian", np.asarray(samples),
                       info={"stopped_by_tol": stopped, "max_iter": max_iter, "tol": tol})


def hutchinson_diagonal(
    op: CurvatureOperator,
    *,
    samples: int = 100,
    seed: int = 0,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hessian diagonal ``E[z * Hz]`` over ``samples`` Rademacher probes, with per-coordinate standard errors.

    For coordinate i one probe gives ``H_ii + sum_{j != i} H_ij z_i z_j``, so the variance of a single probe is
    ``sum_{j != i} H_ij^2``. Returns ``(diagonal, stderr)``, flat tensors on the operator's device (float64 sums
    are accumulated in the operator's dtype with Welford's update).
    """
    op = as_operator(op, "hutchinson_diagonal")
    if samples < 2:
        raise ConfigError(f"the diagonal estimator needs at least 2 samples, got {samples}")
    gen = seeded_generator(seed, op.device)
    block = block_size_for(op, block_size)
    acc_dtype = torch.float64 if op.device.type == "cpu" else op.dtype
    mean = torch.zeros(op.dim, dtype=acc_dtype, device=op.device)
    m2 = torch.zeros_like(mean)
    count = 0
    while count < samples:
        k = min(block, samples - count)
        Z = random_block("rademacher", op.dim, k, gen, op.dtype, op.device)
        terms = (Z * op.matmat(Z.T).T).to(acc_dtype)
        for row in terms:  # Welford: numerically stable running mean and sum of squared deviations
            count += 1
            delta = row - mean
            mean += delta / count
            m2 += delta * (row - mean)
    stderr = torch.sqrt(m2 / (count - 1) / count)
    return mean.to(op.dtype), stderr.to(op.dtype)
