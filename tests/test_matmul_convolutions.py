"""float64 convolutions on the CPU as one matrix product (flatfl/models/convolution.py) give torch's convolution,
its first and second derivatives, and so the same Hessian: against ``F.conv2d`` over the options a convolution takes,
and against a dense Hessian (``numpy.linalg.eigh``) of a small CNN."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatfl.analysis import HessianOperator
from flatfl.analysis.estimators.eigen import dense_matrix
from flatfl.models.convolution import conv2d_as_matmul, eligible, matmul_convolutions, torch_convolutions
from dense import dense_hessian

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIONS = [(stride, padding, dilation, groups, bias)
           for stride, padding, dilation, groups, bias in itertools.product(
               [1, 2, (1, 2)], [0, 1, (2, 1), "same", "valid"], [1, 2], [1, 2], [True, False])
           if not (padding == "same" and stride != 1)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("stride,padding,dilation,groups,bias", OPTIONS)
def test_the_matrix_product_is_torchs_convolution_and_its_derivatives(stride, padding, dilation, groups, bias):
    """Output, gradient and a second derivative (the gradient of the squared gradient norm) of every input, within
    1e-13 of torch's own, for strides, paddings (ints, pairs, 'same', 'valid'), dilations, groups and bias."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 9, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 4 // groups, 3, 2, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    inputs = [x, w] + ([b] if bias else [])

    def derivatives(conv):
        out = conv(x, w, b, stride, padding, dilation, groups)
        grads = torch.autograd.grad((out ** 2).sum() / 2, inputs, create_graph=True)
        return [out, *grads, *torch.autograd.grad(sum((gr * gr).sum() for gr in grads), inputs)]

    ours = derivatives(conv2d_as_matmul)
    for got, want in zip(ours, derivatives(F.conv2d)):
        assert got.shape == want.shape and relative(got, want) < 1e-13


def test_an_unbatched_input_gives_an_unbatched_output():
    x, w = torch.randn(2, 5, 5, dtype=torch.float64), torch.randn(3, 2, 3, 3, dtype=torch.float64)
    out = conv2d_as_matmul(x, w, padding=1)
    assert out.shape == (3, 5, 5) and relative(out, F.conv2d(x, w, padding=1)) < 1e-13


def test_only_float64_convolutions_on_the_cpu_are_replaced():
    """float32 calls reach torch unchanged (bit for bit), float64 ones are computed as a matrix product (not bit for
    bit torch's), and inside torch_convolutions nothing is replaced."""
    x32, w32 = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    x64, w64 = x32.double(), w32.double()
    assert not eligible((x32, w32), {}) and eligible((x64, w64), {}) and eligible((), {"input": x64, "weight": w64})
    with matmul_convolutions():
        out32, out64 = F.conv2d(x32, w32, padding=1), F.conv2d(x64, w64, padding=1)
    assert torch.equal(out32, F.conv2d(x32, w32, padding=1))
    assert torch.equal(out64, conv2d_as_matmul(x64, w64, padding=1))
    with torch_convolutions(), matmul_convolutions():
        assert torch.equal(F.conv2d(x64, w64, padding=1), torch.conv2d(x64, w64, padding=1))


def test_a_stacked_cohort_s_grouped_convolutions_alone_are_replaced():
    """stacked_convolutions (a channel-stacked cohort's training): grouped float64 calls as matrix products,
    ungrouped ones and calls under torch.func.vmap torch's own, bit for bit."""
    from flatfl.models.convolution import stacked_convolutions

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 6, 5, 5, dtype=torch.float64, generator=g), torch.randn(9, 2, 3, 3, dtype=torch.float64,
                                                                                 generator=g)
    single = torch.randn(4, 6, 3, 3, dtype=torch.float64, generator=g)
    with stacked_convolutions():
        grouped, plain = F.conv2d(x, w, None, 1, 1, 1, 3), F.conv2d(x, single, padding=1)
        mapped = torch.func.vmap(lambda v: F.conv2d(v, w, None, 1, 1, 1, 3))(x.unsqueeze(1))
    assert torch.equal(grouped, conv2d_as_matmul(x, w, None, 1, 1, 1, 3))
    assert relative(grouped, F.conv2d(x, w, None, 1, 1, 1, 3)) < 1e-13
    assert torch.equal(plain, F.conv2d(x, single, padding=1))
    assert torch.equal(mapped, torch.func.vmap(lambda v: F.conv2d(v, w, None, 1, 1, 1, 3))(x.unsqueeze(1)))


class SmallCNN(nn.Module):
    """Two convolutions (one strided, one grouped), pooling and a classifier: 400-odd parameters."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, groups=2)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        h = F.max_pool2d(torch.tanh(self.conv1(x)), 2)
        return self.fc(torch.relu(self.conv2(torch.tanh(h))).flatten(1))


def test_hessian_products_equal_torchs_convolutions_and_the_dense_hessian():
    """A float64 HessianOperator of a CNN computes its convolutions as matrix products (the operator says so), its
    products equal those through torch's own convolutions to 1e-13, and its dense matrix is the dense autograd
    Hessian, with the same eigenvalues (numpy.linalg.eigh)."""
    torch.manual_seed(0)
    model = SmallCNN().double()
    x, y = torch.randn(24, 1, 10, 10, dtype=torch.float64), torch.randint(0, 3, (24,))
    batches = [(x[:16], y[:16]), (x[16:], y[16:])]
    op = HessianOperator(model, batches)
    assert op.terms.matmul_convolutions
    V = torch.randn(op.dim, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch_convolutions():
        reference = HessianOperator(model, batches).matmat(V)
    assert relative(op.matmat(V), reference) < 1e-13
    H = dense_hessian(model, x, y)
    ours = dense_matrix(op)
    assert np.abs(ours - H).max() <= 1e-12 * np.abs(H).max()
    np.testing.assert_allclose(np.linalg.eigvalsh(ours), np.linalg.eigvalsh(H), atol=1e-12 * np.abs(H).max())
    assert not HessianOperator(SmallCNN(), [(x.float(), y)]).terms.matmul_convolutions  # float32: torch's own
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(100, 3)).double()  # no convolution: no mode, no cost per operation
    assert not HessianOperator(mlp, batches).terms.matmul_convolutions
