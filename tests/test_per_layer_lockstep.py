"""Per-layer blocks in lockstep: the same numbers as each block analysed alone with the same estimators and seeds,
far fewer batched products than products, and a failure in one block's products is the analysis' one error."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flatfl.analysis import GGNOperator, HessianOperator
from flatfl.analysis.estimators.eigen import top_eigenvalues
from flatfl.analysis.estimators.per_layer import BlockOperator, layer_groups, per_layer_curvature
from flatfl.analysis.operators.second_order import SecondDerivativeError
from flatfl.analysis.estimators.trace import hutchpp_trace
from no_double_backward import Square

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(20, 1, 8, 8, generator=g, dtype=torch.float64), torch.arange(20) % 3


def alone(op, top, tol, trace_hvps, seed, dense_up_to):
    """Each block by itself, one after the other (no lockstep): what per_layer_curvature must reproduce."""
    offsets = np.concatenate([[0], np.cumsum([int(np.prod(s)) for s in op.param_shapes])])
    out = []
    for i, (_, members) in enumerate(layer_groups(op.param_names)):
        index = torch.cat([torch.arange(offsets[j], offsets[j + 1]) for j in members])
        block = BlockOperator(op, index)
        if block.dim <= dense_up_to:
            dense = block.matmat(torch.eye(block.dim, dtype=torch.float64)).numpy()
            out.append((np.linalg.eigvalsh((dense + dense.T) / 2)[::-1][:top], np.trace(dense)))
        else:
            eig = top_eigenvalues(block, top, tol=tol, seed=seed + i)
            tr = hutchpp_trace(block, max_hvps=trace_hvps, rtol=1e-2, seed=seed + i)
            out.append((eig.eigenvalues, tr.estimate))
    return out


@pytest.mark.parametrize("curvature", [HessianOperator, GGNOperator])
def test_lockstep_gives_the_numbers_of_block_by_block(curvature):
    x, y = data()
    model = cnn()
    op = curvature(model, [(x[:8], y[:8]), (x[8:], y[8:])])
    result = per_layer_curvature(op, 2, tol=1e-3, trace_hvps=40, seed=3, dense_up_to=40)
    expected = alone(curvature(model, [(x[:8], y[:8]), (x[8:], y[8:])]), 2, 1e-3, 40, 3, 40)
    assert len(result.blocks) == len(expected) == 3
    for block, (values, trace) in zip(result.blocks, expected):
        np.testing.assert_allclose(block.eigenvalues, values, rtol=1e-10, atol=1e-13)
        assert block.trace == pytest.approx(trace, rel=1e-10, abs=1e-13)
    # every block's products went through shared batched products
    assert result.info["batched_products"] < result.hvps / 2
    assert result.hvps == sum(b.hvps for b in result.blocks)


class Squared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(Square.apply(self.a(x)))


def test_a_failing_product_is_the_one_error():
    torch.manual_seed(0)
    x = torch.randn(10, 4, dtype=torch.float64)
    op = HessianOperator(Squared().double(), (x, torch.arange(10) % 3))
    with pytest.raises(SecondDerivativeError) as err:
        per_layer_curvature(op, 1, dense_up_to=4)
    assert "finite-difference" in str(err.value)
