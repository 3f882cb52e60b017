"""Any objective: ``hessian(model, data=batch, loss=fn)`` and ``HessianOperator(..., loss=fn)`` with
``fn(model, batch) -> scalar`` for dict and nested-tuple batches, and ``flatfl hessian --loss module:function``;
checked against dense float64 Hessians (torch.autograd.functional.hessian, numpy.linalg.eigh)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

import flatfl
from flatfl.analysis import HessianOperator, hessian
from flatfl.cli import main
from flatfl.errors import ConfigError
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def dense_of(model, objective) -> np.ndarray:
    """The dense Hessian of ``objective(model)`` in the parameters' order, the model's weights swapped in by
    ``torch.func.functional_call`` on a flat vector."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    class Swapped(nn.Module):
        def __init__(self, params):
            super().__init__()
            self.params = params

        def __call__(self, *args):
            return torch.func.functional_call(model, self.params, args)

    def loss(flat):
        params = {n: t.view(s) for n, t, s in zip(names, torch.split(flat, sizes), shapes)}
        return objective(Swapped(params))

    h = torch.autograd.functional.hessian(loss, theta).numpy()
    return (h + h.T) / 2


def lm_problem():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(7, 4), nn.Tanh(), nn.Linear(4, 7)).double()
    g = torch.Generator().manual_seed(1)

    def batch(n):
        ids = torch.randint(0, 7, (n, 5), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(n, 5), "labels": torch.roll(ids, 1, dims=1)}

    return model, batch


def lm_loss(model, batch):
    logits = model(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def test_a_dict_batch_against_the_dense_hessian():
    model, make = lm_problem()
    batch = make(12)
    dense = dense_of(model, lambda m: lm_loss(m, batch))
    truth = np.linalg.eigvalsh(dense)[::-1]
    h = hessian(model, data=batch, loss=lm_loss)
    values, vectors = h.eigenvalues(top_n=3)
    assert np.allclose(values, truth[:3], rtol=1e-6)
    assert [tuple(t.shape) for t in vectors[0]] == [(7, 4), (7, 4), (7,)]
    v = torch.randn(dense.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert np.allclose(h.operator.matvec(v).numpy(), dense @ v.numpy(), rtol=1e-9, atol=1e-12)
    assert abs(np.mean(h.trace()) - np.trace(dense)) < 5 * h.last.stderr + 1e-9
    assert h.num_samples == 12
    # the batched product method takes the same objective (torch.func.functional_call over a wrapper)
    fwd = HessianOperator(model, batch, loss=lm_loss, products="forward-over-reverse")
    V = torch.randn(dense.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert np.allclose(fwd.matmat(V).numpy(), dense @ V.numpy(), rtol=1e-9, atol=1e-12)


def test_batches_of_a_loss_are_weighted_by_their_samples():
    model, make = lm_problem()
    batches = [make(10), make(4), make(2)]  # L = sum_b (n_b / N) loss_b, N = 16
    dense = sum(n / 16 * dense_of(model, lambda m, b=b: lm_loss(m, b)) for n, b in zip((10, 4, 2), batches))
    v = torch.randn(dense.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for op in (HessianOperator(model, batches, loss=lm_loss), hessian(model, dataloader=iter(batches), loss=lm_loss)
               .operator):
        assert op.num_samples == 16
        assert np.allclose(op.matvec(v).numpy(), dense @ v.numpy(), rtol=1e-9, atol=1e-12)


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x1, x2):
        return self.head(torch.tanh(self.a(x1) + self.b(x2)))


def test_a_nested_tuple_batch_against_the_dense_hessian():
    torch.manual_seed(0)
    model = TwoInputs().double()
    x1, x2 = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, 2, dtype=torch.float64)
    y, w = torch.arange(20) % 2, torch.rand(20, dtype=torch.float64)
    batch = ((x1, x2), (y, w))  # inputs and (targets, sample weights)

    def weighted(model, batch):
        (a, b), (t, weights) = batch
        return (F.cross_entropy(model(a, b), t, reduction="none") * weights).mean()

    dense = dense_of(model, lambda m: weighted(m, batch))
    truth = np.linalg.eigvalsh(dense)[::-1]
    values, _ = hessian(model, data=batch, loss=weighted).eigenvalues(top_n=2)
    assert np.allclose(values, truth[:2], rtol=1e-6)


def test_bad_objectives_are_one_line():
    model, make = lm_problem()
    batch = make(4)
    cases = [
        (lambda: hessian(model, nn.CrossEntropyLoss(), data=batch, loss=lm_loss), "not both"),
        (lambda: hessian(model, data=batch, loss=lambda m, b: m(b["input_ids"]).sum(-1)).eigenvalues(),
         "must return a scalar"),
        (lambda: hessian(model, data=batch, loss=lambda m, b: 1.0).trace(), "must return a scalar tensor"),
        (lambda: hessian(model, data=batch, loss=lambda m, b: lm_loss(m, b).to(torch.complex64)).trace(),
         "must return a real floating-point scalar (the mean loss over the batch), got complex64"),
        (lambda: hessian(model, data={"name": "x"}, loss=lm_loss), "holds no tensor with a batch dimension"),
        (lambda: HessianOperator(model, [], loss=lm_loss), "the data is empty"),
        (lambda: HessianOperator(model, batch, loss="lm_loss"), "loss must be a function"),
    ]
    for call, text in cases:
        with pytest.raises(ConfigError) as err:
            call()
        assert text in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("objective") / "run")


LOSSES = '''
import torch.nn.functional as F


def smoothed(model, batch):
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets, label_smoothing=0.2)
'''


def test_the_command_line_names_a_loss(run_dir, tmp_path, monkeypatch):
    (tmp_path / "my_losses.py").write_text(LOSSES)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "h"
    r = CliRunner().invoke(main, ["hessian", str(run_dir), "--loss", "my_losses:smoothed", "--top", "2", "--samples",
                                  "128", "--no-trace", "--quiet", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "hessian.json").read_text())
    assert report["settings"]["loss"] == "my_losses:smoothed"

    import my_losses

    ckpt = flatfl.load_checkpoint(run_dir)
    batches = [(x.double(), y) for x, y in ckpt.eval_batches("train", samples=128, seed=0)]
    model = ckpt.model.double()
    op = HessianOperator(model, batches, loss=my_losses.smoothed)
    smoothed = flatfl.analysis.top_eigenvalues(op, 2, tol=1e-8).eigenvalues
    plain = flatfl.analysis.top_eigenvalues(HessianOperator(model, batches), 2, tol=1e-8).eigenvalues
    assert np.allclose(report["top_eigenvalues"], smoothed, rtol=1e-3)
    assert not np.allclose(smoothed, plain, rtol=1e-2)  # the loss named is the one used

    for spec, text in (("nowhere:f", "cannot import 'nowhere'"), ("my_losses:absent", "has no 'absent'"),
                       ("my_losses", "--loss must be 'module:function'")):
        r = CliRunner().invoke(main, ["hessian", str(run_dir), "--loss", spec, "--quiet", "--out", str(tmp_path / "x")])
        assert r.exit_code == 2 and text in r.output and "Traceback" not in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
