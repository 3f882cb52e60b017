"""The Gauss-Newton matrix J^T H_out J for losses convex in the outputs besides cross-entropy (squared error with mean
and sum reductions, Huber, L1's linear pieces, a custom log-cosh loss), as criteria, loss modules and split
objectives, against dense matrices built here per batch from torch.autograd.functional's Jacobian of the outputs and
Hessian of the loss in the outputs; the losses for which it is undefined refused in one line; the command line with
a squared-error --loss."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from flatfl import load_checkpoint
from flatfl.analysis import GGNOperator, hessian
from flatfl.cli import main
from flatfl.errors import ConfigError
from no_double_backward import Square
from test_hessian_second_order import SquareOnce  # x^2, its backward @once_differentiable
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def regression_data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(13, 4, generator=g, dtype=torch.float64), torch.randn(13, 3, generator=g, dtype=torch.float64)


def split(x, y):
    return [(x[:5], y[:5]), (x[5:], y[5:])]  # uneven: the sample-weighted mean of the batches' matrices


def log_cosh(outputs, targets):
    """A custom loss convex in the outputs: mean log cosh of the residuals (second derivative 1 - tanh^2 > 0)."""
    return torch.log(torch.cosh(outputs - targets)).mean()


def dense_ggn(model, batches, criterion) -> np.ndarray:
    """sum_b (n_b / N) J_b^T H_b J_b: batch b's Jacobian of the outputs in the flat parameters and the Hessian of
    ``criterion(outputs, targets)`` in its outputs, both from torch.autograd.functional."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def outputs(flat, x):
        params, i = {}, 0
        for n, s in zip(names, shapes):
            params[n] = flat[i:i + s.numel()].view(s)
            i += s.numel()
        return torch.func.functional_call(model, params, (x,)).reshape(-1)

    total = torch.zeros(len(theta), len(theta), dtype=torch.float64)
    count = sum(len(y) for _, y in batches)
    for x, y in batches:
        J = torch.autograd.functional.jacobian(lambda f: outputs(f, x), theta)  # (n_b * C, dim)
        out = model(x).detach()
        H = torch.autograd.functional.hessian(lambda o: criterion(o.view(out.shape), y), out.reshape(-1))
        total += len(y) / count * (J.T @ H @ J)
    return total.numpy()


CRITERIA = {
    "cross-entropy": nn.CrossEntropyLoss(),
    "mse-mean": nn.MSELoss(),
    "mse-sum": nn.MSELoss(reduction="sum"),
    "mse-function": F.mse_loss,
    "huber": nn.HuberLoss(delta=0.5),
    "l1": nn.L1Loss(),
    "log-cosh": log_cosh,
}


