"""The curvature-operator contract (flatfl.analysis.operators.linear_operator): every operator flatfl makes keeps it, the
estimators call its members directly, anything else is turned into an operator in one place or refused in one line."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flatfl.analysis import (CurvatureOperator, FunctionOperator, HessianOperator, MatrixOperator, as_operator,
                             hutchinson_trace, power_iteration, spectral_density, top_eigenvalues)
from flatfl.analysis.operators.linear_operator import DeflatedOperator, ForwardedOperator
from flatfl.errors import ConfigError

ANALYSIS = Path(__file__).resolve().parent.parent / "flatfl" / "analysis"
SPECTRUM = torch.tensor([5.0, -9.0, 3.0, 1.0, 0.5, 0.25], dtype=torch.float64)


def test_every_operator_keeps_the_contract():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.arange(8) % 2
    hess = HessianOperator(model, (x, y))
    matrix = MatrixOperator(torch.diag(SPECTRUM))
    function = FunctionOperator(lambda v: SPECTRUM * v, dim=6, dtype=torch.float64)
    X = torch.eye(6, dtype=torch.float64)[:1]
    deflated = DeflatedOperator(matrix, X)
    for op in (hess, matrix, function, deflated):
        assert isinstance(op, CurvatureOperator)
        V = torch.eye(op.dim, dtype=op.dtype)[:, :2]
        before = op.hvps
        out = op.matmat(V)
        assert out.shape == (op.dim, 2) and op.hvps == before + 2
        assert torch.allclose(op.matvec(V[:, 0]), out[:, 0])
        assert sum(int(np.prod(s)) for s in op.param_shapes) == op.dim
        assert op.preferred_block_size >= 1
        op.release()
    assert hess.has_param_layout and not matrix.has_param_layout and matrix.param_shapes == [(6,)]
    assert matrix.locked is None and hess.locked is None and deflated.locked is X
    assert torch.allclose(deflated.matvec(torch.ones(6, dtype=torch.float64))[0], torch.tensor(0.0, dtype=torch.float64))
    assert torch.equal(function.matmat(torch.eye(6, dtype=torch.float64)), torch.diag(SPECTRUM))


def test_the_estimators_take_matrices_and_functions_and_refuse_anything_else():
    assert np.allclose(top_eigenvalues(torch.diag(SPECTRUM), 2, tol=1e-8).eigenvalues, [5.0, 3.0])
    function = FunctionOperator(lambda v: SPECTRUM * v, dim=6, dtype=torch.float64)
    assert np.allclose(top_eigenvalues(function, 2, tol=1e-8).eigenvalues, [5.0, 3.0])
    assert power_iteration(MatrixOperator(torch.diag(SPECTRUM)), 1, tol=1e-10, max_iter=500).eigenvalues[0] == \
        pytest.approx(-9.0, rel=1e-4)  # largest in magnitude (PyHessian normalises by |v| + 1e-6)
    for estimator in (lambda op: top_eigenvalues(op, 1), lambda op: hutchinson_trace(op),
                      lambda op: spectral_density(op), lambda op: power_iteration(op)):
        with pytest.raises(ConfigError) as e:
            estimator(object())
        assert "needs a curvature operator" in str(e.value) and "FunctionOperator(fn, dim)" in str(e.value)


def test_an_object_with_the_products_part_is_forwarded():
    class Products:
        def __init__(self):
            self.inner = MatrixOperator(torch.diag(SPECTRUM))
            self.dim, self.dtype, self.device = 6, torch.float64, torch.device("cpu")
            self.param_shapes, self.preferred_block_size = [(2, 3)], 1

        @property
        def hvps(self):
            return self.inner.hvps

        def matmat(self, V):
            return self.inner.matmat(V)

    source = Products()
    op = as_operator(source)
    assert isinstance(op, ForwardedOperator) and op.param_shapes == [(2, 3)] and op.has_param_layout
    result = top_eigenvalues(source, 1, tol=1e-8)
    assert result.eigenvalues[0] == pytest.approx(5.0) and result.hvps == source.hvps > 0


def test_no_estimator_probes_an_operator():
    """The members are the contract's: no getattr / hasattr / isinstance on an operator in flatfl/analysis."""
    probe = re.compile(r"(getattr|hasattr)\((op|item)\b|isinstance\(op\b|_Deflated")
    found = [f"{path.name}:{i}" for path in sorted(ANALYSIS.rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if probe.search(line)]
    assert not found, found
