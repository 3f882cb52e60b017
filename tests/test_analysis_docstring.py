"""The Python example in ``flatfl.analysis``'s docstring runs as written (on a real tiny run), and its results agree
with a dense eigendecomposition (issue 18.7)."""
from __future__ import annotations

import re
import textwrap

import numpy as np
import torch
from click.testing import CliRunner

import flatfl.analysis
from flatfl.cli import main


def docstring_example() -> str:
    doc = flatfl.analysis.__doc__
    block = re.search(r"::\n\n((?:    .*\n|\n)+?)\n(?=\S)", doc)
    assert block, "flatfl.analysis docstring has no '::' example block"
    return textwrap.dedent(block.group(1))


def test_analysis_docstring_example_runs(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = tmp_path / "RUN"
        r = CliRunner().invoke(main, ["train", "--model", "tiny", "--rounds", "1", "--clients", "2", "--quiet",
                                      "--out", str(run)])
        assert r.exit_code == 0, r.output
        monkeypatch.chdir(tmp_path)  # the example opens "RUN/final.pt"
        code = docstring_example()
        assert '"RUN/final.pt"' in code and "smoothed_density(" in code
        scope: dict = {}
        exec(compile(code, "flatfl.analysis docstring", "exec"), scope)
    finally:
        torch.set_num_threads(before)
    eig, tr, esd, op = scope["eig"], scope["tr"], scope["esd"], scope["op"]
    eye = torch.eye(op.dim, dtype=op.dtype)
    dense = torch.cat([op.matmat(eye[:, i:i + 512]) for i in range(0, op.dim, 512)], dim=1).double().numpy()
    truth = np.linalg.eigvalsh((dense + dense.T) / 2)[::-1]
    assert np.allclose(eig.eigenvalues, truth[:20], rtol=1e-3, atol=1e-6)
    assert eig.eigenvectors.shape == (20, op.dim)
    assert abs(tr.estimate - np.trace(dense)) < 5 * tr.stderr + 1e-6
    grid, density = scope["grid"], scope["density"]
    assert len(grid) == len(density) and np.all(np.asarray(density) >= 0)
    assert all(abs(float(np.sum(w)) - 1.0) < 1e-6 for w in esd.weights)  # quadrature weights of a unit start