@pytest.mark.parametrize("name", list(CRITERIA))
def test_products_are_the_dense_ggn_of_each_convex_loss(name):
    model = mlp()
    x, y = regression_data()
    if name == "cross-entropy":
        y = torch.arange(13) % 3
    criterion = CRITERIA[name]
    dense = dense_ggn(model, split(x, y), criterion)
    op = GGNOperator(model, split(x, y), loss_fn=criterion)
    V = torch.randn(op.dim, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    np.testing.assert_allclose(op.matmat(V).numpy(), dense @ V.numpy(), rtol=1e-9, atol=1e-12)
    eigenvalues = np.linalg.eigvalsh(dense)
    if name == "l1":  # linear pieces: H_out = 0 wherever the residuals are non-zero
        assert not dense.any()
    else:
        assert eigenvalues[-1] > 0 and eigenvalues[0] >= -1e-12 * eigenvalues[-1]  # positive semi-definite


def squared_error(model, batch):
    return F.mse_loss(model(batch["x"]), batch["t"], reduction="sum")


squared_error.outputs = lambda model, batch: model(batch["x"])
squared_error.loss_of_outputs = lambda outputs, batch: F.mse_loss(outputs, batch["t"], reduction="sum")


def test_a_split_objective_of_squared_error_and_the_python_api():
    model = mlp()
    x, y = regression_data()
    dense = dense_ggn(model, split(x, y), lambda o, t: F.mse_loss(o, t, reduction="sum"))
    op = GGNOperator(model, [{"x": x[:5], "t": y[:5]}, {"x": x[5:], "t": y[5:]}], loss=squared_error)
    eye = torch.eye(op.dim, dtype=torch.float64)
    np.testing.assert_allclose(op.matmat(eye).numpy(), dense, rtol=1e-9, atol=1e-12)

    h = hessian(model, nn.MSELoss(), data=(x, y), curvature="ggn")
    values, _ = h.eigenvalues(top_n=2, tol=1e-8)
    true = np.linalg.eigvalsh(dense_ggn(model, [(x, y)], nn.MSELoss()))[::-1]
    np.testing.assert_allclose(values, true[:2], rtol=1e-6)


REFUSED = {
    "non-convex": (lambda o, t: -F.mse_loss(o, t), "is not convex there"),
    "once-differentiable": (lambda o, t: SquareOnce.apply(o - t).mean(), "@once_differentiable"),
    "no-double-backward": (lambda o, t: Square.apply(o - t).mean(), "failed to differentiate its gradient again"),
    # |r|^1.5 at r = 0: convex, once differentiable, its second derivative infinite
    "kink": (lambda o, t: ((o - o.detach()).abs() ** 1.5).mean(), "not finite"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_loss_without_a_ggn_is_refused_in_one_line(name):
    model = mlp()
    x, y = regression_data()
    criterion, words = REFUSED[name]
    op = GGNOperator(model, split(x, y), loss_fn=criterion)
    with pytest.raises(ConfigError) as err:
        op.matmat(torch.ones(op.dim, 1, dtype=torch.float64))
    message = str(err.value)
    assert words in message and "\n" not in message, message
    assert "<lambda>" in message and "--curvature hessian" in message, message


LOSSES = '''
import torch.nn.functional as F


def one_hot_mse(model, batch):
    inputs, targets = batch
    return F.mse_loss(model(inputs), F.one_hot(targets, 10).to(inputs.dtype))


one_hot_mse.outputs = lambda model, batch: model(batch[0])
one_hot_mse.loss_of_outputs = lambda outputs, batch: F.mse_loss(outputs, F.one_hot(batch[1], 10).to(outputs.dtype))


def concave(model, batch):
    return -one_hot_mse(model, batch)


concave.outputs = one_hot_mse.outputs
concave.loss_of_outputs = lambda outputs, batch: -one_hot_mse.loss_of_outputs(outputs, batch)
'''


def test_the_command_line_with_a_squared_error_loss(tmp_path, monkeypatch):
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    run = train_tiny(tmp_path / "run")
    (tmp_path / "losses.py").write_text(LOSSES)
    samples = 40

    def analyse(out, loss):
        return CliRunner().invoke(main, ["hessian", str(run), "--samples", str(samples), "--quiet", "--curvature",
                                         "ggn", "--top", "3", "--no-trace", "--loss",
                                         f"{tmp_path / 'losses.py'}:{loss}", "--out", str(out)])

    r = analyse(tmp_path / "mse", "one_hot_mse")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "mse" / "hessian.json").read_text())
    ckpt = load_checkpoint(run)
    batches = ckpt.eval_batches(split="train", samples=samples, batch_size=256, seed=0)
    model = ckpt.model.double().eval()
    batches = [(x.double(), y) for x, y in batches]
    true = np.linalg.eigvalsh(dense_ggn(model, batches, lambda o, t: F.mse_loss(o, F.one_hot(t, 10).double())))
    np.testing.assert_allclose(report["top_eigenvalues"], true[::-1][:3], rtol=1e-4)

    r = analyse(tmp_path / "concave", "concave")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "concave.loss_of_outputs" in r.output and "is not convex there" in r.output
    assert "internal error" not in r.output and not (tmp_path / "concave" / "hessian.json").exists()
