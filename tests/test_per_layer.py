"""Per-layer curvature against a dense float64 Hessian: each module's block (weights and bias together) has the
dense block's top eigenvalues and trace, the blocks' traces add up to the whole trace (exactly for exact blocks,
within the standard errors for the estimators), no block's top eigenvalue exceeds the whole Hessian's; and
``flatfl hessian --per-layer`` writes per_layer.csv, its figures and hessian.json's ``per_layer``."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from dense import dense_hessian
from flatfl.analysis import hessian
from flatfl.analysis.estimators.per_layer import layer_groups, per_layer_curvature
from flatfl.cli import main
from flatfl.errors import ConfigError
from tiny_run import train_tiny

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def problem():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 3)).double()
    x = torch.randn(64, 6, dtype=torch.float64)
    y = torch.arange(64) % 3
    return model, x, y


def dense_blocks(model, dense):
    """The module blocks of the dense Hessian, by module name (parameters in registration order)."""
    offsets, blocks = 0, {}
    for name, p in model.named_parameters():
        module = name.rpartition(".")[0]
        blocks.setdefault(module, []).extend(range(offsets, offsets + p.numel()))
        offsets += p.numel()
    return {m: dense[np.ix_(idx, idx)] for m, idx in blocks.items()}


def test_exact_blocks_are_the_dense_blocks_and_add_up_to_the_whole_trace():
    model, x, y = problem()
    dense = dense_hessian(model, x, y)
    whole_top = np.linalg.eigvalsh(dense)[-1]
    truth = dense_blocks(model, dense)
    result = hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=False).per_layer(top_n=2)
    assert [b.module for b in result.blocks] == ["0", "2", "3"]  # Linear, LayerNorm, Linear: weight + bias each
    assert result.blocks[0].params == ["0.weight", "0.bias"] and result.blocks[0].dim == 84
    for b in result.blocks:
        assert b.method == "dense" and b.trace_stderr == 0  # at most 100 entries: formed exactly
        values = np.linalg.eigvalsh(truth[b.module])[::-1]
        assert np.allclose(b.eigenvalues, values[:2], rtol=1e-9, atol=1e-12)
        assert b.trace == pytest.approx(np.trace(truth[b.module]), rel=1e-10, abs=1e-12)
        assert b.eigenvalues[0] <= whole_top * (1 + 1e-9)  # Cauchy interlacing
    assert result.trace_sum == pytest.approx(np.trace(dense), rel=1e-10)


def test_estimated_blocks_agree_within_their_errors():
    model, x, y = problem()
    dense = dense_hessian(model, x, y)
    whole_top = np.linalg.eigvalsh(dense)[-1]
    truth = dense_blocks(model, dense)
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=False)
    result = h.per_layer(top_n=2, dense_up_to=0, max_hvps=60)  # every block by Lanczos and Hutch++
    assert h.last is result and h.last_per_layer is result
    for b in result.blocks:
        assert b.method == "lanczos+hutchpp"
        values = np.linalg.eigvalsh(truth[b.module])[::-1]
        assert np.allclose(b.eigenvalues, values[:2], rtol=1e-3)
        assert b.eigenvalues[0] <= whole_top * (1 + 1e-3)
        assert abs(b.trace - np.trace(truth[b.module])) <= 5 * b.trace_stderr + 1e-9
    assert abs(result.trace_sum - np.trace(dense)) <= 5 * result.trace_sum_stderr + 1e-9
    assert result.trace_sum_stderr == pytest.approx(np.sqrt(sum(b.trace_stderr ** 2 for b in result.blocks)))

    # one block per named parameter instead: they add up the same way
    per_param = per_layer_curvature(h.operator, 1, grouping="parameter")
    assert [b.module for b in per_param.blocks] == [n for n, _ in model.named_parameters()]
    assert per_param.trace_sum == pytest.approx(np.trace(dense), rel=1e-10)


def test_groups_and_bad_arguments():
    assert layer_groups(["w", "a.weight", "a.bias", "b.c.weight"]) == [("(model)", [0]), ("a", [1, 2]),
                                                                        ("b.c", [3])]
    model, x, y = problem()
    h = hessian(model, nn.CrossEntropyLoss(), data=(x, y), cuda=False)
    with pytest.raises(ConfigError, match="unknown per-layer grouping 'layer'"):
        h.per_layer(grouping="layer")
    with pytest.raises(ConfigError, match="positive integer"):
        h.per_layer(top_n=0)
    widest = max((sum(p.numel() for p in m.parameters(recurse=False)), n) for n, m in model.named_modules()
                 if any(True for _ in m.parameters(recurse=False)))
    with pytest.raises(ConfigError, match=f"larger than the largest block \\({widest[1]}: {widest[0]:,} parameters"):
        h.per_layer(top_n=widest[0] + 1)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("per_layer") / "run")


def test_the_command_writes_per_layer_files(run_dir, tmp_path):
    out = tmp_path / "h"
    r = CliRunner().invoke(main, ["hessian", str(run_dir), "--per-layer", "--per-layer-top", "2", "--top", "2",
                                  "--samples", "128", "--trace-hvps", "60", "--quiet", "--out", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "per layer (2 modules)" in r.output
    report = json.loads((out / "hessian.json").read_text())
    layers = report["per_layer"]
    assert layers["grouping"] == "module" and [b["module"] for b in layers["blocks"]] == ["hidden.0", "classifier"]
    rows = list(csv.DictReader(open(out / "per_layer.csv")))
    assert [row["module"] for row in rows] == ["hidden.0", "classifier"]
    for row, block in zip(rows, layers["blocks"]):
        assert float(row["eigenvalue_1"]) == block["top_eigenvalues"][0] and float(row["trace"]) == block["trace"]
        assert row["parameters"] == " ".join(block["params"]) and int(row["size"]) == block["dim"]
        assert block["top_eigenvalues"][0] <= report["top_eigenvalues"][0] * (1 + 1e-3)
    whole = report["trace"]
    gap = abs(layers["trace_sum"] - whole["estimate"])
    assert gap <= 5 * np.hypot(layers["trace_sum_stderr"], whole["stderr"])
    for name in ("per_layer.png", "per_layer.pdf"):
        assert (out / name).stat().st_size > 0
    assert report["settings"]["per_layer"] is True and report["settings"]["per_layer_top"] == 2
    assert report["hvps_total"] == report["eigen"]["hvps"] + whole["hvps"] + layers["hvps"]

    # the next run of the same analysis without --per-layer keeps the earlier per-layer results of these weights
    # (files and section, marked as kept with the settings they were computed with); it does not delete what it did
    # not replace (an analysis with other settings is refused in this folder: tests/test_hessian_naming.py)
    before = (out / "per_layer.csv").read_bytes()
    r = CliRunner().invoke(main, ["hessian", str(run_dir), "--top", "2", "--samples", "128", "--trace-hvps", "60",
                                  "--quiet", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert (out / "per_layer.csv").read_bytes() == before and (out / "per_layer.png").stat().st_size > 0
    again = json.loads((out / "hessian.json").read_text())
    assert again["settings"]["per_layer"] is False and "per_layer.csv" in again["files"]
    kept = again["per_layer"].pop("kept_from_earlier_analysis")
    assert again["per_layer"] == layers and kept["settings"]["trace_hvps"] == 60
