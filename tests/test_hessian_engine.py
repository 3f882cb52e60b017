"""The Hessian engine against exact dense Hessians (docs/analysis-protocols.md §1-4).

Truth: the Hessian of the full-data mean loss formed by ``torch.func.hessian`` (an implementation independent of the
operator's double backward), and ``numpy.linalg.eigh`` of it. Three small models: a tanh MLP, a CNN with GroupNorm,
and a network with BatchNorm in eval mode (with non-trivial running statistics).
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

from dense import train_full_batch
from flatfl.analysis import (
    HessianOperator,
    MatrixOperator,
    hutchinson_diagonal,
    hutchinson_trace,
    hutchpp_trace,
    power_iteration,
    smoothed_density,
    spectral_density,
    top_eigenvalues,
)
from flatfl.analysis.estimators.eigen import dense_matrix
from flatfl.errors import ConfigError

N_SAMPLES = 48


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------- models and truth
def make_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(N_SAMPLES, 10)
    return model, x


def make_gn_cnn():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(),
        nn.Conv2d(4, 6, 3), nn.GroupNorm(2, 6), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 3),
    )
    x = torch.randn(N_SAMPLES, 1, 8, 8)
    return model, x


def make_bn_net():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    with torch.no_grad():  # running statistics far from the defaults, so eval mode really differs from train mode
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(N_SAMPLES, 10)
    return model, x


MODELS = {"mlp": make_mlp, "gn_cnn": make_gn_cnn, "bn_eval": make_bn_net}


def problem(name: str, dtype=torch.float64):
    model, x = MODELS[name]()
    model = model.to(dtype).eval()
    x = x.to(dtype)
    y = torch.arange(N_SAMPLES) % 3
    return model, x, y


def batches_of(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(y), size)]


def exact_hessian(model, x, y) -> np.ndarray:
    """torch.func.hessian of the mean cross-entropy over all of (x, y), in eval mode, as a dense float64 matrix."""
    model = copy.deepcopy(model).double().eval()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    buffers = {n: b for n, b in model.named_buffers()}
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat):
        parts = torch.split(flat, sizes)
        params = {n: t.view(s) for n, t, s in zip(names, parts, shapes)}
        return F.cross_entropy(functional_call(model, {**params, **buffers}, (x.double(),)), y)

    return torch.func.hessian(loss)(flat0).numpy()


_TRUTH: dict = {}


def truth(name):
    if name not in _TRUTH:
        model, x, y = problem(name)
        H = exact_hessian(model, x, y)
        evals, evecs = np.linalg.eigh(H)
        _TRUTH[name] = (H, evals[::-1].copy(), evecs[:, ::-1].copy())
    return _TRUTH[name]


def operator(name, dtype=torch.float64, batch_size=N_SAMPLES, **kw):
    model, x, y = problem(name, dtype)
    return HessianOperator(model, batches_of(x, y, batch_size), **kw)


# ---------------------------------------------------------------------------------------------- the operator
def probes(dim, k=12, seed=0):
    return torch.randn(dim, k, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODELS))
def test_operator_equals_autograd_hessian(name):
    # random probes: H V = H_true V for a dozen random V detects any difference between the matrices
    H, _, _ = truth(name)
    op = operator(name, batch_size=16)
    V = probes(op.dim)
    assert np.allclose(op.matmat(V).numpy(), H @ V.numpy(), rtol=0, atol=1e-11 * np.abs(H).sum(axis=1).max())


def test_operator_does_not_depend_on_batch_size():
    v = torch.randn(operator("gn_cnn").dim, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    products = [operator("gn_cnn", batch_size=b).matvec(v) for b in (48, 16, 7)]  # 7: uneven last batch
    for p in products[1:]:
        assert torch.allclose(p, products[0], rtol=0, atol=1e-12)


def test_cached_and_recomputed_graphs_agree_and_products_are_deterministic():
    gen = torch.Generator().manual_seed(4)
    V = torch.randn(operator("mlp").dim, 3, dtype=torch.float64, generator=gen)
    cached = operator("mlp", cache_graph=True)
    recomputed = operator("mlp", cache_graph=False)
    over_budget = operator("mlp", cache_graph="auto", cache_bytes=1)
    assert cached.fully_cached and not recomputed.fully_cached and not over_budget.fully_cached
    reference = cached.matmat(V)
    assert torch.equal(cached.matmat(V), reference)  # the same product twice is the same vector
    for op in (recomputed, over_budget):
        assert torch.allclose(op.matmat(V), reference, rtol=0, atol=1e-13)
    columns = torch.stack([cached.matvec(V[:, j]) for j in range(3)], dim=1)
    assert torch.allclose(columns, reference, rtol=0, atol=1e-13)
    assert cached.hvps == 3 + 3 + 3


def test_unused_parameters_are_zero_rows_and_columns():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))
            self.unused = nn.Linear(5, 5)  # never called: PyHessian fails on such models

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(5)
    model = WithUnused().double().eval()
    x, y = torch.randn(20, 10, dtype=torch.float64), torch.arange(20) % 3
    op = HessianOperator(model, [(x, y)])
    H = dense_matrix(op)
    used = sum(p.numel() for p in model.body.parameters())
    assert op.dim == used + 30
    assert np.all(H[used:] == 0) and np.all(H[:, used:] == 0)
    truth_used = exact_hessian(model.body, x, y)
    assert np.allclose(H[:used, :used], truth_used, atol=1e-12)
    result = top_eigenvalues(op, 3, tol=1e-8)
    assert np.allclose(result.eigenvalues, np.linalg.eigvalsh(truth_used)[::-1][:3], rtol=1e-8)


def test_mode_is_set_and_restored_and_buffers_untouched():
    model, x, y = problem("bn_eval")
    model.train()  # the user's model is in train mode; the operator must use eval mode and give it back as it was
    model[3].eval()
    before = {n: b.clone() for n, b in model.named_buffers()}
    op = HessianOperator(model, batches_of(x, y, 16))
    V = probes(op.dim)
    H = truth("bn_eval")[0]
    assert np.allclose(op.matmat(V).numpy(), H @ V.numpy(), rtol=0, atol=1e-11 * np.abs(H).sum(axis=1).max())
    assert model.training and model[1].training and not model[3].training
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n])

    train_op = HessianOperator(model, batches_of(x, y, 16), mode="train", cache_graph=False)
    v = torch.ones(op.dim, dtype=torch.float64)
    first = train_op.matvec(v)
    assert torch.equal(train_op.matvec(v), first)  # batch statistics, but deterministic
    assert not torch.allclose(first, op.matvec(v))  # and a different Hessian from eval mode
    for n, b in model.named_buffers():
        if n.endswith("num_batches_tracked"):
            continue
        assert torch.equal(b, before[n]), n


def test_operator_rejects_bad_input():
    model, x, y = problem("mlp")
    with pytest.raises(ConfigError, match="mode"):
        HessianOperator(model, [(x, y)], mode="training")
    with pytest.raises(ConfigError, match="empty"):
        HessianOperator(model, [])
    with pytest.raises(ConfigError, match="dtype"):
        HessianOperator(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), [(x, y)])
    frozen = copy.deepcopy(model).requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameters"):
        HessianOperator(frozen, [(x, y)])
    op = HessianOperator(model, [(x, y)])
    with pytest.raises(ConfigError, match="vectors"):
        op.matmat(torch.zeros(3, 1))
    with pytest.raises(ConfigError, match="eigenvalues"):
        top_eigenvalues(op, op.dim + 1)


def test_gradient_and_unflatten_follow_the_parameter_layout():
    model, x, y = problem("mlp")
    op = HessianOperator(model, batches_of(x, y, 20))
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert torch.allclose(op.gradient(), torch.cat([g.reshape(-1) for g in grads]), atol=1e-14)
    assert math.isclose(op.loss(), loss.item(), rel_tol=1e-12)
    views = op.unflatten(op.gradient())
    assert list(views) == [n for n, _ in model.named_parameters()]
    assert all(views[n].shape == p.shape for n, p in model.named_parameters())


# ---------------------------------------------------------------------------------------------- eigenvalues
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-4), (torch.float32, 1e-3)])
def test_top_eigenvalues_match_eigh(name, dtype, rtol):
    H, evals, evecs = truth(name)
    op = operator(name, dtype)
    for k in (1, 10):
        result = top_eigenvalues(op, k, seed=0, return_vectors=True)
        assert result.method == "lanczos" and result.converged.all()
        assert np.all(np.diff(result.eigenvalues) <= 0)  # descending
        assert np.allclose(result.eigenvalues, evals[:k], rtol=rtol, atol=0), (result.eigenvalues, evals[:k])
    # the reported residuals are the Lanczos relation's; they must agree with ||H y - theta y|| formed explicitly
    Y = result.eigenvectors.double().numpy().T
    explicit = np.linalg.norm(H @ Y - Y * result.eigenvalues, axis=0)
    floor = (1e-12 if dtype == torch.float64 else 1e-5) * evals[0]
    assert np.all(np.abs(explicit - result.residuals) <= 0.1 * explicit + floor)
    assert np.allclose(np.linalg.norm(Y, axis=0), 1, atol=1e-5)
    # eigenvectors match the exact ones up to sign for the well-separated top pair
    assert abs(abs(Y[:, 0] @ evecs[:, 0]) - 1) < (1e-8 if dtype == torch.float64 else 1e-4)


def test_close_pair_in_the_top_k_is_not_skipped():
    # the top of a random-init CIFAR CNN's Hessian spectrum (measured): eigenvalues 9 and 10 are 0.4% apart and
    # both must be found (one Ritz value standing for the pair would shift every later eigenvalue by one place)
    top = [1.2201, 1.1587, 1.12157, 1.11081, 1.06033, 1.01532, 0.98656, 0.95612, 0.92544, 0.92142, 0.8961, 0.88377]
    rng = np.random.default_rng(4)
    n = 500
    spectrum = np.concatenate([top, np.linspace(0.87, 0.1, 150), rng.uniform(-0.3, 0.1, n - 162)])
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    op = MatrixOperator(torch.tensor((Q * spectrum) @ Q.T))
    for seed in range(3):
        result = top_eigenvalues(op, 10, seed=seed)
        assert np.allclose(result.eigenvalues, top[:10], rtol=1e-3), seed
        # the error estimates are small where the residuals are, and bound the actual errors here
        assert np.all(np.abs(result.eigenvalues - top[:10]) <= result.error_bounds + 1e-12)


def test_block_lanczos_with_restarts_and_exact_residuals():
    H, evals, _ = truth("gn_cnn")
    op = operator("gn_cnn")
    result = top_eigenvalues(op, 6, block_size=2, basis_size=14, tol=1e-8, exact_residuals=True, seed=1)
    assert result.info["restarts"] >= 1 and result.info["block_size"] == 2 and result.converged.all()
    assert np.allclose(result.eigenvalues, evals[:6], rtol=1e-7)
    assert np.all(result.residuals <= 1e-8 * np.abs(result.eigenvalues) + 1e-12)


def test_lanczos_is_deterministic_per_seed_and_dense_fallback_is_exact():
    op = operator("mlp")
    a, b = top_eigenvalues(op, 5, seed=7), top_eigenvalues(op, 5, seed=7)
    assert np.array_equal(a.eigenvalues, b.eigenvalues) and np.array_equal(a.residuals, b.residuals)
    rng = np.random.default_rng(0)
    A = rng.normal(size=(40, 40))
    A = A + A.T
    small = top_eigenvalues(MatrixOperator(torch.tensor(A)), 30)  # basis would span the space: dense solve
    assert small.method == "dense" and small.hvps == 40
    assert np.allclose(small.eigenvalues, np.sort(np.linalg.eigvalsh(A))[::-1][:30], atol=1e-10)


def test_lanczos_finds_largest_algebraic_and_power_largest_magnitude():
    rng = np.random.default_rng(1)
    Q, _ = np.linalg.qr(rng.normal(size=(300, 300)))
    spectrum = np.concatenate([[-9.0, 5.0, 4.0], rng.uniform(-1, 1, 297)])
    op = MatrixOperator(torch.tensor((Q * spectrum) @ Q.T))
    assert np.isclose(top_eigenvalues(op, 1, tol=1e-8).eigenvalues[0], 5.0, rtol=1e-8)
    power = power_iteration(op, 1, seed=0)  # PyHessian's method converges to the largest magnitude
    assert np.isclose(power.eigenvalues[0], -9.0, rtol=1e-2)


def test_power_iteration_reaches_the_top_eigenvalue_within_its_rule():
    H, evals, _ = truth("mlp")
    op = operator("mlp", batch_size=N_SAMPLES)
    result = power_iteration(op, 2, seed=0, return_vectors=True)
    ratio = max(abs(evals[1]), abs(evals[-1])) / evals[0]
    # Rayleigh-quotient power iteration: stopping at a relative change < tol leaves an error of about
    # tol / (1 - ratio^2) on the kept (previous) estimate; 2x margin for the pre-asymptotic phase.
    assert abs(result.eigenvalues[0] - evals[0]) / evals[0] <= 2 * 1e-3 / (1 - ratio ** 2)
    assert result.hvps == sum(result.info["iterations"]) + 2  # + one residual product per eigenvalue
    v = result.eigenvectors[0].numpy()
    v = v / np.linalg.norm(v)
    assert np.isclose(result.residuals[0], np.linalg.norm(H @ v - result.eigenvalues[0] * v), rtol=1e-6)


# ---------------------------------------------------------------------------------------------- trace
def rademacher_sd(H: np.ndarray) -> float:
    """Exact standard deviation of one Hutchinson sample z^T H z with Rademacher z: sqrt(2 sum_{i!=j} H_ij^2)."""
    off = H - np.diag(np.diag(H))
    return float(np.sqrt(2 * np.sum(off ** 2)))


@pytest.mark.parametrize("name", list(MODELS))
def test_hutchinson_and_hutchpp_within_three_standard_errors(name):
    H, evals, _ = truth(name)
    exact = float(np.trace(H))
    op = operator(name)
    hutch = hutchinson_trace(op, rtol=None, max_hvps=150, seed=1)
    assert hutch.hvps == 150 and len(hutch.samples) == 150
    assert abs(hutch.estimate - exact) <= 3 * hutch.stderr
    # the standard error is honest: it matches the exact Rademacher variance of one sample
    assert 0.75 <= hutch.stderr * math.sqrt(150) / rademacher_sd(H) <= 1.33
    hpp = hutchpp_trace(op, max_hvps=150, seed=1)
    assert hpp.hvps == 150 and hpp.info["sketch_size"] == 50
    assert abs(hpp.estimate - exact) <= 3 * hpp.stderr


@pytest.mark.parametrize("name", list(MODELS))
def test_trace_standard_errors_are_calibrated_over_seeds(name):
    # (estimate - exact) / stderr over 60 seeds behaves like a standard normal: the error bars can be trusted
    H, _, _ = truth(name)
    op = MatrixOperator(torch.tensor(H))
    exact = float(np.trace(H))
    for estimator in (hutchinson_trace, hutchpp_trace):
        z = np.array([(r.estimate - exact) / r.stderr for r in
                      (estimator(op, rtol=None, max_hvps=60, seed=s) for s in range(60))])
        assert abs(z.mean()) <= 3 * 1.2 / math.sqrt(len(z))
        assert 0.7 <= z.std() <= 1.4
        assert np.mean(np.abs(z) <= 3) >= 0.95


def test_hutchpp_beats_hutchinson_on_a_decaying_spectrum():
    rng = np.random.default_rng(2)
    n = 400
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    spectrum = 50.0 * np.arange(1, n + 1) ** -1.5
    op = MatrixOperator(torch.tensor((Q * spectrum) @ Q.T))
    hutch = hutchinson_trace(op, rtol=None, max_hvps=60, seed=1)
    hpp = hutchpp_trace(op, max_hvps=60, seed=1)
    assert abs(hpp.estimate - spectrum.sum()) <= 3 * hpp.stderr
    assert hpp.stderr < hutch.stderr / 5


def test_a_hutchpp_sketch_of_the_whole_space_states_its_rounding_not_zero():
    """A sketch as wide as the space (float32 products): the samples' spread is ~0, so the standard error is the
    rounding bound of the sketch's products (sqrt(dim) eps sum ||H q||), which covers the distance to the float64
    trace; it was 1e-25 before the bound."""
    rng = np.random.default_rng(4)
    n = 300
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    spectrum = rng.normal(size=n) * 10.0
    A = (Q * spectrum) @ Q.T
    result = hutchpp_trace(MatrixOperator(torch.tensor(A, dtype=torch.float32)), max_hvps=2 * n + 20,
                           sketch_size=n, seed=0)
    floor = result.info["rounding_floor"]
    assert floor > 0 and result.stderr >= floor and result.stderr == pytest.approx(floor, rel=1e-12)
    assert abs(result.estimate - spectrum.sum()) <= result.stderr
    assert floor <= 1e-4 * np.abs(spectrum).sum()  # the bound of float32 products, not a loose guess


def test_trace_stops_at_target_relative_error_and_is_deterministic():
    op = operator("mlp")
    result = hutchinson_trace(op, rtol=0.05, max_hvps=1000, min_samples=10, seed=3)
    assert result.hvps < 1000 and result.stderr <= 0.05 * abs(result.estimate)
    again = hutchinson_trace(operator("mlp"), rtol=0.05, max_hvps=1000, min_samples=10, seed=3)
    assert again.estimate == result.estimate and again.hvps == result.hvps
    assert result.info["target_reached"] and result.info["target_rtol"] == 0.05
    assert result.info["relative_stderr"] == pytest.approx(result.stderr / abs(result.estimate))
    with pytest.raises(ConfigError):
        hutchinson_trace(op, rtol=None, max_hvps=None)


@pytest.mark.parametrize("estimator", [hutchinson_trace, hutchpp_trace])
def test_a_target_the_budget_cannot_reach_is_said_in_the_result(estimator):
    """Asked for 1e-6 relative error with 30 products, the estimator spends them all and says the target was not
    reached, with the relative error it got; without a target it says nothing of one."""
    missed = estimator(operator("mlp"), rtol=1e-6, max_hvps=30, seed=3)
    assert missed.hvps == 30 and missed.info["target_reached"] is False
    assert missed.info["relative_stderr"] == pytest.approx(missed.stderr / abs(missed.estimate))
    assert missed.info["relative_stderr"] > 1e-6
    assert "target_reached" in missed.as_dict()
    budget = estimator(operator("mlp"), rtol=None, max_hvps=30, seed=3)
    assert "target_reached" not in budget.info and budget.estimate == missed.estimate


def test_hutchinson_diagonal_matches_exact_diagonal_with_honest_errors():
    H, _, _ = truth("gn_cnn")
    samples = 200
    diag, stderr = hutchinson_diagonal(operator("gn_cnn"), samples=samples, seed=0, block_size=8)
    diag, stderr = diag.numpy(), stderr.numpy()
    exact_sd = np.sqrt(np.sum(H ** 2, axis=1) - np.diag(H) ** 2)  # sd of z_i (Hz)_i: sqrt(sum_{j!=i} H_ij^2)
    live = exact_sd > 1e-8
    z = (diag[live] - np.diag(H)[live]) / stderr[live]
    assert np.mean(np.abs(z) <= 3) >= 0.97
    ratio = stderr[live] * math.sqrt(samples) / exact_sd[live]
    assert 0.85 <= np.median(ratio) <= 1.15
    assert np.allclose(diag[~live], np.diag(H)[~live], atol=1e-10)  # zero-variance coordinates are exact


# ---------------------------------------------------------------------------------------------- density
def test_slq_reproduces_trace_and_second_moment():
    H, evals, _ = truth("mlp")
    d = H.shape[0]
    result = spectral_density(operator("mlp"), steps=20, starts=30, seed=0)
    assert result.hvps == 20 * 30
    first = np.array([np.dot(w, t) for t, w in zip(result.nodes, result.weights)])
    second = np.array([np.dot(w, t ** 2) for t, w in zip(result.nodes, result.weights)])
    for w, t in zip(result.weights, result.nodes):
        assert np.isclose(w.sum(), 1, atol=1e-10)
        assert t.min() >= evals[-1] - 1e-8 and t.max() <= evals[0] + 1e-8
    # each start is a Hutchinson sample of tr(H)/d and of tr(H^2)/d (the quadrature is exact for degree <= 2m-1)
    se1 = first.std(ddof=1) / math.sqrt(len(first))
    se2 = second.std(ddof=1) / math.sqrt(len(second))
    assert abs(first.mean() - np.trace(H) / d) <= 3 * se1
    assert abs(second.mean() - np.sum(evals ** 2) / d) <= 3 * se2
    assert np.isclose(result.trace_estimate(), d * first.mean())
    # 25 steps resolve the extreme eigenvalues
    assert np.isclose(max(t.max() for t in result.nodes), evals[0], rtol=1e-6)


def test_slq_with_a_complete_krylov_space_is_exact():
    rng = np.random.default_rng(3)
    n = 30
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    spectrum = np.linspace(-2, 3, n)
    A = (Q * spectrum) @ Q.T
    result = spectral_density(MatrixOperator(torch.tensor(A)), steps=n, starts=2, seed=0)
    for t, w in zip(result.nodes, result.weights):
        assert np.allclose(np.sort(t), spectrum, atol=1e-8)
        # Gauss quadrature with all n nodes is exact for every polynomial: check degree 5
        z_moment = np.dot(w, t ** 5)
        assert np.isfinite(z_moment)
    grid, density = smoothed_density(result.nodes, result.weights)
    assert len(grid) == 10_000 and np.isclose(density.sum() * (grid[1] - grid[0]), 1.0)
    assert grid[0] == pytest.approx(-2 - 0.01) and grid[-1] == pytest.approx(3 + 0.01)


def test_smoothed_density_is_pyhessians_gaussian():
    from scipy.stats import norm

    nodes, weights = np.array([0.0, 10.0]), np.array([0.25, 0.75])
    grid, density = smoothed_density([nodes], [weights], grid_points=20_001)
    assert grid[0] == pytest.approx(-0.01) and grid[-1] == pytest.approx(10.01)
    sd = math.sqrt(1e-5 * 10.02)  # variance 1e-5 x the grid range
    # PyHessian renormalises by the Riemann sum over the grid, which also cuts off the outer tails (1 sd past the
    # end nodes); computed here with scipy's normal pdf
    mixture = sum(w * norm.pdf(grid, loc=t, scale=sd) for t, w in zip(nodes, weights))
    mass = mixture.sum() * (grid[1] - grid[0])
    assert mass == pytest.approx(np.sum(weights * (norm.cdf((10.01 - nodes) / sd) - norm.cdf((-0.01 - nodes) / sd))),
                                 rel=1e-2)
    for node, weight in zip(nodes, weights):
        at = np.argmin(np.abs(grid - node))
        assert density[at] == pytest.approx(weight * norm.pdf(0, scale=sd) / mass, rel=1e-3)


# ---------------------------------------------------------------------------------------------- batched products
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_over_reverse_blocks_equal_double_backward_and_dense(name):
    H, _, _ = truth(name)
    per_vector = operator(name, batch_size=20, products="double-backward")
    batched = operator(name, batch_size=20, products="forward-over-reverse", block_size=5)  # 12 = 5 + 5 + 2
    assert batched.products == "forward-over-reverse" and batched.preferred_block_size == 5
    V = probes(batched.dim)
    out = batched.matmat(V)
    assert batched.hvps == V.shape[1]
    assert torch.allclose(out, per_vector.matmat(V), rtol=0, atol=1e-12 * float(out.abs().max()))
    assert np.allclose(out.numpy(), H @ V.numpy(), rtol=0, atol=1e-11 * np.abs(H).sum(axis=1).max())
    # and the eigenvalues through the batched operator match numpy's eigh
    evals = truth(name)[1]
    result = top_eigenvalues(batched, 5, tol=1e-8, seed=0)
    assert np.allclose(result.eigenvalues, evals[:5], rtol=1e-7)


def test_forward_over_reverse_in_train_mode_with_batchnorm_and_dropout():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3)).double()
    model.eval()
    x, y = torch.randn(N_SAMPLES, 10, dtype=torch.float64), torch.arange(N_SAMPLES) % 3
    before = {n: b.clone() for n, b in model.named_buffers()}
    per_vector = HessianOperator(model, batches_of(x, y, 20), mode="train", products="double-backward")
    batched = HessianOperator(model, batches_of(x, y, 20), mode="train", products="forward-over-reverse",
                              block_size=4)
    V = probes(batched.dim, k=6)
    out = batched.matmat(V)
    # same batch statistics and the same dropout masks (the per-batch random state), so the same numbers
    assert torch.allclose(out, per_vector.matmat(V), rtol=0, atol=1e-12 * float(out.abs().max()))
    assert torch.equal(batched.matmat(V), out)  # deterministic
    assert not model.training and model[1].track_running_stats  # mode and tracking given back
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n  # running statistics untouched


def test_forward_over_reverse_with_an_unused_parameter():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))
            self.unused = nn.Linear(5, 5)

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(5)
    model = WithUnused().double().eval()
    x, y = torch.randn(20, 10, dtype=torch.float64), torch.arange(20) % 3
    op = HessianOperator(model, [(x, y)], products="forward-over-reverse", block_size=16)
    H = dense_matrix(op)
    used = sum(p.numel() for p in model.body.parameters())
    assert np.all(H[used:] == 0) and np.all(H[:, used:] == 0)
    assert np.allclose(H[:used, :used], exact_hessian(model.body, x, y), atol=1e-12)


def test_forward_over_reverse_falls_back_to_smaller_blocks_on_out_of_memory(monkeypatch):
    import torch.func

    real_vmap = torch.func.vmap
    sizes = []

    def limited_vmap(fn, **kw):
        mapped = real_vmap(fn, **kw)

        def call(tangents):
            size = next(iter(tangents.values())).shape[0]
            sizes.append(size)
            if size > 3:
                raise torch.OutOfMemoryError("simulated: the block does not fit")
            return mapped(tangents)

        return call

    monkeypatch.setattr(torch.func, "vmap", limited_vmap)
    op = operator("mlp", products="forward-over-reverse", block_size=16)
    V = probes(op.dim, k=10)
    out = op.matmat(V)
    assert sizes[:3] == [10, 5, 2] and op.block_limit() == 2  # halved until it fits, and remembered
    reference = operator("mlp", products="double-backward").matmat(V)
    assert torch.allclose(out, reference, rtol=0, atol=1e-12 * float(reference.abs().max()))


def test_product_method_choice():
    op = operator("mlp")
    assert op.products == "double-backward"  # measured faster on CPU for the MAN CNN (benchmarks/hessian_products.py)
    auto = operator("mlp", products="forward-over-reverse")
    assert 1 <= auto.block_limit() <= 256  # sized from free memory
    with pytest.raises(ConfigError, match="product method"):
        operator("mlp", products="jvp")
    with pytest.raises(ConfigError, match="block size"):
        operator("mlp", block_size=0)


def test_top_k_of_a_trained_model_matches_eigh_within_an_hvp_budget():
    # a small MLP trained to low loss on the embedded digits: the outlier-plus-bulk spectrum of a trained network
    from flatfl.data import load_dataset

    d = load_dataset("digits")
    x = d.train_x[:128].reshape(128, -1).double()
    x, y = (x - x.mean()) / x.std(), d.train_y[:128]
    torch.manual_seed(0)
    model = train_full_batch(nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double(), x, y, 150, 0.5)
    evals = np.linalg.eigvalsh(exact_hessian(model, x, y))[::-1]
    op = HessianOperator(model, batches_of(x, y, 64))
    for k, budget in ((10, 4.0), (50, 3.0)):
        result = top_eigenvalues(op, k, tol=1e-4, seed=0)
        assert result.converged.all()
        assert np.allclose(result.eigenvalues, evals[:k], rtol=1e-4, atol=0), k
        assert result.hvps <= budget * k, (k, result.hvps)  # measured: 34 and 119 products


@pytest.mark.parametrize("basis_size,block_size", [(None, None), (60, 1), (64, 4)])
def test_lanczos_meets_its_tolerance_on_a_clustered_spectrum(basis_size, block_size):
    # clusters of 5 eigenvalues 1e-4 apart (relative) at the top, then a dense bulk: the hardest case for a Krylov
    # method (Ritz values stand for a whole cluster until it splits); the reported residual must hold when recomputed
    # explicitly, and every eigenvalue must be within tol of numpy's eigh (with and without restarts, blocks)
    rng = np.random.default_rng(11)
    n, k, tol = 600, 20, 1e-4
    clusters = np.concatenate([c * (1 + 1e-4 * np.arange(5)) for c in (10.0, 7.0, 5.0, 4.0, 3.0)])
    spectrum = np.concatenate([clusters, np.linspace(2.9, 0.0, 100), rng.uniform(-1.0, 0.0, n - 125)])
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    A = (Q * spectrum) @ Q.T
    truth_values = np.sort(np.linalg.eigvalsh(A))[::-1][:k]
    op = MatrixOperator(torch.tensor(A))
    result = top_eigenvalues(op, k, tol=tol, seed=3, basis_size=basis_size, block_size=block_size,
                             exact_residuals=True)
    assert result.converged.all()
    if basis_size is not None:
        assert result.info["restarts"] >= 1
    assert np.all(result.residuals <= tol * np.abs(result.eigenvalues) * 1.01)
    assert np.all(np.abs(result.eigenvalues - truth_values) <= tol * np.abs(truth_values))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_repeated_top_eigenvalue_keeps_every_copy(dtype):
    # issue 30: {5 x6, 4, 3.5, 3, ...} gave five 5s, every value flagged converged. Truth: numpy.linalg.eigh.
    rng = np.random.default_rng(0)
    n = 300
    spectrum = np.concatenate([[5.0] * 6, [4.0, 3.5, 3.0, 2.5, 2.0], rng.uniform(-1, 1.5, n - 11)])
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    A = (Q * spectrum) @ Q.T
    exact = np.sort(np.linalg.eigvalsh(A))[::-1]
    op = MatrixOperator(torch.tensor(A, dtype=dtype))
    for seed in range(2):
        result = top_eigenvalues(op, 10, tol=1e-6, seed=seed, exact_residuals=True)
        assert np.allclose(result.eigenvalues, exact[:10], rtol=1e-5), (seed, result.eigenvalues)
        info = result.info["multiplicity"]
        assert info["status"] == "checked" and info["clusters"][0]["copies"] == 6 and info["checks"]
        assert result.converged.all() and np.all(result.residuals <= 1e-4)


def test_many_fold_top_eigenvalue_and_ordinary_spectra_pay_nothing():
    # a 32-fold top eigenvalue, as at a saddle of a tiny model: the top 10 are all copies of it
    rng = np.random.default_rng(1)
    n = 400
    spectrum = np.concatenate([[3.0] * 32, rng.uniform(-1, 2.5, n - 32)])
    Q, _ = np.linalg.qr(rng.normal(size=(n, n)))
    op = MatrixOperator(torch.tensor((Q * spectrum) @ Q.T))
    result = top_eigenvalues(op, 10, tol=1e-6, seed=0)
    assert np.allclose(result.eigenvalues, 3.0, rtol=1e-5)
    # the copies fill every place: more of them cannot change the top 10
    assert result.info["multiplicity"]["clusters"][0]["copies"] == 10
    # a 3-fold value inside the top 10: found whole, after a check
    spectrum = np.concatenate([[6.0, 5.0], [4.0] * 3, np.linspace(3.5, 2.0, 7), rng.uniform(-1, 1.5, n - 12)])
    op = MatrixOperator(torch.tensor((Q * spectrum) @ Q.T))
    exact = np.sort(spectrum)[::-1]
    result = top_eigenvalues(op, 10, tol=1e-6, seed=0)
    assert np.allclose(result.eigenvalues, exact[:10], rtol=1e-5)
    assert result.info["multiplicity"]["status"] == "checked"
    # distinct eigenvalues: no check, no extra product
    spectrum = np.concatenate([np.linspace(6.0, 2.0, 12), rng.uniform(-1, 1.5, n - 12)])
    op = MatrixOperator(torch.tensor((Q * spectrum) @ Q.T))
    result = top_eigenvalues(op, 10, tol=1e-6, seed=0)
    assert np.allclose(result.eigenvalues, np.sort(spectrum)[::-1][:10], rtol=1e-5)
    assert result.info["multiplicity"] == {"clusters": [], "checks": [], "status": "none seen"}
