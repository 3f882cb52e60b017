"""Eigenvalue spectral density by stochastic Lanczos quadrature (docs/analysis-protocols.md §4; Ghorbani, Krishnan & Xiao 2019).

For a start ``v = z / ||z||`` (z Rademacher), m Lanczos steps give a tridiagonal ``T``; its eigenvalues ``theta_i``
(nodes) and the squared first components of its eigenvectors ``w_i`` (weights, summing to 1) form the m-point
Gauss quadrature of the spectral measure of H seen from v: ``sum_i w_i f(theta_i) ~ v^T f(H) v``. Averaged over
starts this estimates ``tr f(H) / d``; in particular ``sum_i w_i theta_i = v^T H v``, an unbiased estimate of
``tr(H) / d``. The Lanczos basis is fully re-orthogonalised (twice) and several starts run in lock-step through one
block product. A start whose Krylov space becomes invariant stops early (its quadrature is then exact).

:func:`smoothed_density` turns nodes and weights into a curve the way PyHessian's ``density_generate`` does (facts
from PyHessian's ``density_plot.py``): a grid of 10,000 points from the mean smallest node - 0.01 to the mean largest
node + 0.01, a Gaussian of variance ``1e-5 * max(1, grid range)`` at every node, averaged over starts and normalised to
integrate to 1. PyHessian's own ``density()`` calls the removed ``torch.eig`` and is not used.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.linalg import eigh_tridiagonal

from ...errors import ConfigError
from ..operators.linear_operator import CurvatureOperator, as_operator
from ..operators.vectors import random_block, seeded_generator

__all__ = ["DensityResult", "spectral_density", "smoothed_density"]


@dataclass
class DensityResult:
    """Quadrature nodes and weights, one array of each per start (lengths can differ after an early stop)."""

    nodes: list[np.ndarray]
    weights: list[np.ndarray]
    hvps: int
    info: dict = field(default_factory=dict)

    def trace_estimate(self) -> float:
        """``d * mean_starts sum_i w_i theta_i``: the Hutchinson trace estimate carried by the quadrature."""
        return float(self.info["dim"] * np.mean([np.dot(w, t) for t, w in zip(self.nodes, self.weights)]))

    def as_dict(self) -> dict:
        return {"nodes": [t.tolist() for t in self.nodes], "weights": [w.tolist() for w in self.weights],
                "hvps": self.hvps, **self.info}


def spectral_density(op: CurvatureOperator, *, steps: int = 100, starts: int = 1, seed: int = 0,
                     given=()) -> DensityResult:
    """Stochastic Lanczos quadrature with ``steps`` Lanczos steps from each of ``starts`` random starts: Rademacher
    vectors, after the quadratures ``given`` (``(nodes, weights)`` of ``steps`` nodes each, from starts already run
    on the same operator: a top-k Lanczos run's own Gaussian start, :attr:`~.eigen.EigenResult.quadrature`), which
    count among the ``starts`` and cost no product here."""
    op = as_operator(op, "spectral_density")
    if steps < 1:
        raise ConfigError(f"the number of Lanczos steps must be >= 1, got {steps}")
    if starts < 1:
        raise ConfigError(f"the number of SLQ starts must be >= 1, got {starts}")
    n = int(op.dim)
    steps = min(int(steps), n)
    given = [(np.asarray(t, dtype=float), np.asarray(w, dtype=float)) for t, w in given][:starts]
    if any(len(t) != steps or len(w) != steps for t, w in given):
        raise ConfigError(f"a given start's quadrature must have {steps} nodes and weights, as the steps asked for")
    total, starts = starts, starts - len(given)
    eps = torch.finfo(op.dtype).eps
    gen = seeded_generator(seed, op.device)
    start_hvps = op.hvps

    Z = random_block("rademacher", n, starts, gen, op.dtype, op.device)
    bases = [torch.zeros(steps, n, dtype=op.dtype, device=op.device) for _ in range(starts)]
    for r in range(starts):
        bases[r][0] = Z[r] / Z[r].norm()
    alphas = [[] for _ in range(starts)]
    betas = [[] for _ in range(starts)]
    active = list(range(starts))
    for j in range(steps):
        if not active:
            break
        block = torch.stack([bases[r][j] for r in active], dim=1)
        W = op.matmat(block).T
        rows, numbers = [], []
        for row, r in zip(W, active):  # on the device; the host reads the step's numbers once, below
            scale = row.norm()
            basis = bases[r][:j + 1]
            coef = basis @ row
            row = row - coef @ basis
            coef2 = basis @ row
            row = row - coef2 @ basis
            rows.append(row)
            numbers.append(torch.stack([scale, coef[j] + coef2[j], row.norm()]))
        still = []
        read = torch.stack(numbers).to(torch.float64).numpy(force=True)  # one read per step (block of products)
        for (scale, alpha, beta), row, r in zip(read.tolist(), rows, active):
            alphas[r].append(alpha)
            if j + 1 == steps:
                continue
            if beta <= 100 * eps * scale or beta == 0.0:  # invariant Krylov space: the quadrature is exact
                continue
            betas[r].append(beta)
            bases[r][j + 1] = row / beta
            still.append(r)
        active = still

    nodes, weights = [t for t, _ in given], [w for _, w in given]
    for r in range(starts):
        a = np.asarray(alphas[r])
        b = np.asarray(betas[r][:len(a) - 1])
        theta, S = eigh_tridiagonal(a, b)
        nodes.append(theta)
        weights.append(S[0, :] ** 2)
    info = {"steps": steps, "starts": total, "seed": int(seed), "dim": n}
    if given:
        info["starts_from_lanczos"] = len(given)  # the first ones: the eigenvalue run's start, no product here
    return DensityResult(nodes, weights, op.hvps - start_hvps, info=info)


def smoothed_density(
    nodes, weights, *, grid_points: int = 10_000, sigma_squared: float = 1e-5, margin: float = 0.01
) -> tuple[np.ndarray, np.ndarray]:
    """PyHessian-style Gaussian smoothing of SLQ output: returns ``(grid, density)``, density integrating to 1."""
    nodes = [np.asarray(t, dtype=float) for t in nodes]
    weights = [np.asarray(w, dtype=float) for w in weights]
    if not nodes or any(t.size == 0 for t in nodes):
        raise ConfigError("no quadrature nodes to smooth")
    lam_max = float(np.mean([t.max() for t in nodes])) + margin
    lam_min = float(np.mean([t.min() for t in nodes])) - margin
    grid = np.linspace(lam_min, lam_max, grid_points)
    variance = sigma_squared * max(1.0, lam_max - lam_min)
    density = np.zeros(grid_points)
    for t, w in zip(nodes, weights):
        kernel = np.exp(-((grid[:, None] - t[None, :]) ** 2) / (2 * variance)) / np.sqrt(2 * np.pi * variance)
        density += kernel @ w
    density /= len(nodes)
    density /= density.sum() * (grid[1] - grid[0])
    return grid, density
