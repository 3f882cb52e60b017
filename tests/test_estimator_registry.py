"""An eigenvalue estimator registered from outside flatfl (here: a dense ``torch.linalg.eigh`` of the operator formed
column by column) runs through ``flatfl hessian`` end to end like a built-in one: the settings accept its name,
hessian.json, eigenvalues.csv and the figure are written, the command prints its label, and its values equal the
built-in Lanczos ones (an independent check of both)."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from flatfl.analysis import EigenResult
from flatfl.analysis.estimators.by_name import estimate_eigenvalues
from flatfl.cli import main
from flatfl.errors import ConfigError
from flatfl.analysis.estimators.registry import (EIGEN_ESTIMATORS, estimator, estimator_names, register_estimator,
                                      unregister_estimator)
from flatfl.analysis.commands.hessian_settings import HessianSettings
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOY = "toy-dense"


def dense_eigh(op, k, *, tol, seed, return_vectors, exact_residuals):
    """The k largest algebraic eigenvalues of ``op`` from its dense matrix (``dim`` products; small operators)."""
    n = op.dim
    columns = []
    for a in range(0, n, 64):
        width = min(64, n - a)
        E = torch.zeros(n, width, dtype=op.dtype, device=op.device)
        E[torch.arange(a, a + width), torch.arange(width)] = 1
        columns.append(op.matmat(E).double().cpu())
    H = torch.cat(columns, dim=1)
    H = 0.5 * (H + H.T)
    values, vectors = torch.linalg.eigh(H)
    order = torch.argsort(values, descending=True)[:k]
    theta, Y = values[order], vectors[:, order]
    residuals = torch.linalg.norm(H @ Y - Y * theta, dim=0)
    return EigenResult(eigenvalues=theta.numpy(), residuals=residuals.numpy(), converged=np.ones(k, dtype=bool),
                       hvps=n, method=TOY, eigenvectors=Y.T.to(op.dtype) if return_vectors else None,
                       info={"dense": True})


@pytest.fixture
def toy():
    """The toy estimator registered for the test, and removed after it (other tests see the package's own registry)."""
    entry = register_estimator(TOY, "eigenvalues", dense_eigh, label="largest algebraic", title="dense eigh (toy)")
    yield entry
    unregister_estimator(TOY, "eigenvalues")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("registry") / "run") / "final.pt"


def hessian(*args):
    return CliRunner().invoke(main, ["hessian", *args], catch_exceptions=False)


