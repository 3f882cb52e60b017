"""The estimators keep their work on the operator's device: per block of products the host reads at most once
(``aten._local_scalar_dense``, ``float()``/``bool()``/``item()``, ``tolist()``/``numpy()``/``cpu()``) and copies
nothing host-made to the device; the random vectors come from a generator on that device seeded by the run's seed;
and Lanczos' "auto" block never spends more products than one vector at a time for k <= 50."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dense import dense_hessian
from flatfl.analysis import (HessianOperator, hutchinson_trace, hutchpp_trace, power_iteration, spectral_density,
                             top_eigenvalues)
from flatfl.analysis.operators.hessian import random_block, seeded_generator

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}
FROM_HOST = {torch.as_tensor, torch.tensor, torch.from_numpy}


class Traffic(TorchFunctionMode):
    """Counts the host's reads of tensor values and the tensors built from host data (numpy arrays, lists)."""

    def __init__(self):
        super().__init__()
        self.reads = self.uploads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS:
            self.reads += 1
        elif func in FROM_HOST and args and not isinstance(args[0], torch.Tensor):
            self.uploads += 1
        return func(*args, **kwargs)


class Syncs(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: a device value read by the host (a synchronisation on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.fc = torch.nn.Linear(3 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def cnn_operator(**kw):
    torch.manual_seed(0)
    model = CNN()
    x, y = torch.randn(48, 1, 8, 8), torch.randint(0, 4, (48,))
    return HessianOperator(model, [(x[:24], y[:24]), (x[24:], y[24:])], **kw)


class Counted:
    """The operator with its ``matmat`` calls (blocks of products) counted; its own work is counted too."""

    def __init__(self, op):
        self.op, self.blocks = op, 0
        self.dim, self.dtype, self.device = op.dim, op.dtype, op.device
        self.preferred_block_size = op.preferred_block_size
        self.param_shapes = op.param_shapes

    @property
    def hvps(self):
        return self.op.hvps

    def matvec(self, v):
        return self.matmat(v.reshape(-1, 1)).reshape(-1)

    def matmat(self, V):
        self.blocks += 1
        return self.op.matmat(V)


ESTIMATORS = {
    "hutchinson": lambda op: hutchinson_trace(op, rtol=1e-9, max_hvps=40, seed=3),
    "hutchpp": lambda op: hutchpp_trace(op, max_hvps=60, seed=3),
    "slq": lambda op: spectral_density(op, steps=30, starts=2, seed=3),
    "lanczos-top5": lambda op: top_eigenvalues(op, 5, tol=1e-4, seed=3),
    "lanczos-top3-blocks": lambda op: top_eigenvalues(op, 3, tol=1e-4, seed=3, block_size=3),
    "power-top2": lambda op: power_iteration(op, 2, seed=3, residuals=False),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_at_most_one_host_read_and_no_upload_per_block(name):
    op = cnn_operator()
    traffic, syncs = Traffic(), Syncs()
    counted = Counted(op)
    with traffic, syncs:
        ESTIMATORS[name](counted)
    blocks = counted.blocks
    assert op.hvps >= 20 and blocks >= 10
    # beyond one read per block: the start and the answer (Hutch++'s sketch trace, Lanczos' start block); uploads:
    # the small projected solutions (Ritz vectors at the end and at a restart)
    assert syncs.count <= blocks + 2, (syncs.count, blocks)
    assert traffic.reads <= blocks + 2, (traffic.reads, blocks)
    assert traffic.uploads <= 2 + blocks // 10, (traffic.uploads, blocks)


def test_random_vectors_are_drawn_on_the_operators_device_from_the_seed():
    op = cnn_operator()
    # Hutchinson's samples are z^T H z for the seed's draws on op.device, drawn there
    result = hutchinson_trace(op, rtol=None, max_hvps=4, seed=11, block_size=4, min_samples=2)
    gen = torch.Generator(device=op.device).manual_seed(11)
    Z = torch.randint(0, 2, (4, op.dim), generator=gen, device=op.device).mul_(2).sub_(1).to(op.dtype)
    expected = (Z * op.matmat(Z.T).T).sum(1).double().numpy()
    assert result.samples == pytest.approx(expected, rel=1e-6)
    block = random_block("gaussian", 5, 2, seeded_generator(4, "cpu"), torch.float32, torch.device("cpu"))
    assert block.device.type == "cpu" and block.dtype == torch.float32


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 12)
        self.b = torch.nn.Linear(12, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("k", [2, 6, 20])
def test_auto_block_spends_no_more_products_than_one_vector_at_a_time(k):
    torch.manual_seed(1)
    model = MLP().double()
    x, y = torch.randn(40, 6, dtype=torch.float64), torch.randint(0, 5, (40,))
    op = HessianOperator(model, [(x, y)], products="forward-over-reverse")
    assert op.preferred_block_size > 1  # batched products prefer blocks
    # the exact Hessian, independently: the dense Hessian of the loss as a function of the flat parameters
    exact = np.sort(np.linalg.eigvalsh(dense_hessian(model, x, y)))[::-1][:k]
    one = top_eigenvalues(op, k, tol=1e-6, seed=0, block_size=1)
    auto = top_eigenvalues(op, k, tol=1e-6, seed=0)
    assert auto.hvps <= one.hvps, (auto.hvps, one.hvps)
    scale = abs(exact[0])
    assert np.abs(auto.eigenvalues - exact).max() <= 1e-5 * scale
    assert np.abs(one.eigenvalues - exact).max() <= 1e-5 * scale
