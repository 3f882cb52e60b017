"""Which eigenvalues (``which`` = largest | smallest | magnitude), the scipy view of every curvature operator, and
error estimates that never claim more than the products' rounding allows, each against a dense matrix built here:
the Hessian of a small trained network (``torch.autograd.functional.hessian``, float64), its Gauss-Newton matrix and
empirical Fisher from Jacobians and per-sample gradients, and ``numpy.linalg.eigh`` of them."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.sparse.linalg import eigsh
from torch import nn

from flatfl.analysis import hessian
from flatfl.analysis.estimators.by_name import estimate_eigenvalues
from flatfl.analysis.estimators.eigen import rounding_floor, top_eigenvalues
from flatfl.analysis.estimators.power import power_iteration
from flatfl.analysis.operators.curvatures import EmpiricalFisherOperator, GGNOperator
from flatfl.analysis.operators.hessian import HessianOperator
from flatfl.analysis.operators.linear_operator import (DeflatedOperator, FunctionOperator, MatrixOperator,
                                                       as_operator)
from flatfl.analysis.commands.hessian_settings import HessianSettings
from flatfl.errors import ConfigError
from dense import train_full_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def trained():
    """A 10-16-3 tanh network trained 150 full-batch steps on 96 random samples (float64): its Hessian has
    eigenvalues of both signs (227 parameters, more than the Lanczos basis, so the dense shortcut is not taken)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    x, y = torch.randn(96, 10, dtype=torch.float64), torch.randint(0, 3, (96,))
    return train_full_batch(model, x, y, 150, 0.5), x, y


def flat_params(model):
    return {n: p.detach() for n, p in model.named_parameters()}


def unflatten(model, theta):
    out, at = {}, 0
    for n, p in model.named_parameters():
        out[n] = theta[at:at + p.numel()].view_as(p)
        at += p.numel()
    return out


def dense_hessian(model, x, y) -> np.ndarray:
    """The Hessian of the mean cross-entropy by torch.autograd.functional.hessian of the flat parameters."""
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(t):
        return F.cross_entropy(torch.func.functional_call(model, unflatten(model, t), (x,)), y)

    return torch.autograd.functional.hessian(loss, theta).numpy()


def dense_ggn_and_fisher(model, x, y) -> tuple[np.ndarray, np.ndarray]:
    """(GGN, empirical Fisher) of the mean cross-entropy: (1/N) sum_i J_i^T (diag p_i - p_i p_i^T) J_i and
    (1/N) sum_i g_i g_i^T, from the outputs' Jacobian and the per-sample gradients (torch.func.jacrev)."""
    params = flat_params(model)
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)  # (N, 3, *shape) each
    J = torch.cat([t.reshape(x.shape[0], 3, -1) for t in jac.values()], dim=2)  # (N, 3, dim)
    p = torch.softmax(model(x), dim=1).detach()
    H_out = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    ggn = torch.einsum("nad,nab,nbe->de", J, H_out, J) / x.shape[0]
    grads = torch.func.jacrev(lambda q: F.cross_entropy(torch.func.functional_call(model, q, (x,)), y,
                                                         reduction="none"))(params)
    G = torch.cat([t.reshape(x.shape[0], -1) for t in grads.values()], dim=1)
    return ggn.detach().numpy(), (G.T @ G / x.shape[0]).detach().numpy()


@pytest.fixture(scope="module")
def truth(trained):
    model, x, y = trained
    return np.linalg.eigvalsh(dense_hessian(model, x, y))  # ascending


def expected(evals: np.ndarray, which: str, k: int) -> np.ndarray:
    """The k eigenvalues ``which`` asks for, in its order, from the full (ascending) spectrum."""
    if which == "largest":
        return evals[::-1][:k]
    if which == "smallest":
        return evals[:k]
    return evals[np.argsort(-np.abs(evals), kind="stable")][:k]


def test_the_trained_network_has_negative_curvature(truth):
    assert truth[0] < -1e-3 and truth[-1] > 0  # otherwise "smallest" and "magnitude" would test nothing new


