"""Operators made of others (:mod:`flatfl.analysis.operators.combined`) and the damped curvature (``flatfl hessian
--damping``), against dense matrices and ``numpy.linalg.eigh``: sums and multiples of matrices, the Hessian + lambda I
of a small network, the exact trace of a damped GGN, the products' error of a sum where its terms cancel (a hand
formula), and the command line's eigenvalues moved by exactly the damping."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from flatfl.analysis.commands.hessian_command import compute
from flatfl.analysis.commands.hessian_settings import HessianSettings
from flatfl.analysis.estimators.eigen import top_eigenvalues
from flatfl.analysis.operators.combined import IdentityOperator, ScaledOperator, SumOperator, damped
from flatfl.analysis.operators.curvatures import GGNOperator
from flatfl.analysis.operators.hessian import HessianOperator
from flatfl.analysis.operators.linear_operator import MatrixOperator
from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.report.metrics import data_setting
from dense import dense_hessian
from test_eigen_which import trained  # noqa: F401 - the fixture: a small trained float64 network
from tiny_run import analyse_tiny, train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def symmetric(n: int, seed: int) -> torch.Tensor:
    A = torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return A + A.T


def test_sums_and_multiples_of_matrices_are_the_matrices_sums():
    A, B = symmetric(7, 0), symmetric(7, 1)
    op = SumOperator([MatrixOperator(A), ScaledOperator(MatrixOperator(B), -0.3)])
    V = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(op.matmat(V), (A - 0.3 * B) @ V, rtol=0, atol=1e-13)
    assert op.hvps == 6  # both terms' products
    truth = np.linalg.eigvalsh((A - 0.3 * B).numpy())[::-1][:3]
    assert np.allclose(top_eigenvalues(op, 3, tol=1e-10).eigenvalues, truth, rtol=0, atol=1e-9)
    counted = []
    op.on_hvp = counted.append
    op.matmat(V)
    assert counted == [6]
    a = MatrixOperator(A)
    twice = SumOperator([a, ScaledOperator(a, 2.0)])  # A + 2A: A's products computed twice, counted once each
    assert torch.allclose(twice.matmat(V), 3 * A @ V, rtol=0, atol=1e-12) and twice.hvps == a.hvps == 6
    assert damped(a, 1.0).matvec(torch.ones(7, dtype=torch.float32)).dtype == torch.float64  # the operator's
    shifted = damped(MatrixOperator(A), 2.5)
    assert torch.allclose(shifted.matmat(V), A @ V + 2.5 * V, rtol=0, atol=1e-13) and shifted.hvps == 3  # I: free
    assert damped(MatrixOperator(A), 0.0).hvps == 0  # no damping: the operator itself


def test_the_damped_trace_is_the_curvatures_plus_the_damping_times_the_dimension():
    """tr(A + lambda I) = tr(A) + lambda n exactly: the trace is estimated on A (its standard error and products A's,
    not inflated by the identity's part) and lambda n added."""
    A = MatrixOperator(symmetric(40, 3))
    for method, rtol in (("hutchinson", None), ("hutchpp", None), ("hutchinson", 0.05), ("pyhessian", None)):
        settings = dict(top=0, trace_method=method, trace_hvps=30, trace_rtol=rtol)
        plain, _, _ = compute(A, HessianSettings(**settings))
        moved, _, _ = compute(A, HessianSettings(**settings, damping=0.75))
        assert moved["trace"]["estimate"] == pytest.approx(plain["trace"]["estimate"] + 0.75 * 40, rel=1e-14)
        assert moved["trace"]["stderr"] == plain["trace"]["stderr"] and moved["trace"]["damping_added"] == 30.0
        assert moved["trace"]["hvps"] == plain["trace"]["hvps"]
        # what the estimator's target bought is the curvature's estimate's: kept as it was, and absent without one
        assert {k: v for k, v in moved["trace"].items() if k.startswith(("target", "relative"))} == \
            {k: v for k, v in plain["trace"].items() if k.startswith(("target", "relative"))}


def test_the_damped_blocks_are_the_curvatures_moved_exactly(trained):
    """--per-layer with a damping: each block's eigenvalues + lambda and trace + lambda * size (of the same
    estimates: the identity adds no noise), checked against the undamped analysis and eigh of each dense block."""
    model, x, y = trained
    settings = dict(top=0, trace=False, per_layer=True, trace_hvps=20, tol=1e-9)
    plain, _, _ = compute(HessianOperator(model, (x, y)), HessianSettings(**settings))
    moved, _, _ = compute(HessianOperator(model, (x, y)), HessianSettings(**settings, damping=0.5))
    H, at = dense_hessian(model, x, y), 0
    for a, b in zip(plain["per_layer"]["blocks"], moved["per_layer"]["blocks"]):
        assert b["top_eigenvalues"][0] == pytest.approx(a["top_eigenvalues"][0] + 0.5, abs=1e-12)
        assert b["trace"] == pytest.approx(a["trace"] + 0.5 * a["dim"], rel=1e-14)
        assert b["trace_stderr"] == a["trace_stderr"]
        block = H[at:at + b["dim"], at:at + b["dim"]]
        at += b["dim"]
        assert b["top_eigenvalues"][0] == pytest.approx(np.linalg.eigvalsh(block)[-1] + 0.5, abs=1e-7)
    assert moved["per_layer"]["trace_sum"] == pytest.approx(plain["per_layer"]["trace_sum"] + 0.5 * H.shape[0])
    assert moved["per_layer"]["damping"] == 0.5


def test_finite_difference_products_of_a_damped_curvature_keep_their_error(trained):
    """Damping a finite-difference Hessian: its stated error (known only after its first product) and the error
    measured along the eigenvectors are the damped analysis' too, and the eigenvalue is within that bound of
    eigh(H + lambda I)."""
    model, x, y = trained
    H = dense_hessian(model, x, y)
    truth = np.linalg.eigvalsh(H + 0.25 * np.eye(len(H)))[-1]
    report, eig, _ = compute(HessianOperator(model, (x, y), products="finite-difference"),
                             HessianSettings(top=1, trace=False, tol=1e-8, damping=0.25))
    assert report["products"]["method"] == "finite-difference" and report["products"]["relative_error"] > 0
    assert report["eigen"]["product_error_along"] > 0
    assert abs(report["top_eigenvalues"][0] - truth) <= report["error_estimates"][0]


def test_a_multiple_and_a_deflation_carry_their_operators_products(trained):
    """Each product of ``c H`` or ``P H P`` is one of H's, transformed exactly: their count, method and stated error
    (finite differences: known after the first product) and the error measured along given directions are H's, read
    when asked; such a member cannot be assigned over."""
    from flatfl.analysis.operators.linear_operator import DeflatedOperator

    model, x, y = trained
    H = HessianOperator(model, (x, y), products="finite-difference")
    X = torch.linalg.qr(torch.randn(H.dim, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))[0].T
    V = torch.randn(H.dim, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for made in (ScaledOperator(H, 2.0), DeflatedOperator(H, X)):
        made.matmat(V)
        assert made.hvps == H.hvps > 0 and made.product_source is H
        assert made.products == "finite-difference" and made.product_error == H.product_error > 0
        assert made.product_error_along(V) == H.product_error_along(V) > 0
        with pytest.raises(AttributeError, match="the operator's it is made from"):
            made.hvps = 0
    dense = torch.as_tensor(dense_hessian(model, x, y))
    P = torch.eye(H.dim, dtype=torch.float64) - X.T @ X
    assert torch.allclose(DeflatedOperator(H, X).matmat(V), P @ dense @ P @ V, rtol=0, atol=1e-5)


def test_the_damped_hessian_of_a_network_against_eigh(trained):
    model, x, y = trained
    H = dense_hessian(model, x, y)
    truth = np.linalg.eigvalsh(H + 0.25 * np.eye(len(H)))
    report, _, _ = compute(HessianOperator(model, (x, y)), HessianSettings(top=2, smallest=1, trace=False, tol=1e-9,
                                                                           damping=0.25))
    assert np.allclose(report["top_eigenvalues"], truth[::-1][:2], rtol=0, atol=1e-8)
    assert report["smallest_eigenvalues"]["values"][0] == pytest.approx(truth[0], abs=1e-8)
    assert truth[0] == pytest.approx(np.linalg.eigvalsh(H)[0] + 0.25, abs=1e-12)  # moved by the damping


def test_the_exact_trace_of_a_damped_ggn_adds_the_damping_per_parameter_block(trained):
    model, x, y = trained
    ggn = GGNOperator(model, (x, y))
    plain = ggn.exact_trace()
    moved = damped(ggn, 0.125).exact_trace()
    sizes = torch.tensor([p.numel() for p in model.parameters()], dtype=torch.float64)  # per parameter block
    assert torch.allclose(moved.per_param, plain.per_param.double() + 0.125 * sizes, rtol=0, atol=1e-13)
    assert moved.value == pytest.approx(plain.value + 0.125 * ggn.dim, rel=1e-14)
    assert moved.error >= plain.error  # its rounding bound: never smaller than the undamped one's
    report, _, _ = compute(GGNOperator(model, (x, y)), HessianSettings(top=0, trace_method="exact", damping=0.125))
    assert report["trace"]["estimate"] == pytest.approx(plain.value + 0.125 * ggn.dim, rel=1e-13)
    assert sum(report["trace"]["per_parameter"].values()) == pytest.approx(report["trace"]["estimate"], rel=1e-13)
    with pytest.raises(ConfigError, match="exact trace needs the curvature of a model"):
        damped(MatrixOperator(symmetric(3, 0)), 1.0).exact_trace()


class Noisy(MatrixOperator):
    """A matrix whose products are said to carry a relative error of 1% along every direction."""

    def product_error_along(self, V):
        return 0.01


def test_a_sums_product_error_grows_where_its_terms_cancel():
    """Along an eigenvector v of A (eigenvalue mu), A + lambda I has the absolute error of A's product, 0.01 |mu|,
    on a product of norm |mu + lambda|: the relative error is 0.01 |mu| / |mu + lambda| (here 1/0.05 = 20x larger)."""
    mu = torch.tensor([-2.0, 1.0, 3.0], dtype=torch.float64)
    op = damped(Noisy(torch.diag(mu)), 1.9)
    v = torch.tensor([[1.0], [0.0], [0.0]], dtype=torch.float64)
    assert op.product_error_along(v) == pytest.approx(0.01 * 2.0 / 0.1, rel=1e-12)
    w = torch.tensor([[0.0], [0.0], [1.0]], dtype=torch.float64)
    assert op.product_error_along(w) == pytest.approx(0.01 * 3.0 / 4.9, rel=1e-12)
    assert damped(MatrixOperator(torch.diag(mu)), 1.9).product_error_along(v) is None  # exact products


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match="--damping must be from 0 to 1e"):
        HessianSettings(damping=-1e-3).validate()
    with pytest.raises(ConfigError, match="--damping must be a finite number"):
        HessianSettings(damping=float("inf")).validate()
    with pytest.raises(ConfigError, match="same vectors"):
        SumOperator([MatrixOperator(symmetric(3, 0)), MatrixOperator(symmetric(4, 0))])
    with pytest.raises(ConfigError, match="finite number"):
        ScaledOperator(MatrixOperator(symmetric(3, 0)), float("nan"))
    assert IdentityOperator(MatrixOperator(symmetric(3, 0))).matmat(torch.ones(3, 1, dtype=torch.float64)).sum() == 3


def test_the_command_moves_every_eigenvalue_by_the_damping(tmp_path):
    run = train_tiny(tmp_path / "run")
    flags = ("--top", "2", "--smallest", "1", "--samples", "64", "--no-trace", "--tol", "1e-6")
    r, plain = analyse_tiny(run, tmp_path / "plain", *flags)
    assert r.exit_code == 0, r.output
    r, moved = analyse_tiny(run, tmp_path / "moved", *flags, "--damping", "0.5")
    assert r.exit_code == 0, r.output
    for a, b, ea, eb in zip(plain["top_eigenvalues"], moved["top_eigenvalues"], plain["error_estimates"],
                            moved["error_estimates"]):
        assert abs(b - a - 0.5) <= ea + eb + 1e-6 * abs(b)  # float32 products
    low, low_moved = plain["smallest_eigenvalues"], moved["smallest_eigenvalues"]
    assert abs(low_moved["values"][0] - low["values"][0] - 0.5) <= \
        low["error_estimates"][0] + low_moved["error_estimates"][0] + 1e-6
    assert moved["settings"]["damping"] == 0.5 and moved["measured"].startswith("Hessian + 0.5 I, exact products")
    assert "top eigenvalues of the Hessian + 0.5 I (largest algebraic)" in r.output
    assert data_setting(moved["settings"]) == ", damping 0.5" and data_setting(plain["settings"]) == ""
    # the folder of the damped analysis is not replaced by an undamped one
    again = CliRunner().invoke(main, ["hessian", str(run), *flags, "--quiet", "--out", str(tmp_path / "moved")])
    assert again.exit_code == 2 and "--damping 0.5 there, 0.0 here" in again.output, again.output
    assert json.loads((tmp_path / "moved" / "hessian.json").read_text()) == moved
