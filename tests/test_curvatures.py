"""The Gauss-Newton matrix and the empirical Fisher against dense float64 matrices built here from Jacobians, output
Hessians and per-sample gradients (torch.autograd.functional, one sample at a time); every registered estimator on
each; for cross-entropy the GGN equals the Fisher's expectation over labels drawn from the model's softmax; the
objective forms and the refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flatfl.analysis import EmpiricalFisherOperator, GGNOperator, HessianOperator, curvature_operator, hessian
from flatfl.analysis.estimators.by_name import estimate_eigenvalues, estimate_trace
from flatfl.analysis.estimators.per_layer import per_layer_curvature
from flatfl.errors import ConfigError
from flatfl.analysis.estimators.registry import estimator_names

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def cnn():
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)).double()


def data(model):
    g = torch.Generator().manual_seed(2)
    shape = (13, 4) if isinstance(model[0], nn.Linear) else (13, 1, 6, 6)
    return torch.randn(*shape, generator=g, dtype=torch.float64), torch.arange(13) % 3


def batches(x, y):
    return [(x[:5], y[:5]), (x[5:], y[5:])]  # uneven: the sample-weighted mean is checked too


class Flat:
    """The model's parameters as one flat vector (registration order), for functions of it."""

    def __init__(self, model):
        self.model = model
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for p in model.parameters()]
        self.theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def params(self, flat):
        out, i = {}, 0
        for n, s in zip(self.names, self.shapes):
            out[n] = flat[i:i + s.numel()].view(s)
            i += s.numel()
        return out

    def outputs(self, flat, x):
        return torch.func.functional_call(self.model, self.params(flat), (x,))

    def sample_gradient(self, x, label):
        return torch.autograd.functional.jacobian(
            lambda f: F.cross_entropy(self.outputs(f, x[None]), torch.tensor([label])), self.theta)


def dense_ggn(model, x, y) -> np.ndarray:
    """(1/N) sum_i J_i^T H_i J_i: each sample's Jacobian of the outputs and Hessian of its loss in the outputs."""
    flat = Flat(model)
    total = torch.zeros(len(flat.theta), len(flat.theta), dtype=torch.float64)
    for i in range(len(y)):
        J = torch.autograd.functional.jacobian(lambda f: flat.outputs(f, x[i:i + 1])[0], flat.theta)
        out = model(x[i:i + 1])[0].detach()
        H = torch.autograd.functional.hessian(lambda o: F.cross_entropy(o[None], y[i:i + 1]), out)
        total += J.T @ H @ J
    return (total / len(y)).numpy()


def dense_empirical_fisher(model, x, y) -> np.ndarray:
    """(1/N) sum_i g_i g_i^T from each sample's own gradient."""
    flat = Flat(model)
    G = torch.stack([flat.sample_gradient(x[i], int(y[i])) for i in range(len(y))])
    return (G.T @ G / len(y)).numpy()


def expected_fisher(model, x) -> np.ndarray:
    """(1/N) sum_i sum_c p_ic g_ic g_ic^T: the Fisher over labels drawn from the model's softmax, its expectation
    summed exactly over the classes."""
    flat = Flat(model)
    total = torch.zeros(len(flat.theta), len(flat.theta), dtype=torch.float64)
    for i in range(len(x)):
        probs = torch.softmax(model(x[i:i + 1])[0].detach(), dim=0)
        for c in range(len(probs)):
            g = flat.sample_gradient(x[i], c)
            total += probs[c] * torch.outer(g, g)
    return (total / len(x)).numpy()


DENSE = {"ggn": dense_ggn, "empirical-fisher": dense_empirical_fisher}
CURVES = tuple(DENSE)


