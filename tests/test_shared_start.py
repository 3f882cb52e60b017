"""The density's first SLQ start taken from the top-k Lanczos run (flatfl/analysis/estimators/eigen.py,
``quadrature_steps``; density.py, ``given``): the Gauss quadrature of the run's own random start reproduces the moments
v^T H^p v of that start for p < 2m (computed here from the dense matrix, the start drawn again from the seed), and an
analysis with a density computes one start's products fewer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flatfl.analysis.commands.hessian_command import compute
from flatfl.analysis.commands.hessian_settings import HessianSettings
from flatfl.analysis.estimators.density import spectral_density
from flatfl.analysis.estimators.eigen import top_eigenvalues
from flatfl.analysis.operators.linear_operator import MatrixOperator
from flatfl.analysis.operators.vectors import random_block, seeded_generator


def matrix(n=120):
    g = torch.Generator().manual_seed(0)
    A = torch.randn(n, n, generator=g, dtype=torch.float64) / n ** 0.5
    return (A + A.T) / 2


def test_the_lanczos_start_s_quadrature_has_its_moments():
    H, steps = matrix(), 10
    result = top_eigenvalues(MatrixOperator(H), 4, seed=3, quadrature_steps=steps)
    nodes, weights = result.quadrature
    assert len(nodes) == steps and weights.sum() == pytest.approx(1.0, rel=1e-13)
    start = random_block("gaussian", H.shape[0], 1, seeded_generator(3, torch.device("cpu")), torch.float64,
                         torch.device("cpu"))[0]
    start = start / start.norm()
    for p in range(2 * steps):  # an m-point Gauss quadrature is exact for polynomials of degree < 2m
        moment = float(start @ torch.linalg.matrix_power(H, p) @ start)
        assert float(np.sum(weights * nodes ** p)) == pytest.approx(moment, rel=1e-10, abs=1e-13), p
    assert top_eigenvalues(MatrixOperator(H), 4, seed=3).quadrature is None  # kept only when asked for


def test_a_density_takes_the_given_start_and_computes_the_others():
    H, steps = matrix(), 10
    op = MatrixOperator(H)
    given = top_eigenvalues(op, 4, seed=3, quadrature_steps=steps).quadrature
    alone = spectral_density(op, steps=steps, starts=1, seed=5)
    both = spectral_density(op, steps=steps, starts=2, seed=5, given=[given])
    assert both.hvps == steps and both.info["starts"] == 2 and both.info["starts_from_lanczos"] == 1
    np.testing.assert_array_equal(both.nodes[0], given[0])
    np.testing.assert_allclose(both.nodes[1], alone.nodes[0], rtol=1e-12)  # the seed's first Rademacher start


def test_an_analysis_with_a_density_spends_one_start_fewer():
    op = MatrixOperator(matrix())
    report, eig, dens = compute(op, HessianSettings(top=4, trace=False, density=True, density_steps=12,
                                                    density_starts=2))
    assert dens.info["starts_from_lanczos"] == 1 and dens.hvps == 12
    assert report["hvps_total"] == eig.hvps + 12