@pytest.mark.parametrize("which", ["largest", "smallest", "magnitude"])
def test_lanczos_finds_the_eigenvalues_which_asks_for(trained, truth, which):
    model, x, y = trained
    op = HessianOperator(model, (x, y))
    r = top_eigenvalues(op, 4, which=which, tol=1e-9, seed=1, return_vectors=True)
    assert r.method == "lanczos" and r.converged.all() and r.info["which"] == which
    want = expected(truth, which, 4)
    np.testing.assert_allclose(r.eigenvalues, want, rtol=1e-7, atol=1e-9)
    # the error estimates cover the true errors, and the residuals are those of the returned vectors
    assert np.all(np.abs(r.eigenvalues - want) <= r.error_bounds + 1e-12)
    H = dense_hessian(model, x, y)
    Y = r.eigenvectors.numpy()
    true_res = np.linalg.norm(H @ Y.T - Y.T * r.eigenvalues, axis=0)
    assert np.all(true_res <= 1e-6 * np.abs(truth).max())


def test_smallest_is_the_largest_of_the_negated_operator(trained):
    """which="smallest" runs the same steps as Lanczos on -H: the same values, negated, from the same products."""
    model, x, y = trained
    op = HessianOperator(model, (x, y))
    small = top_eigenvalues(op, 3, which="smallest", tol=1e-8, seed=2)
    minus = FunctionOperator(lambda v: -op.matvec(v), op.dim, dtype=op.dtype)
    negated = top_eigenvalues(minus, 3, tol=1e-8, seed=2)
    np.testing.assert_allclose(small.eigenvalues, -negated.eigenvalues, rtol=1e-10)
    assert small.hvps == negated.hvps


def test_repeated_eigenvalues_are_checked_at_either_end():
    """A 5-fold most negative eigenvalue on a 300-dimensional matrix: every copy is found (smallest, magnitude)."""
    rng = np.random.default_rng(3)
    Q, _ = np.linalg.qr(rng.standard_normal((300, 300)))
    evals = np.concatenate([[-6.0] * 5, [5.5, -5.2], rng.uniform(-3, 3, 293)])
    A = torch.as_tensor((Q * evals) @ Q.T)
    for which in ("smallest", "magnitude"):
        r = top_eigenvalues(A, 7, which=which, tol=1e-8)
        np.testing.assert_allclose(r.eigenvalues, expected(np.sort(evals), which, 7), atol=1e-8)
        assert r.info["multiplicity"]["status"] == "checked"


@pytest.mark.parametrize("which", ["largest", "smallest", "magnitude"])
def test_the_dense_shortcut_orders_as_asked(which):
    rng = np.random.default_rng(4)
    A = rng.standard_normal((12, 12))
    A = A + A.T
    r = top_eigenvalues(A, 5, which=which)
    assert r.method == "dense"
    np.testing.assert_allclose(r.eigenvalues, expected(np.linalg.eigvalsh(A), which, 5), atol=1e-12)


def test_the_python_object_takes_which(trained, truth):
    model, x, y = trained
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y))
    values, vectors = h.eigenvalues(top_n=3, which="smallest", tol=1e-8)
    np.testing.assert_allclose(values, truth[:3], rtol=1e-6)
    assert len(vectors) == 3 and [t.shape for t in vectors[0]] == [p.shape for p in model.parameters()]
    assert h.last.info["which"] == "smallest"
    rich = h.top_eigenvalues(3, which="magnitude", tol=1e-8)
    np.testing.assert_allclose(rich.eigenvalues, expected(truth, "magnitude", 3), rtol=1e-6)
    # power iteration finds the largest in magnitude only: that is its default, and asking for more is one line
    assert estimate_eigenvalues(h.operator, "power", 1, tol=1e-6).info["which"] == "magnitude"
    with pytest.raises(ConfigError, match="^the power eigenvalue method finds the largest magnitude eigenvalues "
                                          "only, not the smallest algebraic .*'lanczos'"):
        h.eigenvalues(top_n=2, which="smallest", method="power")


@pytest.mark.parametrize("bad", ["lowest", "", 3, "LARGEST"])
def test_a_bad_which_is_one_line(trained, bad):
    model, x, y = trained
    op = HessianOperator(model, (x, y))
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y))
    for call in (lambda: top_eigenvalues(op, 2, which=bad), lambda: h.eigenvalues(top_n=2, which=bad),
                 lambda: HessianSettings(which=bad).validate()):
        with pytest.raises(ConfigError) as e:
            call()
        assert "\n" not in str(e.value) and ("which" in str(e.value) or "--which" in str(e.value)), str(e.value)
    assert op.hvps == 0  # refused before any product