def ce_objective(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


ce_objective.outputs = lambda model, batch: model(batch["x"])
ce_objective.loss_of_outputs = lambda outputs, batch: F.cross_entropy(outputs, batch["y"])


@pytest.mark.parametrize("build", [mlp, cnn])
@pytest.mark.parametrize("curvature", CURVES)
def test_products_are_the_dense_matrix_in_every_form(build, curvature):
    model = build()
    x, y = data(model)
    dense = DENSE[curvature](model, x, y)
    V = torch.randn(dense.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    forms = [curvature_operator(curvature, model, batches(x, y)),
             curvature_operator(curvature, model, batches(x, y), loss_fn=nn.CrossEntropyLoss()),
             curvature_operator(curvature, model, [{"x": x[:5], "y": y[:5]}, {"x": x[5:], "y": y[5:]}],
                                loss=ce_objective)]
    before = [p.detach().clone() for p in model.parameters()]
    for op in forms:
        assert type(op) is {"ggn": GGNOperator, "empirical-fisher": EmpiricalFisherOperator}[curvature]
        np.testing.assert_allclose(op.matmat(V).numpy(), dense @ V.numpy(), rtol=1e-9, atol=1e-12)
        assert op.hvps == 3 and op.num_samples == 13 and op.dim == dense.shape[0]
        # the first-order quantities are the loss's, as the Hessian operator's
        hess = HessianOperator(model, batches(x, y))
        assert op.loss() == pytest.approx(hess.loss(), rel=1e-12)
        assert torch.allclose(op.gradient(), hess.gradient(), rtol=1e-10, atol=1e-14)
        assert list(op.unflatten(V[:, 0])) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("build", [mlp, cnn])
@pytest.mark.parametrize("curvature", CURVES)
def test_every_registered_estimator_on_each_curvature(build, curvature):
    model = build()
    x, y = data(model)
    true = np.linalg.eigvalsh(DENSE[curvature](model, x, y))[::-1]
    op = curvature_operator(curvature, model, batches(x, y))
    for name in estimator_names("eigenvalues"):
        eig = estimate_eigenvalues(op, name, 3, tol=1e-6, seed=0, exact_residuals=True)
        for value, residual in zip(eig.eigenvalues, eig.residuals):
            # a symmetric matrix has an eigenvalue within ||Hv - lambda v|| of lambda (v a unit vector)
            assert np.min(np.abs(true - value)) <= residual + 1e-9 * true[0], (name, value, residual)
        assert abs(eig.eigenvalues[0] - true[0]) <= eig.residuals[0] + 1e-9 * true[0], name
    for name in estimator_names("trace"):
        tr = estimate_trace(op, name, max_hvps=60, rtol=None, seed=1)
        # 4 standard errors: PyHessian's rule stops once the estimate changes little, which makes its spread look
        # smaller than it is
        assert abs(tr.estimate - true.sum()) <= 4 * tr.stderr + 1e-8 * abs(true.sum()), (name, tr)
    blocks = per_layer_curvature(op, 1, seed=3)
    dense = DENSE[curvature](model, x, y)
    offset = 0
    for block in blocks.blocks:  # each module's block: its principal sub-matrix
        sub = dense[offset:offset + block.dim, offset:offset + block.dim]
        assert block.eigenvalues[0] == pytest.approx(np.linalg.eigvalsh(sub)[-1], rel=1e-6, abs=1e-10)
        assert abs(block.trace - np.trace(sub)) <= 3 * block.trace_stderr + 1e-8
        offset += block.dim
    assert offset == dense.shape[0]


@pytest.mark.parametrize("build", [mlp, cnn])
def test_the_ggn_of_cross_entropy_is_the_expected_fisher(build):
    model = build()
    x, y = data(model)
    op = GGNOperator(model, batches(x, y))
    eye = torch.eye(op.dim, dtype=torch.float64)
    np.testing.assert_allclose(op.matmat(eye).numpy(), expected_fisher(model, x), rtol=1e-9, atol=1e-12)


def test_the_python_api_measures_each_curvature():
    model = mlp()
    x, y = data(model)
    for curvature in CURVES:
        h = hessian(model, nn.CrossEntropyLoss(), data=(x, y), curvature=curvature)
        values, vectors = h.eigenvalues(top_n=2, tol=1e-8)
        true = np.linalg.eigvalsh(DENSE[curvature](model, x, y))[::-1]
        np.testing.assert_allclose(values, true[:2], rtol=1e-6)
        assert len(vectors[0]) == len(list(model.parameters()))


def test_refusals_are_one_line():
    model = mlp()
    x, y = data(model)

    def whole(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1])

    cases = [
        (lambda: GGNOperator(model, (x, y), loss=whole), "has no outputs and loss_of_outputs"),
        (lambda: curvature_operator("ggn", model, (x, y), products="finite-difference"), "products of its own"),
        (lambda: curvature_operator("fisher", model, (x, y)), "unknown curvature 'fisher'"),
        (lambda: EmpiricalFisherOperator(model, (x, y), mode="train"), "mode='eval'"),
    ]

    def wrong(model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    wrong.outputs = lambda model, batch: 2 * model(batch["x"])
    wrong.loss_of_outputs = lambda outputs, batch: F.cross_entropy(outputs, batch["y"])
    cases.append((lambda: GGNOperator(model, {"x": x, "y": y}, loss=wrong), "does not add up"))
    for call, words in cases:
        with pytest.raises(ConfigError) as err:
            call()
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_curvlinops_gives_the_same_products():
    curvlinops = pytest.importorskip("curvlinops")
    model = mlp()
    x, y = data(model)
    params = [p for p in model.parameters()]
    V = torch.randn(sum(p.numel() for p in params), 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    loss = nn.CrossEntropyLoss()
    for ours, theirs in ((GGNOperator, curvlinops.GGNLinearOperator),
                         (EmpiricalFisherOperator, curvlinops.EFLinearOperator)):
        op = theirs(model, loss, params, batches(x, y))
        expected = np.stack([np.asarray(op @ V[:, j].numpy()) for j in range(2)], axis=1)
        np.testing.assert_allclose(ours(model, batches(x, y)).matmat(V).numpy(), expected, rtol=1e-8, atol=1e-12)


def test_a_report_keeps_curvatures_apart():
    from flatfl.report.metrics import data_setting
    from flatfl.report.records import measures_defaults
    from flatfl.run_layout import settings_match

    assert data_setting({"curvature": "ggn"}) == ", ggn curvature"
    assert data_setting({"curvature": "hessian", "products": "auto"}) == ""
    assert data_setting({"products": "finite-difference"}) == ", finite-difference products"
    assert not measures_defaults({"settings": {"curvature": "empirical-fisher"}})
    assert measures_defaults({"settings": {"top": 1}})  # written before curvatures were recorded: the Hessian
    assert settings_match({"top": 1}, {"top": 1, "curvature": "hessian", "products": "auto"})
    assert not settings_match({"top": 1, "curvature": "ggn"}, {"top": 1, "curvature": "hessian"})
    assert settings_match({"top": 1, "curvature": "ggn"}, {"top": 1, "curvature": "ggn"})
    # written before --smallest existed: no smallest eigenvalues, which a report asking for none accepts
    assert settings_match({"top": 1}, {"top": 1, "smallest": 0})
    assert not settings_match({"top": 1}, {"top": 1, "smallest": 1})
    assert settings_match({"top": 1, "smallest": 1}, {"top": 1, "smallest": 1})