def test_a_registered_estimator_runs_through_the_command_line(checkpoint, tmp_path, toy):
    assert TOY in estimator_names("eigenvalues") and EIGEN_ESTIMATORS[TOY] is toy
    HessianSettings(method=TOY).validate()  # the settings check the registry as it is now
    out = tmp_path / "toy"
    r = hessian(str(checkpoint), "--method", TOY, "--top", "3", "--samples", "64", "--no-trace", "--quiet",
                "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "top eigenvalues of the Hessian (largest algebraic): " in r.output
    for name in ("hessian.json", "eigenvalues.csv", "eigenvalues.png", "eigenvalues.pdf"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    report = json.loads((out / "hessian.json").read_text())
    assert report["settings"]["method"] == TOY and report["eigen"]["method"] == TOY
    assert report["eigen"]["residual_kind"] == "explicit"  # the registry's default for the toy
    assert report["eigen"]["hvps"] == report["num_params"] == report["hvps_total"]
    rows = list(csv.DictReader(open(out / "eigenvalues.csv")))
    assert [float(row["eigenvalue"]) for row in rows] == report["top_eigenvalues"]

    reference = tmp_path / "lanczos"
    r = hessian(str(checkpoint), "--top", "3", "--tol", "1e-6", "--samples", "64", "--no-trace", "--quiet",
                "--out", str(reference))
    assert r.exit_code == 0, r.output
    lanczos = json.loads((reference / "hessian.json").read_text())["top_eigenvalues"]
    toy_values = np.array(report["top_eigenvalues"])
    assert np.all(np.diff(toy_values) <= 0)
    assert np.allclose(toy_values, lanczos, rtol=1e-6, atol=0), (toy_values, lanczos)


def test_unknown_and_unregistered_names_are_refused_in_one_line(toy):
    unregister_estimator(TOY, "eigenvalues")
    with pytest.raises(ConfigError) as e:
        HessianSettings(method=TOY).validate()
    assert str(e.value).startswith(f"unknown eigenvalue method '{TOY}'")
    with pytest.raises(ConfigError, match="already registered"):
        register_estimator("lanczos", "eigenvalues", dense_eigh)
    with pytest.raises(ConfigError, match="module:function"):
        register_estimator("other", "eigenvalues", "no-colon")
    with pytest.raises(ConfigError, match="estimator kind"):
        register_estimator("other", "spectrum", dense_eigh)


def test_registered_defaults_labels_and_pairings():
    assert estimator("eigenvalues", "lanczos").label == "largest algebraic"
    assert estimator("eigenvalues", "power").label == "largest magnitude"
    assert estimator("eigenvalues", "power").residuals == "explicit"
    assert estimator("eigenvalues", "lanczos").residuals == "lanczos relation"
    assert HessianSettings(method="power").resolved_trace_method == "pyhessian"
    assert HessianSettings().resolved_trace_method == "hutchpp"
    assert dict(estimator("eigenvalues", "power").defaults) == {"max_iter": 100}


def test_a_path_is_imported_only_when_the_estimator_runs(toy):
    entry = register_estimator("toy-path", "eigenvalues", "flatfl.analysis.estimators.by_name:lanczos",
                               label="largest algebraic")
    try:
        matrix = torch.diag(torch.tensor([5.0, -9.0, 3.0, 1.0], dtype=torch.float64))
        result = estimate_eigenvalues(matrix, "toy-path", 2, tol=1e-8)
        assert np.allclose(result.eigenvalues, [5.0, 3.0])
        assert entry.load() is estimator("eigenvalues", "lanczos").load()
    finally:
        unregister_estimator("toy-path", "eigenvalues")


def test_a_taken_name_is_refused_unless_its_caller_replaces_it_on_purpose(toy):
    """The one rule for a taken name (docs/analysis.md): refused in one line; ``replace=True`` is the caller's own
    choice (an entry point may not make it: tests/test_plugins_and_user_code.py)."""
    with pytest.raises(ConfigError) as e:
        register_estimator(TOY, "eigenvalues", dense_eigh)
    assert str(e.value) == f"an eigenvalue method called '{TOY}' is already registered (pass replace=True to " \
                           "replace it)"
    assert estimator("eigenvalues", TOY) is toy
    again = register_estimator(TOY, "eigenvalues", dense_eigh, title="again", replace=True)
    assert estimator("eigenvalues", TOY) is again and again.title == "again"


def _tiny_model_and_dense_hessian():
    """A float64 two-layer network, a batch, and the dense Hessian of its mean cross-entropy over its flat
    parameters (torch.autograd.functional.hessian: the truth the estimators are checked against)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    flat = torch.cat([p.detach().reshape(-1) for p in params])

    def loss(v):
        chunks, offset = {}, 0
        for (name, _), shape in zip(model.named_parameters(), shapes):
            chunks[name] = v[offset:offset + shape.numel()].reshape(shape)
            offset += shape.numel()
        out = torch.func.functional_call(model, chunks, (x,))
        return torch.nn.functional.cross_entropy(out, y)

    return model, (x, y), torch.autograd.functional.hessian(loss, flat).numpy()


def test_per_layer_and_the_pyhessian_api_run_any_registered_estimator(toy):
    """--per-layer's blocks and ``hessian(...).eigenvalues`` ask the registry: the toy estimator runs there, and
    gives the dense Hessian's eigenvalues (each block's: of its principal sub-matrix)."""
    from flatfl.analysis import hessian, per_layer_curvature

    model, batch, dense = _tiny_model_and_dense_hessian()
    h = hessian(model, torch.nn.functional.cross_entropy, data=batch)
    values, vectors = h.eigenvalues(top_n=2, method=TOY)
    assert np.allclose(values, np.sort(np.linalg.eigvalsh(dense))[::-1][:2], rtol=1e-9, atol=1e-12)
    assert h.last.method == TOY and len(vectors) == 2

    layers = per_layer_curvature(h.operator, 1, dense_up_to=0, method=TOY, trace_method="hutchinson",
                                 trace_hvps=50)
    first, second = 4 * 3 + 3, 3 * 3 + 3  # each Linear's weight and bias: one block
    for block, (a, b) in zip(layers.blocks, ((0, first), (first, first + second))):
        truth = np.linalg.eigvalsh(dense[a:b, a:b])[-1]
        assert block.method == f"{TOY}+hutchinson" and np.isclose(block.eigenvalues[0], truth, rtol=1e-9)
    with pytest.raises(ConfigError, match="unknown trace method 'diagonal'"):
        per_layer_curvature(h.operator, 1, trace_method="diagonal")