# ------------------------------------------------------------------------------------------------ scipy's view
def check_view(op, truth: np.ndarray, dtype, k: int = 3, rtol: float = 1e-8, smallest: bool = True) -> None:
    """``op.as_linear_operator()``: shape, dtype, matvec and matmat against ``op``, and eigsh's largest (and with
    ``smallest`` its smallest) eigenvalues against the dense eigenvalues ``truth`` (ascending)."""
    L = op.as_linear_operator()
    n = int(op.dim)
    assert L.shape == (n, n) and L.dtype == np.dtype(dtype)
    V = np.random.default_rng(5).standard_normal((n, 2))
    before = op.hvps
    block = L.matmat(V)
    assert block.dtype == np.dtype(dtype) and block.shape == (n, 2) and op.hvps == before + 2
    vector = L.matvec(V[:, 0])
    assert vector.shape == (n,)
    np.testing.assert_allclose(vector, block[:, 0], rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)
    np.testing.assert_allclose(L.rmatvec(V[:, 0]), vector)  # symmetric: its own adjoint
    scale = np.abs(truth).max()
    top = eigsh(L, k=k, which="LA", tol=1e-10, return_eigenvectors=False)
    np.testing.assert_allclose(np.sort(top), truth[-k:], rtol=rtol, atol=rtol * scale)
    if smallest:
        low = eigsh(L, k=k, which="SA", tol=1e-10, return_eigenvectors=False)
        np.testing.assert_allclose(np.sort(low), truth[:k], rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_hessian_as_a_scipy_operator(trained, truth, dtype):
    model, x, y = trained
    model = copy.deepcopy(model).to(dtype)
    op = HessianOperator(model, (x.to(dtype), y))
    check_view(op, truth, {torch.float64: np.float64, torch.float32: np.float32}[dtype],
               rtol=1e-8 if dtype == torch.float64 else 1e-4)
    h = hessian(model, nn.CrossEntropyLoss(), data=(x.to(dtype), y))
    assert h.as_linear_operator().dtype == np.dtype(str(dtype).removeprefix("torch."))


def test_the_other_curvatures_and_operators_as_scipy_operators(trained):
    model, x, y = trained
    ggn, fisher = dense_ggn_and_fisher(model, x, y)
    # both are positive semi-definite with a null space (rank below the dimension): their top eigenvalues
    check_view(GGNOperator(model, (x, y)), np.linalg.eigvalsh(ggn), np.float64, smallest=False)
    check_view(EmpiricalFisherOperator(model, (x, y)), np.linalg.eigvalsh(fisher), np.float64, smallest=False)
    A = np.random.default_rng(6).standard_normal((40, 40))
    A = A + A.T
    evals = np.linalg.eigvalsh(A)
    check_view(MatrixOperator(torch.as_tensor(A)), evals, np.float64)
    check_view(FunctionOperator(lambda v: torch.as_tensor(A) @ v, 40, dtype=torch.float64), evals, np.float64)
    X = torch.as_tensor(np.linalg.eigh(A)[1][:, -1:].T.copy())  # the top eigenvector taken out: P A P
    P = np.eye(40) - X.numpy().T @ X.numpy()
    check_view(DeflatedOperator(as_operator(A), X), np.linalg.eigvalsh(P @ A @ P), np.float64)


def test_the_scipy_view_takes_complex_vectors_and_refuses_bfloat16():
    A = torch.as_tensor(np.diag([1.0, 2.0, 3.0]))
    L = MatrixOperator(A).as_linear_operator()
    np.testing.assert_allclose(L.matvec(np.array([1j, 1.0, 2 - 1j])), [1j, 2.0, 6 - 3j])
    np.testing.assert_allclose(L.matmat(np.array([[1j], [1.0], [2.0]])), [[1j], [2.0], [6.0]])
    with pytest.raises(ConfigError, match="^a scipy LinearOperator needs a float32 or float64 operator"):
        MatrixOperator(A.to(torch.bfloat16)).as_linear_operator()


# ------------------------------------------------------------------------------------------------ honest errors
def test_float32_error_estimates_cover_the_true_error(trained, truth):
    """The same network in float32 and float64: each precision's error estimates cover its eigenvalues' true error
    against float64 eigh, and the float32 ones are not below the products' rounding (sqrt(dim) eps32 ||H||)."""
    model, x, y = trained
    scale = np.abs(truth).max()
    for dtype, eps in ((torch.float64, np.finfo(np.float64).eps), (torch.float32, np.finfo(np.float32).eps)):
        op = HessianOperator(copy.deepcopy(model).to(dtype), (x.to(dtype), y))
        for which in ("largest", "smallest"):
            r = top_eigenvalues(op, 3, which=which, tol=1e-9 if dtype == torch.float64 else 1e-6, seed=0)
            error = np.abs(r.eigenvalues - expected(truth, which, 3))
            assert np.all(error <= r.error_bounds), (dtype, which, error, r.error_bounds)
            # ||H|| as the Ritz values see it: within the spectrum, and the floor never below its rounding
            assert np.abs(r.eigenvalues).max() <= r.info["norm_estimate"] <= scale * (1 + 1e-6)
            floor = np.sqrt(op.dim) * eps * r.info["norm_estimate"]
            assert r.info["rounding_floor"] == pytest.approx(floor) == rounding_floor(op, r.info["norm_estimate"])
            assert np.all(r.error_bounds >= floor * (1 - 1e-9)), (dtype, r.error_bounds)
        if dtype == torch.float32:
            assert r.error_bounds.min() > 1e-6  # a float32 analysis does not state 1e-16
    # power iteration (explicit residuals) and the dense shortcut (a small block) keep the same floor
    op32 = HessianOperator(copy.deepcopy(model).float(), (x.float(), y))
    power = power_iteration(op32, 1, tol=1e-6)
    assert power.error_bounds[0] >= np.sqrt(op32.dim) * np.finfo(np.float32).eps * 0.99 * abs(power.eigenvalues[0])
    small = top_eigenvalues(np.diag(np.linspace(1, 2, 10)).astype(np.float32), 2)
    assert small.method == "dense" and small.error_bounds.min() >= np.sqrt(10) * np.finfo(np.float32).eps * 2 * 0.99


def test_finite_difference_products_raise_the_floor(trained):
    model, x, y = trained
    op = HessianOperator(model, (x, y), products="finite-difference")
    r = top_eigenvalues(op, 2, tol=1e-6)
    assert op.product_error and op.product_error > 1e-12
    assert r.error_bounds.min() >= op.product_error * abs(r.eigenvalues[0])


def test_one_analysis_finds_both_ends(trained, truth):
    """``smallest`` beside ``top`` (``flatfl hessian --smallest``): the most negative eigenvalues of the dense
    Hessian, ascending, within their error estimates, from their own seed stream and with their own products; power
    iteration, which finds only the largest in magnitude, leaves them to Lanczos."""
    from flatfl.analysis.commands.hessian_command import compute

    model, x, y = trained
    op = HessianOperator(model, (x, y))
    report, eig, _ = compute(op, HessianSettings(top=2, smallest=3, trace=False, tol=1e-9))
    np.testing.assert_allclose(report["top_eigenvalues"], expected(truth, "largest", 2), rtol=1e-7)
    low = report["smallest_eigenvalues"]
    want = expected(truth, "smallest", 3)
    assert low["method"] == "lanczos" and all(low["converged"]) and want[0] < 0
    assert np.all(np.abs(np.array(low["values"]) - want) <= np.array(low["error_estimates"]) + 1e-12)
    assert min(low["error_estimates"]) >= low["rounding_floor"] > 0
    assert report["hvps_total"] == eig.hvps + low["hvps"]
    again = top_eigenvalues(op, 3, which="smallest", tol=1e-9, seed=4)  # the analysis' seed + 4
    np.testing.assert_array_equal(low["values"], again.eigenvalues)
    # without it: None; power iteration's analysis finds them by Lanczos
    assert compute(op, HessianSettings(top=1, trace=False))[0]["smallest_eigenvalues"] is None
    power = compute(op, HessianSettings(top=1, smallest=1, method="power", trace=False, tol=1e-9))[0]
    assert power["smallest_eigenvalues"]["method"] == "lanczos"
    np.testing.assert_allclose(power["smallest_eigenvalues"]["values"], want[:1], rtol=1e-7)
    for bad, message in ((-1, "--smallest must be an integer from 0"), (op.dim + 1, "--smallest 228 is larger")):
        with pytest.raises(ConfigError, match=message):
            compute(op, HessianSettings(top=1, smallest=bad, trace=False))
