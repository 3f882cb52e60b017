"""flatfl against PyHessian (``from pyhessian import hessian``) on the same models and data.

1. ``--method power`` and the ``pyhessian`` trace reproduce PyHessian step for step (same seeds, same draws, same
   stopping rules): the numbers agree to float32 rounding.
2. PyHessian's answers agree with the exact ones (and flatfl's Lanczos) within what PyHessian's own stopping rules
   allow; the bounds are derived in the comments.
3. Models with unused parameters: PyHessian fails, flatfl does not.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from flatfl.analysis import HessianOperator, power_iteration, pyhessian_trace, top_eigenvalues

pyhessian = pytest.importorskip("pyhessian")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def mlp_problem():
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(12, 20), nn.Tanh(), nn.Linear(20, 4)).eval()
    x = torch.randn(60, 12)
    y = torch.arange(60) % 4
    return model, x, y


def gn_cnn_problem():
    torch.manual_seed(11)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3),
    ).eval()
    x = torch.randn(40, 1, 8, 8)
    y = torch.arange(40) % 3
    return model, x, y


PROBLEMS = {"mlp": mlp_problem, "gn_cnn": gn_cnn_problem}


def exact_hessian(model, x, y) -> np.ndarray:
    model = copy.deepcopy(model).double()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat):
        params = {n: t.view(s) for n, t, s in zip(names, torch.split(flat, sizes), shapes)}
        return F.cross_entropy(functional_call(model, params, (x.double(),)), y)

    return torch.func.hessian(loss)(flat0).numpy()


def pyhessian_of(model, x, y, batches=None):
    """A PyHessian object on a private copy (PyHessian leaves graphs in .grad of the model it is given)."""
    if batches is None:
        return pyhessian.hessian(copy.deepcopy(model), nn.CrossEntropyLoss(), data=(x, y), cuda=False)
    return pyhessian.hessian(copy.deepcopy(model), nn.CrossEntropyLoss(), dataloader=batches, cuda=False)


# ---------------------------------------------------------------------------------------------- exact reproduction
@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize("loader", [False, True])
def test_power_method_reproduces_pyhessian_step_for_step(name, loader):
    model, x, y = PROBLEMS[name]()
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(y), 16)] if loader else None
    seed = 3
    torch.manual_seed(seed)
    theirs_values, theirs_vectors = pyhessian_of(model, x, y, batches).eigenvalues(top_n=3)
    op = HessianOperator(model, batches or [(x, y)])
    ours = power_iteration(op, 3, seed=seed, return_vectors=True, residuals=False)
    assert ours.hvps == sum(ours.info["iterations"])  # no extra product when residuals are not asked for
    assert np.allclose(ours.eigenvalues, theirs_values, rtol=1e-4, atol=0)  # same order: as found
    theirs_flat = torch.stack([torch.cat([t.reshape(-1) for t in vec]) for vec in theirs_vectors])
    assert torch.allclose(ours.eigenvectors, theirs_flat, atol=1e-3)


@pytest.mark.parametrize("name", list(PROBLEMS))
def test_pyhessian_trace_rule_reproduced_sample_for_sample(name):
    model, x, y = PROBLEMS[name]()
    seed = 4
    torch.manual_seed(seed)
    theirs = pyhessian_of(model, x, y).trace(maxIter=100, tol=1e-3)
    ours = pyhessian_trace(HessianOperator(model, [(x, y)]), max_iter=100, tol=1e-3, seed=seed)
    assert len(ours.samples) == len(theirs) == ours.hvps
    assert np.allclose(ours.samples, theirs, rtol=1e-4, atol=1e-6)
    assert ours.estimate == pytest.approx(float(np.mean(theirs)), rel=1e-4)


# ---------------------------------------------------------------------------------------------- agreement with truth
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_pyhessian_and_flatfl_agree_with_the_exact_top_eigenvalue_and_trace(name):
    model, x, y = PROBLEMS[name]()
    H = exact_hessian(model, x, y)
    evals = np.sort(np.linalg.eigvalsh(H))[::-1]
    torch.manual_seed(0)
    ph = pyhessian_of(model, x, y)
    (pyh_top,), _ = ph.eigenvalues(top_n=1)
    torch.manual_seed(0)
    pyh_trace_samples = ph.trace()

    lanczos = top_eigenvalues(HessianOperator(model, [(x, y)]), 1, seed=0).eigenvalues[0]
    assert lanczos == pytest.approx(evals[0], rel=1e-4)
    # PyHessian's power iteration stops when its Rayleigh quotient changes by < tol = 1e-3 (relative). Near
    # convergence the error shrinks by r^2 per step (r = |lambda_2| / lambda_1 over the rest of the spectrum), so
    # the kept (previous) estimate is off by about tol / (1 - r^2); a factor 2 covers the pre-asymptotic phase.
    r = max(abs(evals[1]), abs(evals[-1])) / evals[0]
    bound = 2 * 1e-3 / (1 - r ** 2)
    assert abs(pyh_top - evals[0]) / evals[0] <= bound
    assert abs(pyh_top - lanczos) / lanczos <= bound

    # PyHessian's trace is a Hutchinson mean of n Rademacher samples with no error bar; the exact sd of one
    # sample is sqrt(2 sum_{i != j} H_ij^2). Its stopping rule (running mean moving < 0.1%) says nothing about
    # the error, so we allow 4 standard errors of an n-sample mean (Chebyshev: the bound fails with probability
    # < 1/16 even for a non-normal mean; here the seed is fixed).
    n = len(pyh_trace_samples)
    sd = math.sqrt(2 * np.sum((H - np.diag(np.diag(H))) ** 2))
    assert abs(np.mean(pyh_trace_samples) - np.trace(H)) <= 4 * sd / math.sqrt(n)


def test_unused_parameters_break_pyhessian_but_not_flatfl():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            self.head_never_used = nn.Linear(8, 8)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(12)
    model = Unused().eval()
    x, y = torch.randn(30, 6), torch.arange(30) % 3
    with pytest.raises((TypeError, RuntimeError, AssertionError)):  # torch 2.13: AssertionError
        pyhessian_of(model, x, y).eigenvalues(top_n=1)
    ours = top_eigenvalues(HessianOperator(model, [(x, y)]), 2, seed=0)
    exact = np.sort(np.linalg.eigvalsh(exact_hessian(model.body, x, y)))[::-1]
    assert np.allclose(ours.eigenvalues, exact[:2], rtol=1e-3)
