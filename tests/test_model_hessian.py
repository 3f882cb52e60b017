"""What PyHessian users pass: ``hessian(model, criterion, data=(x, y))``, a list of batches or a DataLoader, for
:func:`flatfl.analysis.hessian` and every entry point that takes an evaluation set (``HessianOperator``,
``SurfaceEvaluator``); a wrong shape is one line naming the accepted forms. Checked against a dense Hessian."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dense import dense_hessian
from flatfl.analysis import HessianOperator, SurfaceEvaluator, as_batches, hessian
from flatfl.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ACCEPTED = "one (inputs, targets) batch, a list of such batches, or a DataLoader that yields them"


def problem():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    x = torch.randn(48, 6, dtype=torch.float64)
    y = torch.arange(48) % 3
    return model, x, y


def test_one_batch_a_list_and_a_dataloader_give_the_dense_hessian(tmp_path):
    model, x, y = problem()
    dense = dense_hessian(model, x, y)
    truth = np.linalg.eigvalsh(dense)[::-1]
    v = torch.randn(dense.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    forms = {"(x, y)": (x, y), "[x, y]": [x, y], "list": [(x[:20], y[:20]), (x[20:], y[20:])],
             "DataLoader": DataLoader(TensorDataset(x, y), batch_size=16)}
    for name, data in forms.items():
        op = HessianOperator(model, data)
        assert op.num_samples == 48, name
        assert np.allclose(op.matvec(v).numpy(), dense @ v.numpy(), rtol=1e-9, atol=1e-12), name
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y))
    top = h.top_eigenvalues(5)  # the rich result; h.eigenvalues(top_n=5) is PyHessian's (tests/test_pyhessian_dropin.py)
    assert np.allclose(top.eigenvalues, truth[:5], rtol=1e-6, atol=1e-9)
    tr = h.trace_estimate()
    assert tr.stderr > 0 and abs(tr.estimate - np.trace(dense)) < 5 * tr.stderr
    same = hessian(model, nn.CrossEntropyLoss(), dataloader=DataLoader(TensorDataset(x, y), batch_size=16))
    assert np.allclose(same.top_eigenvalues(5).eigenvalues, top.eigenvalues, rtol=1e-8)
    values, _ = same.eigenvalues(top_n=5)
    assert values == same.last.eigenvalues.tolist() and np.allclose(values, top.eigenvalues, rtol=1e-8)

    # the density: SLQ over the exact spectrum's support; its figure and its curve written where asked
    esd = h.spectral_density(steps=30, starts=2)
    assert min(t.min() for t in esd.nodes) >= truth[-1] - 1e-6 and max(t.max() for t in esd.nodes) <= truth[0] + 1e-6
    png = h.save_density(tmp_path / "d.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = np.loadtxt(h.save_density(tmp_path / "d.csv"), delimiter=",", skiprows=1)
    step = rows[1, 0] - rows[0, 0]
    assert rows.shape[1] == 2 and np.allclose(np.diff(rows[:, 0]), step, rtol=1e-5)
    assert float(rows[:, 1].sum() * step) == pytest.approx(1.0, abs=1e-2)  # a density over the grid
    with pytest.raises(ConfigError, match=r"name a \.png, \.pdf, \.csv file"):
        h.save_density(tmp_path / "d.txt")
    assert not (tmp_path / "d.txt").exists()


def test_a_batch_of_two_samples_is_one_batch_not_two():
    # (x, y) with 2 samples unpacks as two "batches" (x[0], x[1]) if taken for a list: it is one batch of 2
    model, x, y = problem()
    op = HessianOperator(model, (x[:2], y[:2]))
    assert op.num_samples == 2 and len(op.batches) == 1
    dense = dense_hessian(model, x[:2], y[:2])
    e = torch.eye(dense.shape[0], dtype=torch.float64)[:, 0]
    assert np.allclose(op.matvec(e).numpy(), dense[:, 0], rtol=1e-9, atol=1e-12)


def test_the_surface_evaluator_takes_one_batch():
    model, x, y = problem()
    dirs = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(2)]
    ev = SurfaceEvaluator(model, (x, y), dirs)
    loss, _ = ev.evaluate(0.0, 0.0)
    with torch.no_grad():
        assert loss == pytest.approx(float(F.cross_entropy(model(x), y)), rel=1e-9)


@pytest.mark.parametrize("data, problem_text", [
    (lambda x, y: x, "got a tensor of shape (48, 6)"),
    (lambda x, y: TensorDataset(x, y), "got a TensorDataset (a dataset of single samples): wrap it in a DataLoader"),
    (lambda x, y: [(x, y, y)], "batch 0 is a tuple of 3 items, not an (inputs, targets) pair"),
    (lambda x, y: {"x": x, "y": y}, "got a dict with keys 'x', 'y'"),
    (lambda x, y: [(x, y[0])], "batch 0: the targets are a tensor of shape (), not one entry per input"),
    (lambda x, y: (x[:5], y), "batch 0 has a tensor of shape (5, 6) but 48 targets"),
    (lambda x, y: [], "the data is empty (no batch)"),
])
def test_a_wrong_shape_is_one_line_naming_the_accepted_forms(data, problem_text):
    model, x, y = problem()
    for build in (lambda d: HessianOperator(model, d), lambda d: hessian(model, data=d), as_batches):
        with pytest.raises(ConfigError) as err:
            build(data(x, y))
        text = str(err.value)
        assert "\n" not in text and problem_text in text
        assert ACCEPTED in text or "batch 0 has" in text


def test_hessian_refuses_a_summed_criterion_and_two_data_arguments():
    model, x, y = problem()
    with pytest.raises(ConfigError, match=r"mean loss of a batch \(reduction='mean'\), got reduction='sum'"):
        hessian(model, nn.CrossEntropyLoss(reduction="sum"), data=(x, y))
    with pytest.raises(ConfigError, match="give the data once"):
        hessian(model, data=(x, y), dataloader=[(x, y)])
    with pytest.raises(ConfigError, match="give the data once"):
        hessian(model)
    with pytest.raises(ConfigError, match="the data must be one .inputs, targets. batch, .*; got None"):
        HessianOperator(model, None)


@pytest.mark.parametrize("document", ["README.md", "docs/analysis.md"])
def test_the_readme_pyhessian_block_runs_as_pasted(document, tmp_path, monkeypatch, capsys):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / document).read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if b.startswith("# coming from PyHessian")]
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("top-5 eigenvalues: [") and out[1].startswith("trace: ") and " +- " in out[1]
    assert out[2] == "density -> density.png" and (tmp_path / "density.png").read_bytes()[:4] == b"\x89PNG"
    # (the numbers themselves are checked against a dense Hessian in the tests above, on a smaller model)
    # and the README shows what it printed
    shown = text.split(blocks[0])[1]
    assert "\n".join(out) in shown[:400]
