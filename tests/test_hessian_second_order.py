"""An operation without a second derivative is one line naming it, from Python and from ``flatfl hessian``, never
"internal error RuntimeError" and never a Hessian with silent rows of zeros; a custom Function that can be
differentiated twice still gives the dense Hessian."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn
from torch.autograd.function import once_differentiable

from dense import dense_hessian
from flatfl.analysis import HessianOperator, hessian
from flatfl.analysis.operators.second_order import SecondDerivativeError
from flatfl.cli import main
from flatfl.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class SquareOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareTwice(torch.autograd.Function):
    """The same function with a backward torch can differentiate again."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Net(nn.Module):
    def __init__(self, square):
        super().__init__()
        self.square = square
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(self.square.apply(torch.tanh(self.a(x))))


class Distances(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.centres = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return -torch.cdist(self.a(x), self.centres, compute_mode="donot_use_mm_for_euclid_dist")


def data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return torch.randn(30, 5, generator=g, dtype=dtype), torch.arange(30) % 3


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_a_once_differentiable_function_is_named_not_zeroed():
    torch.manual_seed(0)
    x, y = data()
    model = Net(SquareOnce).double()
    for call in (lambda: hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=False).eigenvalues(top_n=2),
                 lambda: hessian(model, data=(x, y), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1])).trace(),
                 lambda: HessianOperator(model, (x, y)).matvec(torch.ones(sum(p.numel() for p in model.parameters()),
                                                                          dtype=torch.float64)),
                 lambda: HessianOperator(model, (x, y), products="forward-over-reverse").matvec(
                     torch.ones(sum(p.numel() for p in model.parameters()), dtype=torch.float64))):
        with pytest.raises(ConfigError) as err:
            call()
        text = one_line(err)
        assert "no second derivative" in text and "SquareOnce" in text and "@once_differentiable" in text \
            or "SquareOnce" in text and "torch.func" in text, text
    # a Function whose backward is differentiable gives the dense Hessian
    twice = Net(SquareTwice).double()
    twice.load_state_dict(model.state_dict())
    dense = dense_hessian(twice, x, y)
    values, _ = hessian(twice, nn.CrossEntropyLoss(), data=(x, y), cuda=False).eigenvalues(top_n=2)
    assert np.allclose(values, np.linalg.eigvalsh(dense)[::-1][:2], rtol=1e-6)


def test_an_op_without_a_double_backward_is_named():
    torch.manual_seed(0)
    x, y = data()
    model = Distances().double()
    with pytest.raises(SecondDerivativeError) as err:
        hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=False).eigenvalues(top_n=1)
    assert "'_cdist_backward'" in one_line(err) and "the backward of 'cdist'" in str(err.value)


def test_auto_products_fall_back_to_double_backward(monkeypatch):
    # where "auto" picks forward-over-reverse (CUDA), a Function without torch.func support falls back
    import flatfl.analysis.operators.hessian as operator

    monkeypatch.setitem(operator.AUTO_PRODUCTS, "cpu", "forward-over-reverse")
    torch.manual_seed(0)
    x, y = data()
    model = Net(SquareTwice).double()
    op = HessianOperator(model, (x, y))
    assert op.products == "forward-over-reverse"
    dense = dense_hessian(model, x, y)
    v = torch.randn(op.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert np.allclose(op.matvec(v).numpy(), dense @ v.numpy(), rtol=1e-9, atol=1e-12)
    assert op.products == "double-backward"


LOSSES = '''
import torch
import torch.nn.functional as F


def via_cdist(model, batch):
    inputs, targets = batch
    out = model(inputs)
    distances = torch.cdist(out, out[:10], compute_mode="donot_use_mm_for_euclid_dist")
    return F.cross_entropy(-distances, targets % 10)
'''


def test_the_command_says_which_operation(tmp_path, monkeypatch):
    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--dataset", "digits", "--model", "tiny", "--rounds", "1", "--clients", "2",
                                  "--local-epochs", "1", "--quiet", "--out", str(run)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    (tmp_path / "cdist_losses.py").write_text(LOSSES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLATFL_DEBUG", raising=False)
    r = CliRunner().invoke(main, ["hessian", str(run), "--loss", "cdist_losses:via_cdist", "--samples", "64", "--quiet",
                                  "--out", str(tmp_path / "h")])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("flatfl: error: the loss has no second derivative") and "'_cdist_backward'" in r.output
    assert "internal error" not in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "h" / "hessian.json").exists()
