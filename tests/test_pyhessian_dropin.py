"""PyHessian's documented calls, with only the import line changed, give PyHessian's return types and the right
numbers: checked against a dense float64 Hessian (numpy.linalg.eigh) and against PyHessian itself on the same model
and data (its eigenvalues and trace; PyHessian 0.1's ``density`` calls the removed ``torch.eig``)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dense import dense_hessian
from flatfl.analysis import hessian  # was: from pyhessian import hessian
from flatfl.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def problem(dtype=torch.float64):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).to(dtype)
    x = torch.randn(48, 6, dtype=dtype)
    y = torch.arange(48) % 3
    return model, x, y


def flat(vector_parts) -> np.ndarray:
    return torch.cat([t.reshape(-1) for t in vector_parts]).double().numpy()


def check_pyhessian_answers(hessian_comp, model, dense, truth):
    """The three documented calls: types as PyHessian's, numbers as the dense Hessian's."""
    top_eigenvalues, top_eigenvector = hessian_comp.eigenvalues(top_n=3)
    assert isinstance(top_eigenvalues, list) and all(type(v) is float for v in top_eigenvalues)
    assert np.allclose(top_eigenvalues, truth[:3], rtol=1e-3)  # whatever the estimator: within 1e-3 relative
    assert isinstance(top_eigenvector, list) and len(top_eigenvector) == 3
    for value, vector in zip(top_eigenvalues, top_eigenvector):
        assert [tuple(t.shape) for t in vector] == [tuple(p.shape) for p in model.parameters()]
        v = flat(vector)
        assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)
        assert np.linalg.norm(dense @ v - value * v) < 1e-2 * abs(value)  # an eigenvector of the dense Hessian

    trace = hessian_comp.trace()
    assert isinstance(trace, list) and all(type(t) is float for t in trace) and len(trace) >= 2
    stderr = np.std(trace, ddof=1) / np.sqrt(len(trace))
    assert abs(np.mean(trace) - np.trace(dense)) < 5 * stderr + 1e-9
    assert np.mean(trace) == pytest.approx(hessian_comp.last.estimate, rel=1e-12)  # the rich result behind it

    density_eigen, density_weight = hessian_comp.density()
    assert isinstance(density_eigen, list) and len(density_eigen) == len(density_weight) == 1  # n_v = 1
    nodes, weights = np.array(density_eigen[0]), np.array(density_weight[0])
    assert len(nodes) == min(100, dense.shape[0]) and weights.sum() == pytest.approx(1.0, abs=1e-9)
    assert nodes.max() == pytest.approx(truth[0], rel=1e-6) and nodes.min() == pytest.approx(truth[-1], abs=1e-6)
    return top_eigenvalues, trace


def test_the_documented_calls_agree_with_the_dense_hessian():
    model, x, y = problem()
    inputs, targets = x, y
    criterion = torch.nn.CrossEntropyLoss()
    dense = dense_hessian(model, x, y)
    truth = np.linalg.eigvalsh(dense)[::-1]

    hessian_comp = hessian(model, criterion, data=(inputs, targets), cuda=False)
    check_pyhessian_answers(hessian_comp, model, dense, truth)
    # PyHessian's attributes
    assert hessian_comp.params == list(model.parameters()) and hessian_comp.device == "cpu"
    assert hessian_comp.full_dataset is False and hessian_comp.model is model

    # the richer answers stay reachable
    rich = hessian_comp.top_eigenvalues(3)
    assert np.allclose(rich.eigenvalues, truth[:3], rtol=1e-3) and rich.hvps > 0 and len(rich.residuals) == 3
    tr = hessian_comp.trace_estimate()
    assert tr.stderr > 0 and abs(tr.estimate - np.trace(dense)) < 5 * tr.stderr


def test_the_dataloader_variant_is_the_sample_weighted_mean():
    model, x, y = problem()
    dense = dense_hessian(model, x, y)
    truth = np.linalg.eigvalsh(dense)[::-1]
    loader = DataLoader(TensorDataset(x, y), batch_size=20)  # batches of 20, 20 and 8: weighted by their sizes
    hessian_comp = hessian(model, torch.nn.CrossEntropyLoss(), dataloader=loader, cuda=False)
    assert hessian_comp.full_dataset is True and hessian_comp.num_samples == 48
    check_pyhessian_answers(hessian_comp, model, dense, truth)


def test_power_method_and_pyhessian_trace_are_pyhessian_step_for_step():
    pyhessian = pytest.importorskip("pyhessian")
    model, x, y = problem(torch.float32)  # PyHessian draws float32 vectors
    criterion = nn.CrossEntropyLoss()
    dense = dense_hessian(copy.deepcopy(model).double(), x.double(), y)
    truth = np.linalg.eigvalsh(dense)[::-1]
    for loader in (False, True):
        data = dict(dataloader=[(x[:24], y[:24]), (x[24:], y[24:])]) if loader else dict(data=(x, y))
        theirs = pyhessian.hessian(copy.deepcopy(model), criterion, cuda=False, **data)
        ours = hessian(model, criterion, cuda=False, seed=5, **data)
        torch.manual_seed(5)
        their_values, their_vectors = theirs.eigenvalues(top_n=3)
        our_values, our_vectors = ours.eigenvalues(top_n=3, method="power")
        assert np.allclose(our_values, their_values, rtol=1e-4)  # the same rule, the same draws
        for a, b in zip(our_vectors, their_vectors):
            assert abs(float(np.dot(flat(a), flat(b)))) > 1 - 1e-3
        torch.manual_seed(6)  # the trace's stream is seed + 1
        their_trace = theirs.trace()
        our_trace = ours.trace(method="pyhessian")
        assert len(our_trace) == len(their_trace) and np.allclose(our_trace, their_trace, rtol=1e-4)

        # flatfl's default answers, against the dense truth, are at least as good as PyHessian's
        lanczos, _ = ours.eigenvalues(top_n=3)
        assert np.allclose(lanczos, truth[:3], rtol=1e-3)
        assert np.max(np.abs(np.array(lanczos) - truth[:3])) <= np.max(np.abs(np.array(their_values) - truth[:3])) + 1e-4
        trace = ours.trace()
        assert abs(np.mean(trace) - np.trace(dense)) < 5 * ours.last.stderr + 1e-6
        try:  # PyHessian 0.1's density calls torch.eig, removed from torch: compare where it runs
            their_nodes, _ = theirs.density()
        except (AttributeError, RuntimeError):
            continue
        assert max(map(max, their_nodes)) == pytest.approx(max(map(max, ours.density()[0])), rel=1e-3)


def test_cuda_true_without_cuda_is_one_line_naming_the_fix():
    model, x, y = problem()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as err:
        hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=True)
    assert "\n" not in str(err.value) and "pass cuda=False" in str(err.value)
    with pytest.raises(ConfigError, match="cuda must be True, False or None"):
        hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda="yes")


def test_bad_arguments_of_the_calls_are_one_line():
    model, x, y = problem()
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=False)
    for call, text in ((lambda: h.eigenvalues(top_n=0), "positive integer"),
                       (lambda: h.eigenvalues(maxIter=0), "maxIter must be a positive integer"),
                       (lambda: h.eigenvalues(method="arnoldi"), "unknown eigenvalue method 'arnoldi'"),
                       (lambda: h.trace(method="diagonal"), "unknown trace method 'diagonal'"),
                       (lambda: h.trace(tol=0), "tol must be positive")):
        with pytest.raises(ConfigError) as err:
            call()
        assert text in str(err.value) and "\n" not in str(err.value)
